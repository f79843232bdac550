// Grouped expert products for few rows per expert (moe_kernels.h launch_grouped_few_rows_nk_bf16):
//   Y[r, :] = A[r, :]·W_eᵀ  for r in [offsets[e], offsets[e+1]),  W_e [N, K] (k contiguous), bf16
// out, fp32 accumulation: the forward's gate, up and down products when the batch has a few rows
// per expert (the decoder's steps: batch 64 on Kimi-Linear-48B is 2 rows per expert). The
// 128-row tiles of moe_grouped_gemm.cu multiply mostly zero rows there and turn compute-bound
// (51 ms per step against 40 for cuBLAS'); here the weights are the MMA's M operand and the
// tokens its N operand (8 per m16n8k16), so an expert's weight rows are streamed once from HBM
// straight into registers and applied to every one of its rows. At batch 64 on that shape
// (2 rows per expert, all hit) the gate/up launches read 1.05 GB each at 3.6 TB/s and the down
// 3.8 TB/s (ncu): level with cuBLAS' grouped GEMM (step 40.7 vs 40.7 ms), but with no host
// synchronisation, so the step is graphed.
//
// CTA: 4 warps, each owning 32 weight rows (two m16 tiles) of one expert: grid (ceil(N / 128),
// E). A k step is 32 deep: each lane loads one 16-byte chunk (8 consecutive k) of each of its 4
// weight rows and of each token's row, k = k0 + 8·(lane % 4) … +7. The MMA's k order within the
// step is a permutation of those 32 physical k (slice 0 takes elements 0–3 of every lane's chunk,
// slice 1 elements 4–7), the same for both operands, so the products are exact dot products and
// no shuffles are needed: for m16n8k16 the lane (g = lane / 4, t = lane % 4) holds k pairs
// (2t, 2t+1) and (2t+8, 2t+9) of A row g / g+8 and of B column g, which here are elements
// (4s, 4s+1) and (4s+2, 4s+3) of its chunks in slice s. Weights reach the registers by plain
// loads, four k steps at a time (16 × 16 bytes per lane in flight, ~128 KB per SM with 16 warps
// resident). A per-warp cp.async ring in shared memory (6 stages, 160 KB in flight per SM) was
// slower at batch 64 × 32K: 43.7/44.8 against 40.7/41.7 ms per step, two rounds on an H200
// (2026-11-30), and was removed. Tokens go in passes of up to 8·kGroups rows; an expert with more
// rows makes another pass over its weights (read again, from HBM unless L2 still holds them).
//
// Deterministic: each output has one writer and a fixed summation order. Weight rows past N and
// k past K are zero-filled; rows past the expert's end are neither read nor written.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/moe_kernels.h"

namespace dm::cuda::moe_detail {
namespace {

using attention_detail::mma_bf16_16x8x16;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRowsPerWarp = 32;  // weight rows: two m16 tiles
constexpr int kRowsPerCta = kRowsPerWarp * kWarps;
constexpr int kStepK = 32;  // k per step: 4 lanes × 8
constexpr int kUnroll = 4;  // plain loads: k steps of weights in flight

// kGroups token groups of 8 per pass over the weights (8·kGroups rows): the launcher picks 1, 2
// or 4 by the mean rows per expert. Fewer groups keep fewer accumulators live (158 registers at
// 4 groups: 3 CTAs per SM; ≤ 128 at 1 or 2: 4), so more warps stream weights at once.
template <int kGroups>
__global__ void __launch_bounds__(kThreads, kGroups == 4 ? 3 : 4)
    grouped_few_rows_nk_bf16_kernel(const __nv_bfloat16* __restrict__ A,
                                    const __nv_bfloat16* __restrict__ W,
                                    const int64_t* __restrict__ offsets, int64_t K, int64_t N,
                                    __nv_bfloat16* __restrict__ Y) {
  const int e = blockIdx.y;
  const int64_t row_begin = offsets[e], row_end = offsets[e + 1];
  if (row_end <= row_begin) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t n0 = int64_t(blockIdx.x) * kRowsPerCta + warp * kRowsPerWarp;
  if (n0 >= N) return;
  // This lane's 4 weight rows: n0 + g + 8·i (i = 0, 1: m tile 0; 2, 3: m tile 1), as 16-byte
  // chunks from w_row (row n0 + g), 8·K/8 chunks apart; rows past N read row n0 + g instead
  // (in range: n0 < N) and are zeroed.
  const int64_t k_chunks = K / 8;  // 16-byte chunks per row
  const int64_t row_stride = 8 * k_chunks;
  const int64_t n_first = n0 + g < N ? n0 + g : n0;
  const uint4* w_row = reinterpret_cast<const uint4*>(W + (int64_t(e) * N + n_first) * K);
  unsigned w_ok = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) w_ok |= unsigned(n0 + g + 8 * i < N) << i;
  const int64_t steps = (K + kStepK - 1) / kStepK;
  constexpr int kTokensPerPass = 8 * kGroups;

  for (int64_t pass0 = row_begin; pass0 < row_end; pass0 += kTokensPerPass) {
    const int64_t left = row_end - pass0;
    const int groups = int(left >= kTokensPerPass ? kGroups : (left + 7) / 8);
    // Token rows of this lane as the B operand's column g of each group.
    const uint4* x_row[kGroups];
    bool x_ok[kGroups];
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      const int64_t r = pass0 + q * 8 + g;
      x_ok[q] = r < row_end;
      x_row[q] = reinterpret_cast<const uint4*>(A + (x_ok[q] ? r : row_begin) * K);
    }
    float acc[2][kGroups][4] = {};
    for (int64_t s0 = 0; s0 < steps; s0 += kUnroll) {
      uint4 wv[kUnroll][4];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t chunk = (s0 + u) * 4 + t;
        const bool k_ok = chunk < k_chunks;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          wv[u][i] = k_ok && (w_ok >> i & 1u) ? __ldcs(w_row + i * row_stride + chunk)
                                              : make_uint4(0u, 0u, 0u, 0u);
      }
      // (The x loads stay inside the group loop, each next to its MMAs: loading every group's
      // first spilled at 2 groups.)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t chunk = (s0 + u) * 4 + t;
        const bool k_ok = chunk < k_chunks;
#pragma unroll
        for (int q = 0; q < kGroups; ++q) {
          if (q >= groups) break;
          const uint4 xv = k_ok && x_ok[q] ? __ldg(x_row[q] + chunk) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            const uint4& lo = wv[u][2 * m];
            const uint4& hi = wv[u][2 * m + 1];
            const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y};
            const uint32_t a1[4] = {lo.z, hi.z, lo.w, hi.w};
            mma_bf16_16x8x16(acc[m][q], a0, xv.x, xv.y);
            mma_bf16_16x8x16(acc[m][q], a1, xv.z, xv.w);
          }
        }
      }
    }
    // acc[m][q]: C[row n0 + 16m + g (+8 for c2, c3)][token pass0 + 8q + 2t (+1 for c1, c3)].
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      if (q >= groups) break;
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t r = pass0 + q * 8 + 2 * t + (j & 1);
          const int64_t n = n0 + 16 * m + g + 8 * (j >> 1);
          if (r < row_end && n < N) Y[r * N + n] = __float2bfloat16_rn(acc[m][q][j]);
        }
    }
  }
}

}  // namespace

void launch_grouped_few_rows_nk_bf16(const uint16_t* A, const uint16_t* W, const int64_t* offsets,
                                     int E, int64_t R, int64_t K, int64_t N, uint16_t* Y,
                                     CUstream_st* stream) {
  if (E <= 0 || N <= 0 || K <= 0) return;
  const dim3 grid(unsigned((N + kRowsPerCta - 1) / kRowsPerCta), unsigned(E));
  // Token groups per pass by the mean rows per expert (an expert with more rows makes further
  // passes over its weights).
  auto kernel = R <= 2 * int64_t(E)   ? grouped_few_rows_nk_bf16_kernel<1>
                : R <= 6 * int64_t(E) ? grouped_few_rows_nk_bf16_kernel<2>
                                      : grouped_few_rows_nk_bf16_kernel<4>;
  kernel<<<grid, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const __nv_bfloat16*>(A), reinterpret_cast<const __nv_bfloat16*>(W), offsets,
      K, N, reinterpret_cast<__nv_bfloat16*>(Y));
  DM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dm::cuda::moe_detail
