// The backward's grouped expert products on Hopper's warpgroup MMA (moe_kernels.h
// launch_grouped_*_wgmma), with the same contracts as the mma.sync kernels of
// moe_grouped_gemm.cu:
//   rows     Y[r, :] = A1[r, :]·B1_e (+ A2[r, :]·B2_e), r in the expert's rows, B_e [K, N]
//            (n contiguous): the input-gradient rows dx (two products, fp32 out) and dh (one,
//            bf16 out);
//   weight   C_e [M, N] += A_eᵀ·B_e over the expert's rows of A [R, M] and B [R, N]: the weight
//   grad     gradients, fp32.
// Their operands whose elements are contiguous along M or N (B_e above; both operands of the
// weight gradient) are stored MN-major in shared memory and read by wgmma with its transpose bit
// (wgmma.cuh); the rows' A is K-major as in the forward's kernel.
//
// CTA: a 128 × 128 output tile, 256 threads = two warpgroups, warpgroup g owning rows 64g … 64g
// + 63. The reduction runs in steps of 64 through a ring of 3 cp.async stages of 32 KB (A then B,
// 16 KB each), the forward's pipeline: wait for the previous step's wgmma batch, refill its
// stage, issue this step's batch; two steps of copies in flight, 2 CTAs per SM.
//
// Measured on an H200 (bench_cuda_moe_gemm: 24576 rows over 32 experts, Din 512, F 1024; µs,
// mma.sync kernel → this one): dh 126.0 → 99.1, dx (two products) 211.0 → 133.3 (387 TFLOP/s),
// dW 115.0 → 92.2, results bitwise equal. Keeping one wgmma batch in flight across steps (6 or
// 4 stages, 1 CTA per SM) was slower for all three (dh 117.9, dx 139.9, dW 355.4 at 6 stages).
// Deterministic: each output element has one writer and a fixed summation order, no atomics.
// Rows past the expert's end, k past K and columns past M / N are zero-filled in shared memory.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/glu.cuh"
#include "ops/cuda/moe.h"
#include "ops/cuda/moe_grouped_tiles.cuh"
#include "ops/cuda/moe_kernels.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/tma.cuh"
#include "ops/cuda/tma_map.h"
#include "ops/cuda/tma_pipeline.cuh"
#include "ops/cuda/wgmma.cuh"
#include "ops/cuda/wgmma_pipeline.cuh"

namespace dm::cuda::moe_detail {
namespace {

using attention_detail::cp_async_16;

constexpr int kTile = kGroupedTileRows;  // 128 × 128 output tiles
constexpr int kStepK = 64;
constexpr int kThreads = 256;
constexpr int kLineBytes = 128;                    // one swizzled line: 64 bf16
constexpr int kOperandBytes = kTile * kLineBytes;  // 16 KB: 128 K-major rows or 2 MN atoms
constexpr int kAtomBytes = kStepK * kLineBytes;    // 8 KB: one 64-wide MN atom, 64 k deep
constexpr int kStageBytes = 2 * kOperandBytes;
// The weight gradient's fp32 tile staged for its C_e += (rows padded by 8 floats: the fragment
// stores, 8 rows × 32 bytes a warp, fall in 2 conflict-free wavefronts).
constexpr int kStagedLd = kTile + 8;

// K-major operand of one step: rows [row0, row0 + 128) ∩ [·, row_end) of a row-major matrix X
// (row stride ld), k in [k0, k0 + 64) ∩ [0, K), row i at line i. The thread copies chunk
// c = tid % 8 of rows tid / 8 + 32i, i < 4 (the same swizzle for its four rows).
__device__ __forceinline__ void copy_k_major(uint8_t* tile, const __nv_bfloat16* X, int64_t ld,
                                             int64_t row0, int64_t row_end, int64_t k0, int64_t K) {
  const int r = threadIdx.x / 8, c = threadIdx.x % 8;
  const int64_t k = k0 + 8 * c;
  const uint32_t off = uint32_t(r * kLineBytes + ((c ^ (r & 7)) << 4));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t row = row0 + r + 32 * i;
    const bool ok = k < K && row < row_end;
    cp_async_16(tile + off + i * 32 * kLineBytes, ok ? X + row * ld + k : X, ok);
  }
}

// MN-major operand of one step: the k rows [k0, k0 + 64) ∩ [·, k_end) of a row-major matrix X
// whose rows run along k (row stride ld), MN elements [mn0, mn0 + 128) ∩ [0, MN), as two atoms
// (wgmma.cuh). The thread copies chunk c = tid % 16 (atom c / 8, chunk c mod 8) of k rows
// tid / 16 + 16i, i < 4 (again one swizzle for its four rows).
__device__ __forceinline__ void copy_mn_major(uint8_t* tile, const __nv_bfloat16* X, int64_t ld,
                                              int64_t k0, int64_t k_end, int64_t mn0, int64_t MN) {
  const int c = threadIdx.x % 16, kr = threadIdx.x / 16;
  const int64_t mn = mn0 + 8 * c;
  const uint32_t off = uint32_t(((c / 8) * kStepK + kr) * kLineBytes + (((c % 8) ^ (kr & 7)) << 4));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t k = k0 + kr + 16 * i;
    const bool ok = mn < MN && k < k_end;
    cp_async_16(tile + off + i * 16 * kLineBytes, ok ? X + k * ld + mn : X, ok);
  }
}

enum class Product : int { Rows, WeightGrad };

struct BackwardArgs {
  const __nv_bfloat16* A1;
  const __nv_bfloat16* B1;
  const __nv_bfloat16* A2;  // rows only; nullptr: one product
  const __nv_bfloat16* B2;
  const int64_t* offsets;  // DEVICE [E + 1]
  int E;
  int64_t K, N;         // rows: A [R, K], B_e [K, N]; weight grad: N columns of C_e and B
  int64_t M, lda, ldb;  // weight grad: C_e [M, N], A [R, lda], B [R, ldb]
  void* out;            // rows: Y [R, N] (fp32 or bf16); weight grad: C [E, M, N] fp32
  bool staged_rows;     // rows: Y through shared memory (moe_wgmma_staged_output)
  bool store_c;         // weight grad: C_e = product (not read; 0 for an expert without rows)
  // Rows, bf16 out, staged, with the GLU backward in the epilogue
  // (launch_grouped_rows_glu_backward_wgmma): the product is dh, taken at the g (glu_gate) and u
  // (glu_up) the forward kept; Y receives dg and glu_up du. glu_gate nullptr: Y = the product.
  const __nv_bfloat16* glu_gate;
  __nv_bfloat16* glu_up;
  GluKernelParams glu;
};

constexpr int kStages = 3;
static_assert(kTile * kStagedLd * 4 <= kStages * kStageBytes, "the staged tile fits the ring");

// The TMA-fed variant (kTma; moe_wgmma_tma(), moe.h): the operands' tensor maps (tma_map.h).
// Rows: A1 / A2 [R, K] in 128-row × 64-k boxes (K-major lines), B1 / B2 as E matrices [K, N]
// (3-D maps, so k past K reads zeros, not the next expert's rows) in 64 × 64 boxes (one MN-major
// atom each, two a step). Weight gradient: A1 [R, M] (row stride lda) and
// B1 [R, N] (ldb) in 64 × 64 boxes. One producer warp joins the two consumer warpgroups.
struct TmaMaps {
  CUtensorMap a1, b1, a2, b2;
};
constexpr int kTmaThreads = kThreads + 32;

// kOverlap (moe_wgmma_overlap(), moe.h): issue step t's wgmma batch before waiting for step
// t − 1's, then refill t − 1's stage (two barriers a step instead of one).
// kTma: the operands arrive through the TMA from a producer warp (threads 256 … 287) instead of
// every thread's cp.async (TmaMaps; kOverlap does not apply). Where the weight gradient's last
// step reaches past the expert's rows, the TMA brings the next expert's rows (or zeros past R):
// the consumers zero those k lines of A before multiplying, as the cp.async copies zero-fill.
// Rows products: k past K arrives as zeros in both operands, as the copies zero-fill.
template <Product kProduct, typename Out, bool kOverlap, bool kTma = false>
__global__ void __launch_bounds__(kTma ? kTmaThreads : kThreads, 2)
    grouped_wgmma_backward_kernel(const BackwardArgs a, const __grid_constant__ TmaMaps maps) {
  __shared__ tma::RingBarriers<kStages> barriers;
  if constexpr (kTma) {
    if (threadIdx.x == kThreads) barriers.init(kThreads / 32);
    __syncthreads();  // before any thread may leave
  }
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  constexpr bool kRows = kProduct == Product::Rows;
  int e = 0, tile_rows = 0, steps = 0, steps_per_product = 0;
  int64_t row0 = 0, m0 = 0, red_begin = 0, red_end = 0;
  const int64_t n0 = int64_t(blockIdx.x) * kTile;
  if constexpr (kRows) {
    GroupedRowTile tile;
    if (!find_row_tile(a.offsets, a.E, blockIdx.y, &tile)) return;
    e = tile.expert;
    row0 = tile.row0;
    tile_rows = tile.rows;
    steps_per_product = int((a.K + kStepK - 1) / kStepK);
    steps = steps_per_product * (a.A2 ? 2 : 1);
  } else {
    e = blockIdx.z;
    m0 = int64_t(blockIdx.y) * kTile;
    red_begin = a.offsets[e];
    red_end = a.offsets[e + 1];
    if (red_end <= red_begin) {  // no rows: C_e stays as it is, or (store) becomes 0
      if (a.store_c && threadIdx.x < kThreads) {
        float* C = static_cast<float*>(a.out) + int64_t(e) * a.M * a.N;
        for (int i = threadIdx.x; i < kTile * kTile; i += kThreads) {
          const int64_t m = m0 + i / kTile, n = n0 + i % kTile;
          if (m < a.M && n < a.N) C[m * a.N + n] = 0.0f;
        }
      }
      return;
    }
    steps = int((red_end - red_begin + kStepK - 1) / kStepK);
  }
  extern __shared__ __align__(1024) uint8_t wgmma_backward_smem_raw[];
  // The ring starts at the first 1024-byte boundary of the shared window (swizzle atoms).
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(wgmma_backward_smem_raw));
  uint8_t* ring = wgmma_backward_smem_raw + (((raw + 1023u) & ~1023u) - raw);

  auto load = [&](int step, int slot) {
    uint8_t* a_tile = ring + slot * kStageBytes;
    uint8_t* b_tile = a_tile + kOperandBytes;
    if constexpr (kRows) {
      const bool second = step >= steps_per_product;
      const int64_t k0 = int64_t(second ? step - steps_per_product : step) * kStepK;
      copy_k_major(a_tile, second ? a.A2 : a.A1, a.K, row0, row0 + tile_rows, k0, a.K);
      copy_mn_major(b_tile, (second ? a.B2 : a.B1) + int64_t(e) * a.K * a.N, a.N, k0, a.K, n0, a.N);
    } else {
      const int64_t r0 = red_begin + int64_t(step) * kStepK;
      copy_mn_major(a_tile, a.A1, a.lda, r0, red_end, m0, a.M);
      copy_mn_major(b_tile, a.B1, a.ldb, r0, red_end, n0, a.N);
    }
  };

  if constexpr (kTma) {
    if (threadIdx.x >= kThreads) {  // the producer warp: its lane 0 issues
      if (threadIdx.x == kThreads)
        tma::produce_ring(barriers, steps, kStageBytes, [&](int step, int slot, uint64_t* full) {
          uint8_t* a_tile = ring + slot * kStageBytes;
          uint8_t* b_tile = a_tile + kOperandBytes;
          if constexpr (kRows) {
            const bool second = step >= steps_per_product;
            const int32_t k0 = (second ? step - steps_per_product : step) * kStepK;
            const CUtensorMap* b_map = second ? &maps.b2 : &maps.b1;
            tma::load_2d(a_tile, second ? &maps.a2 : &maps.a1, full, k0, int32_t(row0));
            tma::load_3d(b_tile, b_map, full, int32_t(n0), k0, e);
            tma::load_3d(b_tile + kAtomBytes, b_map, full, int32_t(n0 + 64), k0, e);
          } else {
            const int32_t r0 = int32_t(red_begin + int64_t(step) * kStepK);
            tma::load_2d(a_tile, &maps.a1, full, int32_t(m0), r0);
            tma::load_2d(a_tile + kAtomBytes, &maps.a1, full, int32_t(m0 + 64), r0);
            tma::load_2d(b_tile, &maps.b1, full, int32_t(n0), r0);
            tma::load_2d(b_tile + kAtomBytes, &maps.b1, full, int32_t(n0 + 64), r0);
          }
        });
      return;
    }
  }
  // The epilogues' barrier over the two warpgroups (the producer warp has left).
  auto sync = [] {
    if constexpr (kTma)
      tma::named_barrier_sync(1, kThreads);
    else
      __syncthreads();
  };
  const int group = threadIdx.x / 128;
  float acc[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) acc[j] = 0.0f;
  // Warpgroup g's 64 rows: K-major lines 64g … (rows), MN atom g (weight gradient); both at
  // g·8 KB.
  auto multiply = [&](int slot) {
    const uint8_t* a_tile = ring + slot * kStageBytes;
    const uint8_t* b_tile = a_tile + kOperandBytes;
    const uint8_t* a_rows = a_tile + group * kAtomBytes;
#pragma unroll
    for (int kk = 0; kk < kStepK / 16; ++kk) {
      const uint64_t desc_b = wgmma::smem_desc_sw128_mn(b_tile + kk * 16 * kLineBytes, kAtomBytes);
      if constexpr (kRows)
        wgmma::mma_m64n128k16_bf16<0, 1>(acc, wgmma::smem_desc_sw128(a_rows + kk * 32), desc_b,
                                         true);
      else
        wgmma::mma_m64n128k16_bf16<1, 1>(
            acc, wgmma::smem_desc_sw128_mn(a_rows + kk * 16 * kLineBytes, kAtomBytes), desc_b,
            true);
    }
  };
  if constexpr (kRows) {
    // The GLU epilogue's g and u lines (128 rows × 256 bytes each) asked into L2 now, so that
    // their loads after the products hit L2 instead of paying an HBM round trip the SM waits
    // out with nothing else to do.
    if (a.glu_gate != nullptr) {
      for (int i = threadIdx.x; i < tile_rows * 4; i += kThreads) {
        const int64_t col = n0 + (i % 2) * 64;
        if (col >= a.N) continue;
        const int64_t at = (row0 + i / 4) * a.N + col;
        const void* line = (i / 2) % 2 ? static_cast<const void*>(a.glu_up + at)
                                       : static_cast<const void*>(a.glu_gate + at);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
      }
    }
  }
  if constexpr (kTma) {
    // Weight gradient, last step: k lines at or past the expert's end zeroed in both A atoms.
    auto landed = [&](int step, int slot) {
      if constexpr (!kRows) {
        const int valid = int(red_end - red_begin - int64_t(step) * kStepK);
        if (valid >= kStepK) return;
        uint8_t* a_tile = ring + slot * kStageBytes;
        const int chunks = (kStepK - valid) * (kLineBytes / 16);  // per atom
        for (int i = threadIdx.x; i < 2 * chunks; i += kThreads) {
          const int atom = i / chunks, rest = i % chunks;
          *reinterpret_cast<uint4*>(a_tile + atom * kAtomBytes + (valid + rest / 8) * kLineBytes +
                                    (rest % 8) * 16) = make_uint4(0, 0, 0, 0);
        }
        wgmma::fence_proxy_async();
        sync();
      }
    };
    tma::consume_ring(barriers, steps, landed, multiply);
  } else {
    wgmma::ring_pipeline<kStages, kOverlap>(steps, load, multiply);
  }

  // acc[j]: tile row 64·group + 16·warp + lane/4 + 8·((j/2) mod 2), column 8·(j/4) +
  // 2·(lane mod 4) + (j mod 2); adjacent columns go out as one pair.
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  if constexpr (kRows) {
    Out* Y = static_cast<Out*>(a.out);
    if (a.staged_rows) {
      // Through the (free) ring as the forward's output (moe_grouped_gemm_wgmma.cu): fragments in
      // as pairs (rows 16 bytes longer than the tile's, so a store instruction's 8 rows fall in
      // distinct banks), then whole rows out, 16 bytes a lane: a warp writes 512 contiguous
      // bytes (bf16: two rows) per instruction instead of 8- or 4-byte pieces of 8 rows.
      constexpr int kRowBytes = kTile * int(sizeof(Out)) + 16, kPieces = kTile * sizeof(Out) / 16;
      static_assert(kTile * kRowBytes <= kStages * kStageBytes, "the staged tile fits the ring");
      sync();  // both warpgroups' last batches have read the ring
#pragma unroll
      for (int j = 0; j < 64; j += 2) {
        const int r = 64 * group + 16 * warp + lane / 4 + 8 * ((j / 2) % 2);
        const int col = 8 * (j / 4) + 2 * (lane % 4);
        uint8_t* at = ring + r * kRowBytes + col * int(sizeof(Out));
        if constexpr (sizeof(Out) == 4)
          *reinterpret_cast<float2*>(at) = make_float2(acc[j], acc[j + 1]);
        else
          *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(acc[j], acc[j + 1]);
      }
      sync();
      // Thread t: piece t % kPieces of rows t / kPieces + (kThreads / kPieces)·i.
      const int piece = threadIdx.x % kPieces;
      const int64_t col = n0 + piece * (16 / int(sizeof(Out)));
      if (col >= a.N) return;
      if constexpr (sizeof(Out) == 2) {
        if (a.glu_gate != nullptr) {
          // The bf16 dh piece (the rounding the separate dh product stored) with the g and u of
          // the same 8 elements: dg over Y, du over u (each element read before it is written,
          // by the same thread).
          // Every g and u load of the thread's rows is issued before the first store: the
          // stores may alias the loads as far as the compiler knows, so a load-compute-store loop
          // paid one memory round trip per row (the epilogue took the fused kernel from 83 to
          // 232 µs at 24576 × 1024).
          constexpr int kRowsPerThread = kTile * kPieces / kThreads;
          const GluInverseBetas inv = glu_inverse_betas(a.glu);
          uint4 g[kRowsPerThread], u[kRowsPerThread];
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) {
            const int r = threadIdx.x / kPieces + (kThreads / kPieces) * i;
            if (r < tile_rows) {
              const int64_t at = (row0 + r) * a.N + col;
              g[i] = *reinterpret_cast<const uint4*>(a.glu_gate + at);
              u[i] = *reinterpret_cast<const uint4*>(a.glu_up + at);
            }
          }
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) {
            const int r = threadIdx.x / kPieces + (kThreads / kPieces) * i;
            if (r >= tile_rows) break;
            const int64_t at = (row0 + r) * a.N + col;
            const uint4 dh = *reinterpret_cast<const uint4*>(ring + r * kRowBytes + piece * 16);
            uint4 dg, du;
            glu_backward_bf16x8(g[i], u[i], dh, a.glu, inv, dg, du);
            *reinterpret_cast<uint4*>(Y + at) = dg;
            *reinterpret_cast<uint4*>(a.glu_up + at) = du;
          }
          return;
        }
      }
#pragma unroll
      for (int i = 0; i < kTile * kPieces / kThreads; ++i) {
        const int r = threadIdx.x / kPieces + (kThreads / kPieces) * i;
        if (r >= tile_rows) break;
        *reinterpret_cast<uint4*>(Y + (row0 + r) * a.N + col) =
            *reinterpret_cast<const uint4*>(ring + r * kRowBytes + piece * 16);
      }
      return;
    }
#pragma unroll
    for (int j = 0; j < 64; j += 2) {
      const int r = 64 * group + 16 * warp + lane / 4 + 8 * ((j / 2) % 2);
      const int64_t col = n0 + 8 * (j / 4) + 2 * (lane % 4);
      if (r >= tile_rows || col >= a.N) continue;
      if constexpr (sizeof(Out) == 4)
        *reinterpret_cast<float2*>(Y + (row0 + r) * a.N + col) = make_float2(acc[j], acc[j + 1]);
      else
        *reinterpret_cast<__nv_bfloat162*>(Y + (row0 + r) * a.N + col) =
            __floats2bfloat162_rn(acc[j], acc[j + 1]);
    }
  } else {
    // C_e += the tile through shared memory (the ring is free now): straight from the fragments
    // each warp instruction would read 8 rows × 32 bytes of C, and the kernel measured 238 µs
    // against 70 µs with a plain store. Staged, a warp reads and writes 512 contiguous bytes of
    // one row, 8 rows a thread in flight.
    sync();  // both warpgroups' last batches have read the ring
    float* staged = reinterpret_cast<float*>(ring);  // [128][kStagedLd] fp32
#pragma unroll
    for (int j = 0; j < 64; j += 2) {
      const int r = 64 * group + 16 * warp + lane / 4 + 8 * ((j / 2) % 2);
      const int col = 8 * (j / 4) + 2 * (lane % 4);
      *reinterpret_cast<float2*>(staged + r * kStagedLd + col) = make_float2(acc[j], acc[j + 1]);
    }
    sync();
    float* C = static_cast<float*>(a.out) + int64_t(e) * a.M * a.N;
    const int row_warp = threadIdx.x / 32;  // rows row_warp + 8i
    const int64_t col = n0 + 4 * lane;
    // Passes of kRowsPerPass rows a thread: two of 8 (16 would spill at the 128-register cap), four
    // of 4 in the TMA variant (96 registers).
    constexpr int kPasses = kTma ? 4 : 2, kRowsPerPass = kTile / 8 / kPasses;
#pragma unroll
    for (int half = 0; half < kPasses; ++half) {
      float4 old[kRowsPerPass];
#pragma unroll
      for (int i = 0; i < kRowsPerPass; ++i) {
        const int64_t m = m0 + row_warp + 8 * (i + half * kRowsPerPass);
        old[i] = !a.store_c && m < a.M && col < a.N
                     ? *reinterpret_cast<const float4*>(C + m * a.N + col)
                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int i = 0; i < kRowsPerPass; ++i) {
        const int r = row_warp + 8 * (i + half * kRowsPerPass);
        const int64_t m = m0 + r;
        if (m >= a.M || col >= a.N) continue;
        const float4 add = *reinterpret_cast<const float4*>(staged + r * kStagedLd + 4 * lane);
        *reinterpret_cast<float4*>(C + m * a.N + col) =
            make_float4(old[i].x + add.x, old[i].y + add.y, old[i].z + add.z, old[i].w + add.w);
      }
    }
  }
}

// maps: the TMA-fed kernel with these tensor maps; nullptr: the cp.async one.
template <Product kProduct, typename Out>
void launch(const BackwardArgs& a, const TmaMaps* maps, dim3 grid, CUstream_st* stream) {
  constexpr int kSmem = kStages * kStageBytes + 1024;  // + slack to align the ring to 1 KB
  auto kernel = maps != nullptr       ? grouped_wgmma_backward_kernel<kProduct, Out, false, true>
                : moe_wgmma_overlap() ? grouped_wgmma_backward_kernel<kProduct, Out, true>
                                      : grouped_wgmma_backward_kernel<kProduct, Out, false>;
  DM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  DM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     int(cudaSharedmemCarveoutMaxShared)));
  launch_pdl(kernel, grid, maps != nullptr ? kTmaThreads : kThreads, kSmem,
             reinterpret_cast<cudaStream_t>(stream), a, maps != nullptr ? *maps : TmaMaps{});
  DM_CUDA_CHECK(cudaGetLastError());
}

// The rows products' tensor maps where moe_wgmma_tma() and the shapes allow (K, N multiples of
// 8, 16-byte aligned operands, 32-bit coordinates); false: the cp.async kernel runs.
bool rows_tma_maps(const BackwardArgs& a, int64_t R, TmaMaps* maps) {
  if (!moe_wgmma_tma() || R >= (int64_t(1) << 31)) return false;
  const bool two = a.A2 != nullptr;
  const void* A2 = two ? a.A2 : a.A1;
  const void* B2 = two ? a.B2 : a.B1;
  if (!tma_map_bf16_applies(a.A1, uint64_t(a.K)) || !tma_map_bf16_applies(A2, uint64_t(a.K)) ||
      !tma_map_bf16_applies(a.B1, uint64_t(a.N)) || !tma_map_bf16_applies(B2, uint64_t(a.N)))
    return false;
  const uint64_t E = uint64_t(a.E), K = uint64_t(a.K), N = uint64_t(a.N);
  maps->a1 = tma_map_bf16_rows(a.A1, uint64_t(R), K, K, kTile, kStepK);
  maps->b1 = tma_map_bf16_batched(a.B1, E, K, N, kStepK, kStepK);
  maps->a2 = two ? tma_map_bf16_rows(a.A2, uint64_t(R), K, K, kTile, kStepK) : maps->a1;
  maps->b2 = two ? tma_map_bf16_batched(a.B2, E, K, N, kStepK, kStepK) : maps->b1;
  return true;
}

template <typename Out>
void launch_rows(const uint16_t* A1, const uint16_t* B1, const uint16_t* A2, const uint16_t* B2,
                 const int64_t* offsets, int E, int64_t R, int64_t K, int64_t N, Out* Y,
                 CUstream_st* stream) {
  if (E <= 0 || R <= 0 || N <= 0) return;
  if (moe_wgmma_pingpong() && moe_wgmma_pingpong_rows_backward() &&
      grouped_rows_backward_pingpong_applies(A1, B1, A2, B2, R, K, N, Y)) {
    launch_grouped_rows_backward_pingpong(A1, B1, A2, B2, offsets, E, R, K, N, Y, sizeof(Out) == 4,
                                          nullptr, nullptr, nullptr, stream);
    return;
  }
  BackwardArgs a{};
  a.A1 = reinterpret_cast<const __nv_bfloat16*>(A1);
  a.B1 = reinterpret_cast<const __nv_bfloat16*>(B1);
  a.A2 = reinterpret_cast<const __nv_bfloat16*>(A2);
  a.B2 = reinterpret_cast<const __nv_bfloat16*>(B2);
  a.offsets = offsets;
  a.E = E;
  a.K = K;
  a.N = N;
  a.out = Y;
  a.staged_rows = moe_wgmma_staged_output() && (N * int64_t(sizeof(Out))) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(Y) % 16 == 0;
  TmaMaps maps;
  launch<Product::Rows, Out>(a, rows_tma_maps(a, R, &maps) ? &maps : nullptr,
                             grouped_rows_grid(R, E, N), stream);
}

}  // namespace

void launch_grouped_rows_f32_wgmma(const uint16_t* A1, const uint16_t* B1, const uint16_t* A2,
                                   const uint16_t* B2, const int64_t* offsets, int E, int64_t R,
                                   int64_t K, int64_t N, float* Y, CUstream_st* stream) {
  launch_rows<float>(A1, B1, A2, B2, offsets, E, R, K, N, Y, stream);
}

void launch_grouped_rows_bf16_wgmma(const uint16_t* A, const uint16_t* B, const int64_t* offsets,
                                    int E, int64_t R, int64_t K, int64_t N, uint16_t* Y,
                                    CUstream_st* stream) {
  launch_rows<__nv_bfloat16>(A, B, nullptr, nullptr, offsets, E, R, K, N,
                             reinterpret_cast<__nv_bfloat16*>(Y), stream);
}

bool grouped_rows_glu_backward_applies(int64_t N, const void* Y, const void* gate, const void* up) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return N % 8 == 0 && aligned(Y) && aligned(gate) && aligned(up);
}

void launch_grouped_rows_glu_backward_wgmma(const uint16_t* A, const uint16_t* B,
                                            const int64_t* offsets, int E, int64_t R, int64_t K,
                                            int64_t N, const uint16_t* gate, uint16_t* up,
                                            uint16_t* dg, const GluKernelParams& act,
                                            CUstream_st* stream) {
  DM_CHECK(grouped_rows_glu_backward_applies(N, dg, gate, up) && gate && up && dg,
           "launch_grouped_rows_glu_backward_wgmma: N = ", N,
           " (a multiple of 8) and 16-byte aligned g, u and dg");
  if (E <= 0 || R <= 0 || N <= 0) return;
  // Not the pingpong kernel's GLU epilogue: it measured slower than this kernel's on an H200
  // (moe.h moe_wgmma_pingpong_rows_backward).
  BackwardArgs a{};
  a.A1 = reinterpret_cast<const __nv_bfloat16*>(A);
  a.B1 = reinterpret_cast<const __nv_bfloat16*>(B);
  a.offsets = offsets;
  a.E = E;
  a.K = K;
  a.N = N;
  a.out = dg;
  a.staged_rows = true;
  a.glu_gate = reinterpret_cast<const __nv_bfloat16*>(gate);
  a.glu_up = reinterpret_cast<__nv_bfloat16*>(up);
  a.glu = act;
  TmaMaps maps;
  launch<Product::Rows, __nv_bfloat16>(a, rows_tma_maps(a, R, &maps) ? &maps : nullptr,
                                       grouped_rows_grid(R, E, N), stream);
}

void launch_grouped_weight_grad_wgmma(const uint16_t* A, int64_t lda, const uint16_t* B,
                                      int64_t ldb, const int64_t* offsets, int E, int64_t R,
                                      int64_t M, int64_t N, float* C, CUstream_st* stream,
                                      bool store) {
  if (E <= 0 || M <= 0 || N <= 0) return;
  if (moe_wgmma_pingpong() && moe_wgmma_pingpong_weight_grad() &&
      grouped_weight_grad_pingpong_applies(A, lda, B, ldb, R, M, N, C)) {
    launch_grouped_weight_grad_pingpong(A, lda, B, ldb, offsets, E, R, M, N, C, stream, store);
    return;
  }
  BackwardArgs a{};
  a.A1 = reinterpret_cast<const __nv_bfloat16*>(A);
  a.B1 = reinterpret_cast<const __nv_bfloat16*>(B);
  a.offsets = offsets;
  a.E = E;
  a.N = N;
  a.M = M;
  a.lda = lda;
  a.ldb = ldb;
  a.out = C;
  a.store_c = store;
  const dim3 grid(unsigned((N + kTile - 1) / kTile), unsigned((M + kTile - 1) / kTile),
                  unsigned(E));
  // The TMA-fed kernel where moe_wgmma_tma() and the shapes allow; its maps end at row R (the
  // last step of the last expert reads zeros past it).
  TmaMaps maps;
  const bool tma = moe_wgmma_tma() && R > 0 && R < (int64_t(1) << 31) &&
                   tma_map_bf16_applies(A, uint64_t(lda)) &&
                   tma_map_bf16_applies(B, uint64_t(ldb)) && lda >= M && ldb >= N;
  if (tma) {
    maps.a1 = tma_map_bf16_rows(A, uint64_t(R), uint64_t(M), uint64_t(lda), kStepK, kStepK);
    maps.b1 = tma_map_bf16_rows(B, uint64_t(R), uint64_t(N), uint64_t(ldb), kStepK, kStepK);
    maps.a2 = maps.a1;
    maps.b2 = maps.b1;
  }
  launch<Product::WeightGrad, float>(a, tma ? &maps : nullptr, grid, stream);
}

}  // namespace dm::cuda::moe_detail
