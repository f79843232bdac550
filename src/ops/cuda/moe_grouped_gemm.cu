// Grouped expert GEMMs with an fp32 output, each one launch over every expert (moe_kernels.h).
// cuBLAS has no grouped GEMM with bf16 inputs and an fp32 C, and one cuBLAS call per expert
// leaves the GPU mostly idle (an expert's [1024 × 512] product is 32 tiles of 128 × 128 for 132
// SMs) and costs a launch each; here every (tile, expert) is one CTA of one grid.
//
//   launch_grouped_weight_grad  C_e [M, N] += A_eᵀ·B_e, A_e / B_e = the expert's rows of A [R, M]
//                               and B [R, N] (weight gradients: K = the expert's rows)
//   launch_grouped_rows_f32     Y_e [n_e, N] = A1_e·B1_e (+ A2_e·B2_e), A_e = the expert's rows of
//                               A [R, K], B_e = W + e·K·N [K, N] (the fp32 input-gradient rows)
//   launch_grouped_rows_bf16    the same with one product and a bf16 out (the backward's dh rows)
//   launch_grouped_rows_nk_bf16 Y_e [n_e, N] = A_e·W_eᵀ, W_e = W + e·N·K stored [N, K] (the expert
//                               weights as the model keeps them: the forward's gate, up, down),
//                               bf16 out; both operands [rows][k], plain ldmatrix
//
// CTA: a 128 × 128 output tile, 256 threads = 8 warps as 2 (rows) × 4 (columns), each warp
// 64 × 32 (4 × 4 mma tiles of 16 × 8, fp32 accumulators in registers). Operands stored [k][m] /
// [k][n] (the sorted activation rows of the weight gradient, the weights) are read with
// ldmatrix.trans, row-major [m][k] ones (the activation rows of Y) with plain ldmatrix; padded
// smem rows (272 / 144 bytes) keep every ldmatrix phase conflict-free.
//
// K pipeline: steps of 64 through a ring of 3 cp.async stages in dynamic smem (34 KB / 35 KB a
// stage, 102 KB / 105 KB a CTA: 2 CTAs fit an SM's 228 KB; ≤ 128 registers by the launch
// bounds, no spills). While step t is multiplied, steps t+1 and t+2 are in flight, one barrier
// per step. Why: a 64-deep step is 512 mma.sync per CTA, ~2000 cycles with the SM's other CTA,
// so two steps of lead cover the ~600-900 cycles of L2 / HBM latency that the former double
// buffer (one 32-deep step of lead, two barriers a step) left exposed. Each thread's copy
// addresses are set up once per CTA (KRowsCopy, MRowsCopy): per-copy 64-bit index arithmetic
// had cost as many issue slots as the mma work. The weight gradient's C_e += (beta = 1, the
// callers accumulate) goes through smem, so each thread has 16 loads of C in flight at a time;
// read-modify-writes straight from the fragments were 32 dependent HBM round trips a thread.
// The last step of a short K multiplies only its 16-deep slices that hold data, and in the rows
// kernel a warp whose 64 rows all lie past its expert's end skips the multiply.
//
// Measured on an H200 (standalone harness; 32 experts × 674…864 rows, Din 512, F 1024):
//   weight gradient [1024 × 512] per expert: 226 → 111 µs (114 → 232 TFLOP/s; 25.8 GFLOP)
//   rows, two products, K 1024, N 512:       318 → 206 µs (162 → 250 TFLOP/s; 51.5 GFLOP)
// With the global loads removed (smem left as is) the same loops take 96 / 187 µs: the rest
// is the mma.sync loop itself (~270 TFLOP/s at 4 warps per scheduler), not memory; the next
// step would be wgmma. Uneven experts cost the rows kernel partial row tiles: 181 µs when every
// expert has 768 rows (768 CTAs on 264 slots instead of ~830).
//
// Rows past the expert's end, columns past M / N and k past K are zero-filled. Each output
// element has one writer and sums its k in ascending order, 16 at a time (the same order as
// the former kernel: bitwise equal results): deterministic, no atomics. Experts without rows
// return at once.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/moe_grouped_tiles.cuh"
#include "ops/cuda/moe_kernels.h"

namespace dm::cuda::moe_detail {
namespace {

using attention_detail::cp_async_16;
using attention_detail::cp_async_commit;
using attention_detail::cp_async_wait;
using attention_detail::ldmatrix_x4_trans;
using attention_detail::mma_bf16_16x8x16;

constexpr int kTileM = kGroupedTileRows, kTileN = 128, kTileK = 64, kStages = 3;
constexpr int kWarpsM = 2, kWarpsN = 4;  // the CTA's warps, rows × columns
constexpr int kThreads = 32 * kWarpsM * kWarpsN;
constexpr int kWarpM = kTileM / kWarpsM, kWarpN = kTileN / kWarpsN;  // a warp's output tile
constexpr int kFragsM = kWarpM / 16, kFragsN = kWarpN / 8;           // its 16 × 8 mma tiles
constexpr int kLd = kTileM + 8;      // [k][m] / [k][n] smem row (bf16): 272 bytes
constexpr int kRowsLd = kTileK + 8;  // [m][k] smem row (bf16): 144 bytes
static_assert(kTileM == kTileN, "one smem row length for both [k][·] operands");

// Smem tiles of one stage, in bf16 elements.
constexpr int kKRowsTile = kTileK * kLd;             // [64][136] operand stored [k][m] or [k][n]
constexpr int kMRowsTile = kTileM * kRowsLd;         // [128][72] operand stored [m][k]
constexpr int kWeightGradStage = 2 * kKRowsTile;     // A then B: 34 KB
constexpr int kRowsStage = kMRowsTile + kKRowsTile;  // A then B: 35 KB
constexpr int kWeightGradSmem = kStages * kWeightGradStage * 2;  // bytes: 104448
constexpr int kRowsSmem = kStages * kRowsStage * 2;              // bytes: 107520
constexpr int kRowsNkStage = 2 * kMRowsTile;                     // A then W rows: 36 KB
constexpr int kRowsNkSmem = kStages * kRowsNkStage * 2;          // bytes: 110592

__device__ __forceinline__ __nv_bfloat16* dynamic_smem() {
  extern __shared__ uint4 moe_gemm_smem[];  // 16-byte aligned
  return reinterpret_cast<__nv_bfloat16*>(moe_gemm_smem);
}

// Each thread's share of one stage's cp.async copies: its offset from the matrix base and its
// bounds are set up once per CTA and advanced one step per issue() (the pipeline loads steps
// 0, 1, 2, … in order), so a 16-byte copy costs a few adds, a compare and a select; the former
// per-copy 64-bit row·stride products were ~20 instructions a copy, as many issue slots as the
// mma.sync work. The matrix base is an argument of issue() and rewind() steps back, so one
// copier serves both products of the rows kernel (same shapes) without restart state: the K
// loop runs at the 128-register cap.

// Rows k of a row-major bf16 matrix G [·, ld] into a [64][kLd] tile ([k][m] / [k][n] operands):
// the thread owns column chunk (tid % 16)·8 and tile rows tid/16 + 16·i, i < 4. Rows at or past
// k_end and a chunk at or past `cols` are zero-filled.
struct KRowsCopy {
  static constexpr int kChunksPerRow = kTileM / 8;               // 16
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // 16
  static constexpr int kPasses = kTileK / kRowsPerPass;          // 4
  int64_t offset;   // elements from G to this thread's first chunk of the next step
  int rows_left;    // rows from that chunk's row to k_end
  int smem_offset;  // elements, within the tile
  bool col_ok;

  __device__ __forceinline__ KRowsCopy(int64_t ld, int64_t k_first, int64_t k_end, int64_t col0,
                                       int64_t cols) {
    const int r = threadIdx.x / kChunksPerRow, c = (threadIdx.x % kChunksPerRow) * 8;
    col_ok = col0 + c < cols;
    offset = (k_first + r) * ld + col0 + c;
    const int64_t left = k_end - k_first - r;
    rows_left = int(left < (int64_t(1) << 30) ? left : (int64_t(1) << 30));
    smem_offset = r * kLd + c;
  }
  // The next step of G (row stride ld) into `tile`; zero-filled copies read G itself, which
  // stays a valid address.
  __device__ __forceinline__ void issue(__nv_bfloat16* tile, const __nv_bfloat16* G, int64_t ld) {
    const __nv_bfloat16* src = G + offset;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const bool valid = col_ok && i * kRowsPerPass < rows_left;
      cp_async_16(tile + smem_offset + i * kRowsPerPass * kLd, valid ? src : G, valid);
      src += kRowsPerPass * ld;
    }
    offset += kTileK * ld;
    rows_left -= kTileK;
  }
  __device__ __forceinline__ void rewind(int steps, int64_t ld) {
    offset -= int64_t(steps) * kTileK * ld;
    rows_left += steps * kTileK;
  }
};

// Rows [row0, row_end) (≤ 128) of A [·, K] (row-major, row stride K), 64 k columns a step, into
// a [128][kRowsLd] tile ([m][k] operand): the thread owns k chunk (tid % 8)·8 and tile rows
// tid/8 + 32·i, i < 4. Rows at or past row_end and k at or past K are zero-filled.
struct MRowsCopy {
  static constexpr int kChunksPerRow = kTileK / 8;               // 8
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // 32
  static constexpr int kPasses = kTileM / kRowsPerPass;          // 4
  int64_t offset;   // elements from A to this thread's first chunk of the next step
  int rows_left;    // rows from this thread's first row to row_end
  int k_left;       // K − this thread's first k of the next step
  int smem_offset;  // elements, within the tile

  __device__ __forceinline__ MRowsCopy(int64_t K, int64_t row0, int64_t row_end) {
    const int r = threadIdx.x / kChunksPerRow, c = (threadIdx.x % kChunksPerRow) * 8;
    offset = (row0 + r) * K + c;
    const int64_t rows = row_end - row0 - r;
    rows_left = int(rows < kTileM ? rows : kTileM);
    k_left = int(K < (int64_t(1) << 30) ? K : (int64_t(1) << 30)) - c;
    smem_offset = r * kRowsLd + c;
  }
  __device__ __forceinline__ void issue(__nv_bfloat16* tile, const __nv_bfloat16* A, int64_t K) {
    const __nv_bfloat16* src = A + offset;
    const bool k_ok = k_left > 0;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const bool valid = k_ok && i * kRowsPerPass < rows_left;
      cp_async_16(tile + smem_offset + i * kRowsPerPass * kRowsLd, valid ? src : A, valid);
      src += kRowsPerPass * K;
    }
    offset += kTileK;
    k_left -= kTileK;
  }
  __device__ __forceinline__ void rewind(int steps) {
    offset -= steps * kTileK;
    k_left += steps * kTileK;
  }
};

// The warp's kWarpM × kWarpN share of the CTA's output tile: warp row wm, warp column wn.
struct WarpTile {
  int lane, wm, wn;
  __device__ __forceinline__ WarpTile()
      : lane(threadIdx.x & 31),
        wm((threadIdx.x >> 5) / kWarpsN),
        wn((threadIdx.x >> 5) % kWarpsN) {}
};

// acc += the 16-deep slice kk of one stage. B is stored [k][n] (ldmatrix.trans), or [n][k] with
// row stride kRowsLd when kBByN (plain ldmatrix: matrix i = lane/8 takes n half i/2, k half i%2,
// which is the order of the two n tiles' (k low, k high) fragments); A is stored [k][m] with row
// stride kLd when kAByK (ldmatrix.trans: matrix i = lane/8 takes k half i/2, m half i%2), else
// [m][k] with row stride kRowsLd (plain ldmatrix: row lane%16, k half lane/16).
template <bool kAByK, bool kBByN = false>
__device__ __forceinline__ void mma_slice(float (&acc)[kFragsM][kFragsN][4],
                                          const __nv_bfloat16* as, const __nv_bfloat16* bs,
                                          const WarpTile& w, int kk) {
  const int lane = w.lane;
  const int b_k = (lane & 7) + (((lane >> 3) & 1) << 3), b_n = (lane >> 4) << 3;
  uint32_t a[kFragsM][4], b[kFragsN / 2][4];
#pragma unroll
  for (int i = 0; i < kFragsM; ++i) {
    if (kAByK)
      ldmatrix_x4_trans(a[i], as + (kk + (lane & 7) + ((lane >> 4) << 3)) * kLd + w.wm * kWarpM +
                                  i * 16 + (((lane >> 3) & 1) << 3));
    else
      attention_detail::ldmatrix_x4(
          a[i], as + (w.wm * kWarpM + i * 16 + (lane & 15)) * kRowsLd + kk + ((lane >> 4) << 3));
  }
#pragma unroll
  for (int j = 0; j < kFragsN / 2; ++j) {
    if (kBByN)
      attention_detail::ldmatrix_x4(b[j], bs + (w.wn * kWarpN + j * 16 + (lane & 7) +
                                                ((lane >> 4) << 3)) * kRowsLd +
                                              kk + (((lane >> 3) & 1) << 3));
    else
      ldmatrix_x4_trans(b[j], bs + (kk + b_k) * kLd + w.wn * kWarpN + j * 16 + b_n);
  }
#pragma unroll
  for (int i = 0; i < kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < kFragsN; ++j)
      mma_bf16_16x8x16(acc[i][j], a[i], b[j >> 1][2 * (j & 1)], b[j >> 1][2 * (j & 1) + 1]);
}

// acc += the first k_valid k of one stage (16-deep slices; the skipped ones hold only
// zero-filled k). A full stage is straight-line code, so the compiler can load the next slice's
// fragments under the current slice's mma; only a K tail (the last step) takes the branches.
template <bool kAByK, bool kBByN = false>
__device__ __forceinline__ void mma_stage(float (&acc)[kFragsM][kFragsN][4],
                                          const __nv_bfloat16* as, const __nv_bfloat16* bs,
                                          const WarpTile& w, int k_valid) {
  if (k_valid >= kTileK) {
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) mma_slice<kAByK, kBByN>(acc, as, bs, w, kk);
  } else {
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16)
      if (kk < k_valid) mma_slice<kAByK, kBByN>(acc, as, bs, w, kk);
  }
}

// `steps` K steps through a ring of kStages smem slots: load(step, slot) issues the cp.async
// copies of a step (each step once, in order), compute(step, slot) consumes one. The prologue
// puts steps 0 … kStages−2 in flight; iteration t waits for step t (this thread's copies, then
// everyone's at the barrier, which also tells that step t−1's slot is no longer read), refills
// that slot with step t + kStages − 1 and multiplies step t. One commit group per step, empty
// past the end, keeps the wait count fixed.
template <class Load, class Compute>
__device__ __forceinline__ void pipelined(int steps, Load&& load, Compute&& compute) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load(s, s);
    cp_async_commit();
  }
  int slot = 0;  // step t's slot: t % kStages
  for (int t = 0; t < steps; ++t) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (t + kStages - 1 < steps) load(t + kStages - 1, slot == 0 ? kStages - 1 : slot - 1);
    cp_async_commit();
    compute(t, slot);
    slot = slot + 1 == kStages ? 0 : slot + 1;
  }
  cp_async_wait<0>();
}

// out(row, col, x, y) for each pair of adjacent accumulator elements, (row, col) relative to the
// output tile: element (row g / g+8, columns 2tq, 2tq+1) of each 16 × 8 mma tile.
template <class Out>
__device__ __forceinline__ void for_each_pair(const float (&acc)[kFragsM][kFragsN][4],
                                              const WarpTile& w, Out&& out) {
  const int g = w.lane >> 2, tq = w.lane & 3;
#pragma unroll
  for (int i = 0; i < kFragsM; ++i)
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int j = 0; j < kFragsN; ++j)
        out(w.wm * kWarpM + i * 16 + g + half * 8, w.wn * kWarpN + j * 8 + 2 * tq,
            acc[i][j][2 * half], acc[i][j][2 * half + 1]);
}

__global__ void __launch_bounds__(kThreads, 2)
    grouped_weight_grad_kernel(const __nv_bfloat16* __restrict__ A, int64_t lda,
                               const __nv_bfloat16* __restrict__ B, int64_t ldb,
                               const int64_t* __restrict__ offsets, int64_t M, int64_t N,
                               float* __restrict__ C) {
  const int e = blockIdx.z;
  const int64_t row_begin = offsets[e], row_end = offsets[e + 1];
  if (row_end <= row_begin) return;
  const int64_t m0 = int64_t(blockIdx.y) * kTileM, n0 = int64_t(blockIdx.x) * kTileN;
  const WarpTile w;
  __nv_bfloat16* smem = dynamic_smem();
  KRowsCopy a_copy(lda, row_begin, row_end, m0, M), b_copy(ldb, row_begin, row_end, n0, N);
  float acc[kFragsM][kFragsN][4] = {};
  pipelined(
      int((row_end - row_begin + kTileK - 1) / kTileK),
      [&](int, int slot) {
        __nv_bfloat16* stage = smem + slot * kWeightGradStage;
        a_copy.issue(stage, A, lda);
        b_copy.issue(stage + kKRowsTile, B, ldb);
      },
      [&](int step, int slot) {
        const __nv_bfloat16* stage = smem + slot * kWeightGradStage;
        const int64_t left = row_end - row_begin - int64_t(step) * kTileK;
        mma_stage<true>(acc, stage, stage + kKRowsTile, w, left < kTileK ? int(left) : kTileK);
      });

  // C_e += acc, through smem: the fragments go to an fp32 [128][kCLd] tile over the idle
  // pipeline slots, then each thread loads its 32 float2 of C, 16 at a time (a warp: 256
  // contiguous bytes of a row), adds and stores. Adding straight from the fragments compiled
  // into 32 dependent load → store round trips to HBM per thread (~25k cycles a CTA, as long as
  // its K loop at the training shape).
  constexpr int kCLd = kTileN + 8;  // fp32 row: the fragments' float2 stores are conflict-free
  static_assert(kTileM * kCLd * 4 <= kWeightGradSmem, "C tile fits the pipeline's smem");
  constexpr int kPairsPerRow = kTileN / 2, kRowsPerPass = kThreads / kPairsPerRow;  // 64, 4
  constexpr int kPasses = kTileM / kRowsPerPass;                                    // 32
  float* c_s = reinterpret_cast<float*>(smem);
  __syncthreads();  // every warp is done reading the last stage
  for_each_pair(acc, w, [&](int r, int c, float x, float y) {
    *reinterpret_cast<float2*>(c_s + r * kCLd + c) = make_float2(x, y);
  });
  __syncthreads();
  // This thread: columns n0 + c, c + 1 (N is even: a pair never straddles the last column) of
  // rows m0 + r0 + 4·i.
  const int c = (threadIdx.x % kPairsPerRow) * 2, r0 = threadIdx.x / kPairsPerRow;
  const bool col_ok = n0 + c < N;
  const int64_t rows = M - m0 - r0;
  const int rows_left = int(rows < kTileM ? rows : kTileM);
  float* c_e = C + int64_t(e) * M * N + (m0 + r0) * N + n0 + c;
  // 16 loads in flight per thread (32 registers): all 32 pairs at once go over the 128
  // registers of 2 CTAs per SM.
  constexpr int kBatch = 16;
  static_assert(kPasses % kBatch == 0, "whole batches");
#pragma unroll
  for (int b = 0; b < kPasses; b += kBatch) {
    float2 old[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i)
      old[i] = col_ok && (b + i) * kRowsPerPass < rows_left
                   ? *reinterpret_cast<const float2*>(c_e + int64_t(b + i) * kRowsPerPass * N)
                   : make_float2(0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (!(col_ok && (b + i) * kRowsPerPass < rows_left)) continue;
      const float2 add =
          *reinterpret_cast<const float2*>(c_s + (r0 + (b + i) * kRowsPerPass) * kCLd + c);
      *reinterpret_cast<float2*>(c_e + int64_t(b + i) * kRowsPerPass * N) =
          make_float2(old[i].x + add.x, old[i].y + add.y);
    }
  }
}

// ---- Y_e = A1_e·B1_e (+ A2_e·B2_e) over each expert's rows ---------------------------------

// Two adjacent output elements (an even column: 8-byte / 4-byte aligned).
__device__ __forceinline__ void store_pair(float* p, float x, float y) {
  *reinterpret_cast<float2*>(p) = make_float2(x, y);
}
__device__ __forceinline__ void store_pair(__nv_bfloat16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}

// Out: float (the fp32 input-gradient rows) or __nv_bfloat16 (the backward's dh rows).
template <typename Out>
__global__ void __launch_bounds__(kThreads, 2)
    grouped_rows_kernel(const __nv_bfloat16* __restrict__ A1, const __nv_bfloat16* __restrict__ B1,
                        const __nv_bfloat16* __restrict__ A2, const __nv_bfloat16* __restrict__ B2,
                        const int64_t* __restrict__ offsets, int E, int64_t K, int64_t N,
                        Out* __restrict__ Y) {
  GroupedRowTile tile;
  if (!find_row_tile(offsets, E, blockIdx.y, &tile)) return;
  const int e = tile.expert, tile_rows = tile.rows;
  const int64_t row0 = tile.row0, n0 = int64_t(blockIdx.x) * kTileN;
  const WarpTile w;
  // The expert's last row tile may end within the first warp row: the second one then only
  // multiplies zero rows that are never written.
  const bool warp_has_rows = w.wm * kWarpM < tile_rows;
  __nv_bfloat16* smem = dynamic_smem();
  MRowsCopy a_copy(K, row0, row0 + tile_rows);
  KRowsCopy b_copy(N, 0, K, n0, N);
  float acc[kFragsM][kFragsN][4] = {};
  // Steps over K for the first product, then (A2 given) over K again for the second.
  const int k_steps = int((K + kTileK - 1) / kTileK);
  pipelined(
      A2 ? 2 * k_steps : k_steps,
      [&](int step, int slot) {
        if (step == k_steps) {  // the second product: the same rows of A2, B2_e
          a_copy.rewind(k_steps);
          b_copy.rewind(k_steps, N);
        }
        const bool second = step >= k_steps;
        __nv_bfloat16* stage = smem + slot * kRowsStage;
        a_copy.issue(stage, second ? A2 : A1, K);
        b_copy.issue(stage + kMRowsTile, (second ? B2 : B1) + int64_t(e) * K * N, N);
      },
      [&](int step, int slot) {
        const __nv_bfloat16* stage = smem + slot * kRowsStage;
        const int64_t left = K - int64_t(step >= k_steps ? step - k_steps : step) * kTileK;
        if (warp_has_rows)
          mma_stage<false>(acc, stage, stage + kMRowsTile, w, left < kTileK ? int(left) : kTileK);
      });
  for_each_pair(acc, w, [&](int r, int c, float x, float y) {
    const int64_t col = n0 + c;
    if (r >= tile_rows || col >= N) return;
    store_pair(Y + (row0 + r) * N + col, x, y);
  });
}

// Y_e = A_e·W_eᵀ with W_e [N, K] (k contiguous): the rows kernel's tiling and pipeline with the
// weight tile loaded like the activation tile ([n][k], MRowsCopy) and read by plain ldmatrix,
// and a bf16 output (the forward's gate, up and expert rows).
__global__ void __launch_bounds__(kThreads, 2) grouped_rows_nk_bf16_kernel(
    const __nv_bfloat16* __restrict__ A, const __nv_bfloat16* __restrict__ W,
    const int64_t* __restrict__ offsets, int E, int64_t K, int64_t N, __nv_bfloat16* __restrict__ Y) {
  GroupedRowTile tile;
  if (!find_row_tile(offsets, E, blockIdx.y, &tile)) return;
  const int e = tile.expert, tile_rows = tile.rows;
  const int64_t row0 = tile.row0, n0 = int64_t(blockIdx.x) * kTileN;
  const WarpTile w;
  const bool warp_has_rows = w.wm * kWarpM < tile_rows;
  __nv_bfloat16* smem = dynamic_smem();
  const __nv_bfloat16* W_e = W + int64_t(e) * N * K;
  MRowsCopy a_copy(K, row0, row0 + tile_rows);
  MRowsCopy b_copy(K, n0, N);  // rows n0 … n0 + 127 of W_e; rows at or past N zero-filled
  float acc[kFragsM][kFragsN][4] = {};
  const int k_steps = int((K + kTileK - 1) / kTileK);
  pipelined(
      k_steps,
      [&](int, int slot) {
        __nv_bfloat16* stage = smem + slot * kRowsNkStage;
        a_copy.issue(stage, A, K);
        b_copy.issue(stage + kMRowsTile, W_e, K);
      },
      [&](int step, int slot) {
        const __nv_bfloat16* stage = smem + slot * kRowsNkStage;
        const int64_t left = K - int64_t(step) * kTileK;
        if (warp_has_rows)
          mma_stage<false, true>(acc, stage, stage + kMRowsTile, w, left < kTileK ? int(left) : kTileK);
      });
  for_each_pair(acc, w, [&](int r, int c, float x, float y) {
    const int64_t col = n0 + c;
    if (r >= tile_rows || col >= N) return;
    store_pair(Y + (row0 + r) * N + col, x, y);
  });
}

// Dynamic smem past 48 KB must be allowed per kernel; the carveout asks for the full 228 KB of
// an SM as smem, so 2 CTAs fit.
template <typename Kernel>
void allow_two_ctas_of_smem(Kernel kernel, int bytes) {
  DM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  DM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     int(cudaSharedmemCarveoutMaxShared)));
}

template <typename Out>
void launch_grouped_rows(const uint16_t* A1, const uint16_t* B1, const uint16_t* A2,
                         const uint16_t* B2, const int64_t* offsets, int E, int64_t R, int64_t K,
                         int64_t N, Out* Y, CUstream_st* stream) {
  if (E <= 0 || R <= 0 || N <= 0) return;
  allow_two_ctas_of_smem(grouped_rows_kernel<Out>, kRowsSmem);
  grouped_rows_kernel<Out>
      <<<grouped_rows_grid(R, E, N), kThreads, kRowsSmem, reinterpret_cast<cudaStream_t>(stream)>>>(
          reinterpret_cast<const __nv_bfloat16*>(A1), reinterpret_cast<const __nv_bfloat16*>(B1),
          reinterpret_cast<const __nv_bfloat16*>(A2), reinterpret_cast<const __nv_bfloat16*>(B2),
          offsets, E, K, N, Y);
  DM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_grouped_rows_f32(const uint16_t* A1, const uint16_t* B1, const uint16_t* A2,
                             const uint16_t* B2, const int64_t* offsets, int E, int64_t R,
                             int64_t K, int64_t N, float* Y, CUstream_st* stream) {
  launch_grouped_rows(A1, B1, A2, B2, offsets, E, R, K, N, Y, stream);
}

void launch_grouped_rows_bf16(const uint16_t* A, const uint16_t* B, const int64_t* offsets, int E,
                              int64_t R, int64_t K, int64_t N, uint16_t* Y, CUstream_st* stream) {
  launch_grouped_rows(A, B, nullptr, nullptr, offsets, E, R, K, N,
                      reinterpret_cast<__nv_bfloat16*>(Y), stream);
}

void launch_grouped_rows_nk_bf16(const uint16_t* A, const uint16_t* W, const int64_t* offsets,
                                 int E, int64_t R, int64_t K, int64_t N, uint16_t* Y,
                                 CUstream_st* stream) {
  if (E <= 0 || R <= 0 || N <= 0) return;
  allow_two_ctas_of_smem(grouped_rows_nk_bf16_kernel, kRowsNkSmem);
  grouped_rows_nk_bf16_kernel<<<grouped_rows_grid(R, E, N), kThreads, kRowsNkSmem,
                                reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const __nv_bfloat16*>(A), reinterpret_cast<const __nv_bfloat16*>(W),
      offsets, E, K, N, reinterpret_cast<__nv_bfloat16*>(Y));
  DM_CUDA_CHECK(cudaGetLastError());
}

void launch_grouped_weight_grad(const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                                const int64_t* offsets, int E, int64_t M, int64_t N, float* C,
                                CUstream_st* stream) {
  if (E <= 0 || M <= 0 || N <= 0) return;
  const dim3 grid(unsigned((N + kTileN - 1) / kTileN), unsigned((M + kTileM - 1) / kTileM),
                  unsigned(E));
  allow_two_ctas_of_smem(grouped_weight_grad_kernel, kWeightGradSmem);
  grouped_weight_grad_kernel<<<grid, kThreads, kWeightGradSmem,
                               reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const __nv_bfloat16*>(A), lda, reinterpret_cast<const __nv_bfloat16*>(B),
      ldb, offsets, M, N, C);
  DM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dm::cuda::moe_detail
