// Grouped expert GEMMs with an fp32 output, each one launch over every expert (moe_kernels.h).
// cuBLAS has no grouped GEMM with bf16 inputs and an fp32 C, and one cuBLAS call per expert
// leaves the GPU mostly idle (an expert's [1024 × 512] product is 32 tiles of 128 × 128 for 132
// SMs) and costs a launch each; here every (tile, expert) is one CTA of one grid.
//
//   launch_grouped_weight_grad  C_e [M, N] += A_eᵀ·B_e, A_e / B_e = the expert's rows of A [R, M]
//                               and B [R, N] (weight gradients: K = the expert's rows)
//   launch_grouped_rows_f32     Y_e [n_e, N] = A1_e·B1_e (+ A2_e·B2_e), A_e = the expert's rows of
//                               A [R, K], B_e = W + e·K·N [K, N] (the fp32 input-gradient rows)
//
// CTA: a 128 × 128 output tile, 256 threads = 8 warps as 2 (rows) × 4 (columns), each warp
// 64 × 32 (4 × 4 mma tiles of 16 × 8, fp32 accumulators in registers). The K loop goes 32 at a
// time through a double-buffered cp.async pipeline. Operands stored [k][m] / [k][n] (the sorted
// activation rows of the weight gradient, the weights) are read with ldmatrix.trans, row-major
// [m][k] ones (the activation rows of Y) with plain ldmatrix. Rows past the expert's end, columns
// past M / N and k past K are zero-filled. Each output element has one writer: deterministic,
// no atomics. Experts without rows return at once.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/moe_kernels.h"

namespace dm::cuda::moe_detail {
namespace {

using attention_detail::cp_async_16;
using attention_detail::cp_async_commit;
using attention_detail::cp_async_wait;
using attention_detail::ldmatrix_x4_trans;
using attention_detail::mma_bf16_16x8x16;

constexpr int kTileM = 128, kTileN = 128, kTileK = 32, kThreads = 256;
constexpr int kLd = kTileM + 8;  // padded smem row (bf16): 272 bytes, conflict-free ldmatrix
static_assert(kTileM == kTileN, "one smem row length for both operands");

// One stage: rows [k0, k0 + 32) of A (columns m0…m0+127) and B (columns n0…n0+127).
__device__ __forceinline__ void load_stage(__nv_bfloat16* a_s, __nv_bfloat16* b_s,
                                           const __nv_bfloat16* A, int64_t lda,
                                           const __nv_bfloat16* B, int64_t ldb, int64_t row0,
                                           int64_t row_end, int64_t m0, int64_t M, int64_t n0,
                                           int64_t N) {
  constexpr int kChunks = kTileK * (kTileM / 8);  // 16-byte chunks per operand
  for (int c = threadIdx.x; c < 2 * kChunks; c += kThreads) {
    const bool is_a = c < kChunks;
    const int idx = is_a ? c : c - kChunks;
    const int r = idx / (kTileM / 8), col = (idx % (kTileM / 8)) * 8;
    const int64_t row = row0 + r;
    const int64_t gcol = (is_a ? m0 : n0) + col;
    const bool valid = row < row_end && gcol < (is_a ? M : N);
    const __nv_bfloat16* base = is_a ? A : B;
    const __nv_bfloat16* src = valid ? base + row * (is_a ? lda : ldb) + gcol : base;
    cp_async_16((is_a ? a_s : b_s) + r * kLd + col, src, valid);
  }
}

constexpr int kRowsLd = kTileK + 8;  // [m][k] A tile row (bf16): 80 bytes, conflict-free ldmatrix

// The warp's 64 × 32 share of a 128 × 128 output tile: warps 2 (rows) × 4 (columns).
struct WarpTile {
  int lane, wm, wn;
  __device__ __forceinline__ WarpTile()
      : lane(threadIdx.x & 31), wm(threadIdx.x >> 7), wn((threadIdx.x >> 5) & 3) {}
};

// acc += one 32-deep stage. B is stored [k][n] (ldmatrix.trans); A is stored [k][m] with row
// stride kLd when kAByK (ldmatrix.trans: matrix i = lane/8 takes k half i/2, m half i%2), else
// [m][k] with row stride kRowsLd (plain ldmatrix: row lane%16, k half lane/16).
template <bool kAByK>
__device__ __forceinline__ void mma_stage(float (&acc)[4][4][4], const __nv_bfloat16* as,
                                          const __nv_bfloat16* bs, const WarpTile& w) {
  const int lane = w.lane;
  const int b_k = (lane & 7) + (((lane >> 3) & 1) << 3), b_n = (lane >> 4) << 3;
#pragma unroll
  for (int kk = 0; kk < kTileK; kk += 16) {
    uint32_t a[4][4], b[2][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (kAByK)
        ldmatrix_x4_trans(a[i], as + (kk + (lane & 7) + ((lane >> 4) << 3)) * kLd + w.wm * 64 +
                                    i * 16 + (((lane >> 3) & 1) << 3));
      else
        attention_detail::ldmatrix_x4(
            a[i], as + (w.wm * 64 + i * 16 + (lane & 15)) * kRowsLd + kk + ((lane >> 4) << 3));
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
      ldmatrix_x4_trans(b[j], bs + (kk + b_k) * kLd + w.wn * 32 + j * 16 + b_n);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        mma_bf16_16x8x16(acc[i][j], a[i], b[j >> 1][2 * (j & 1)], b[j >> 1][2 * (j & 1) + 1]);
  }
}

// `steps` stages through two smem buffers: load(step, stage) issues the cp.async copies of a
// step, compute(stage) consumes one; the next step's copies overlap this step's products.
template <class Load, class Compute>
__device__ __forceinline__ void double_buffered(int64_t steps, Load&& load, Compute&& compute) {
  load(int64_t(0), 0);
  cp_async_commit();
  for (int64_t t = 0; t < steps; ++t) {
    const int stage = int(t & 1);
    if (t + 1 < steps) load(t + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    compute(stage);
    __syncthreads();  // the next iteration's copies overwrite this stage
  }
}

// out(row, col, x, y) for each pair of adjacent accumulator elements, (row, col) relative to the
// output tile: element (row g / g+8, columns 2tq, 2tq+1) of each 16 × 8 mma tile.
template <class Out>
__device__ __forceinline__ void for_each_pair(const float (&acc)[4][4][4], const WarpTile& w,
                                              Out&& out) {
  const int g = w.lane >> 2, tq = w.lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        out(w.wm * 64 + i * 16 + g + half * 8, w.wn * 32 + j * 8 + 2 * tq, acc[i][j][2 * half],
            acc[i][j][2 * half + 1]);
}

__global__ void __launch_bounds__(kThreads)
    grouped_weight_grad_kernel(const __nv_bfloat16* __restrict__ A, int64_t lda,
                               const __nv_bfloat16* __restrict__ B, int64_t ldb,
                               const int64_t* __restrict__ offsets, int64_t M, int64_t N,
                               float* __restrict__ C) {
  __shared__ __align__(16) __nv_bfloat16 a_s[2][kTileK * kLd];
  __shared__ __align__(16) __nv_bfloat16 b_s[2][kTileK * kLd];
  const int e = blockIdx.z;
  const int64_t row_begin = offsets[e], row_end = offsets[e + 1];
  if (row_end <= row_begin) return;
  const int64_t m0 = int64_t(blockIdx.y) * kTileM, n0 = int64_t(blockIdx.x) * kTileN;
  const WarpTile w;
  float acc[4][4][4] = {};
  double_buffered(
      (row_end - row_begin + kTileK - 1) / kTileK,
      [&](int64_t step, int stage) {
        load_stage(a_s[stage], b_s[stage], A, lda, B, ldb, row_begin + step * kTileK, row_end,
                   m0, M, n0, N);
      },
      [&](int stage) { mma_stage<true>(acc, a_s[stage], b_s[stage], w); });
  // C_e += acc (N is even: a pair never straddles the last column).
  float* c_e = C + int64_t(e) * M * N;
  for_each_pair(acc, w, [&](int r, int c, float x, float y) {
    const int64_t row = m0 + r, col = n0 + c;
    if (row >= M || col >= N) return;
    float2* p = reinterpret_cast<float2*>(c_e + row * N + col);
    float2 v = *p;
    v.x += x;
    v.y += y;
    *p = v;
  });
}

// ---- Y_e = A1_e·B1_e (+ A2_e·B2_e) over each expert's rows ---------------------------------

// Row tile `tile` of the grouped problem → its expert and first row (false: past the last tile).
// Experts own ceil(n_e / 128) consecutive tiles in expert order; E is small (≤ 8192), so every
// CTA walks the offsets (L2 hits) instead of reading a host-built table.
__device__ __forceinline__ bool find_row_tile(const int64_t* offsets, int E, int64_t tile,
                                              int* expert, int64_t* row0, int64_t* row_end) {
  int64_t before = 0;
  for (int e = 0; e < E; ++e) {
    const int64_t begin = offsets[e], end = offsets[e + 1];
    const int64_t tiles = (end - begin + kTileM - 1) / kTileM;
    if (tile < before + tiles) {
      *expert = e;
      *row0 = begin + (tile - before) * kTileM;
      *row_end = end;
      return true;
    }
    before += tiles;
  }
  return false;
}

// One stage: k columns [k0, k0 + 32) of the A rows [row0, row0 + 128) into a_s [128][kRowsLd],
// and rows [k0, k0 + 32) of the expert's B [K, N] (columns n0…n0+127) into b_s [32][kLd].
__device__ __forceinline__ void load_rows_stage(__nv_bfloat16* a_s, __nv_bfloat16* b_s,
                                                const __nv_bfloat16* A, const __nv_bfloat16* B_e,
                                                int64_t row0, int64_t row_end, int64_t k0,
                                                int64_t K, int64_t n0, int64_t N) {
  constexpr int kAChunks = kTileM * (kTileK / 8), kBChunks = kTileK * (kTileN / 8);
  for (int c = threadIdx.x; c < kAChunks + kBChunks; c += kThreads) {
    if (c < kAChunks) {
      const int r = c / (kTileK / 8), kc = (c % (kTileK / 8)) * 8;
      const int64_t row = row0 + r, k = k0 + kc;
      const bool valid = row < row_end && k < K;
      cp_async_16(a_s + r * kRowsLd + kc, valid ? A + row * K + k : A, valid);
    } else {
      const int idx = c - kAChunks;
      const int r = idx / (kTileN / 8), col = (idx % (kTileN / 8)) * 8;
      const int64_t k = k0 + r, n = n0 + col;
      const bool valid = k < K && n < N;
      cp_async_16(b_s + r * kLd + col, valid ? B_e + k * N + n : B_e, valid);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    grouped_rows_f32_kernel(const __nv_bfloat16* __restrict__ A1,
                            const __nv_bfloat16* __restrict__ B1,
                            const __nv_bfloat16* __restrict__ A2,
                            const __nv_bfloat16* __restrict__ B2,
                            const int64_t* __restrict__ offsets, int E, int64_t K, int64_t N,
                            float* __restrict__ Y) {
  __shared__ __align__(16) __nv_bfloat16 a_s[2][kTileM * kRowsLd];
  __shared__ __align__(16) __nv_bfloat16 b_s[2][kTileK * kLd];
  int e = 0;
  int64_t row0 = 0, row_end = 0;
  if (!find_row_tile(offsets, E, blockIdx.y, &e, &row0, &row_end)) return;
  const int64_t n0 = int64_t(blockIdx.x) * kTileN;
  const WarpTile w;
  const __nv_bfloat16* B1_e = B1 + int64_t(e) * K * N;
  const __nv_bfloat16* B2_e = B2 ? B2 + int64_t(e) * K * N : nullptr;
  float acc[4][4][4] = {};
  // Steps over K for the first product, then (A2 given) over K again for the second.
  const int64_t k_steps = (K + kTileK - 1) / kTileK;
  double_buffered(
      A2 ? 2 * k_steps : k_steps,
      [&](int64_t step, int stage) {
        const bool second = step >= k_steps;
        load_rows_stage(a_s[stage], b_s[stage], second ? A2 : A1, second ? B2_e : B1_e, row0,
                        row_end, (second ? step - k_steps : step) * kTileK, K, n0, N);
      },
      [&](int stage) { mma_stage<false>(acc, a_s[stage], b_s[stage], w); });
  for_each_pair(acc, w, [&](int r, int c, float x, float y) {
    const int64_t row = row0 + r, col = n0 + c;
    if (row >= row_end || col >= N) return;
    *reinterpret_cast<float2*>(Y + row * N + col) = make_float2(x, y);
  });
}

}  // namespace

void launch_grouped_rows_f32(const uint16_t* A1, const uint16_t* B1, const uint16_t* A2,
                             const uint16_t* B2, const int64_t* offsets, int E, int64_t R,
                             int64_t K, int64_t N, float* Y, CUstream_st* stream) {
  if (E <= 0 || R <= 0 || N <= 0) return;
  // Σ_e ceil(n_e / 128) ≤ R / 128 + E row tiles; CTAs past the last one return at once.
  const int64_t row_tiles = (R + kTileM - 1) / kTileM + E;
  const dim3 grid(unsigned((N + kTileN - 1) / kTileN), unsigned(row_tiles));
  grouped_rows_f32_kernel<<<grid, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const __nv_bfloat16*>(A1), reinterpret_cast<const __nv_bfloat16*>(B1),
      reinterpret_cast<const __nv_bfloat16*>(A2), reinterpret_cast<const __nv_bfloat16*>(B2),
      offsets, E, K, N, Y);
  DM_CUDA_CHECK(cudaGetLastError());
}

void launch_grouped_weight_grad(const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                                const int64_t* offsets, int E, int64_t M, int64_t N, float* C,
                                CUstream_st* stream) {
  if (E <= 0 || M <= 0 || N <= 0) return;
  const dim3 grid(unsigned((N + kTileN - 1) / kTileN), unsigned((M + kTileM - 1) / kTileM),
                  unsigned(E));
  grouped_weight_grad_kernel<<<grid, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const __nv_bfloat16*>(A), lda, reinterpret_cast<const __nv_bfloat16*>(B),
      ldb, offsets, M, N, C);
  DM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dm::cuda::moe_detail
