// Few-row bf16 GEMV (gemv.h). A block of kWarps warps owns kCols consecutive outputs n (rows of
// W) for all M rows of x; its warps split K in kWarps ranges (split-K inside the block), so every
// load of a weight row is issued in the block's first step for K ≤ kWarps·kUnroll·32·8 = 4096
// (a warp's range is then at most kUnroll·32 16-byte chunks: one step of kUnroll predicated loads
// per lane and column). (With one warp walking all of K the loads came in four dependent
// rounds and a [2304, 4096] weight streamed at 1.5 TB/s.) x's matching chunks hit L1: every warp
// of the block reads the same x. fp32 sums, reduced across the warp with shuffles and across
// the warps in shared memory. The weights are read with evict-first loads: nothing in one decode
// step reads a weight twice.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/gemv.h"

namespace dm::cuda {
namespace {

constexpr int kWarps = 4;   // K ranges per block
constexpr int kCols = 2;    // outputs per block
constexpr int kUnroll = 4;  // 16-byte chunks per lane and column in one step
constexpr int kChunk = 8;   // bf16 per 16-byte load

__device__ __forceinline__ float bf16_lo(uint32_t bits) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t bits) {
  return __uint_as_float(bits & 0xffff0000u);
}

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float acc) {
  acc = fmaf(bf16_lo(a.x), bf16_lo(b.x), acc);
  acc = fmaf(bf16_hi(a.x), bf16_hi(b.x), acc);
  acc = fmaf(bf16_lo(a.y), bf16_lo(b.y), acc);
  acc = fmaf(bf16_hi(a.y), bf16_hi(b.y), acc);
  acc = fmaf(bf16_lo(a.z), bf16_lo(b.z), acc);
  acc = fmaf(bf16_hi(a.z), bf16_hi(b.z), acc);
  acc = fmaf(bf16_lo(a.w), bf16_lo(b.w), acc);
  acc = fmaf(bf16_hi(a.w), bf16_hi(b.w), acc);
  return acc;
}

__device__ __forceinline__ void store_out(float* y, float v, float beta) {
  *y = beta != 0.0f ? fmaf(beta, *y, v) : v;
}
__device__ __forceinline__ void store_out(__nv_bfloat16* y, float v, float beta) {
  *y = __float2bfloat16(beta != 0.0f ? fmaf(beta, __bfloat162float(*y), v) : v);
}

template <int kRows, typename Out>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_bf16_kernel(const uint16_t* __restrict__ x, int64_t ldx, const uint16_t* __restrict__ W,
                     int64_t ldw, Out* __restrict__ y, int64_t ldy, int64_t N, int64_t K,
                     float alpha, float beta) {
  __shared__ float partial[kWarps][kRows * kCols];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n0 = int64_t(blockIdx.x) * kCols;
  // A column past N re-reads the last row (in bounds) and is not written.
  const uint4* w_rows[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c)
    w_rows[c] = reinterpret_cast<const uint4*>(W + (n0 + c < N ? n0 + c : N - 1) * ldw);
  const uint4* x_rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) x_rows[r] = reinterpret_cast<const uint4*>(x + r * ldx);

  float acc[kRows][kCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0f;

  // This warp's chunks (of 8 elements): [begin, end); lane takes begin + lane + 32·i.
  const int64_t chunks = K / kChunk, per_warp = (chunks + kWarps - 1) / kWarps;
  const int64_t begin = warp * per_warp, end = begin + per_warp < chunks ? begin + per_warp : chunks;
  for (int64_t j = begin + lane; j < end; j += kUnroll * 32) {
    uint4 wv[kUnroll][kCols];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        wv[u][c] = j + u * 32 < end ? __ldcs(w_rows[c] + j + u * 32) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j + u * 32 >= end) break;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const uint4 xv = __ldg(x_rows[r] + j + u * 32);
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[r][c] = dot8(xv, wv[u][c], acc[r][c]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float v = warp_sum(acc[r][c]);
      if (lane == 0) partial[warp][r * kCols + c] = v;
    }
  __syncthreads();
  if (threadIdx.x < kRows * kCols) {
    const int r = threadIdx.x / kCols, c = threadIdx.x % kCols;
    if (n0 + c < N) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += partial[w][threadIdx.x];
      store_out(y + r * ldy + n0 + c, alpha * sum, beta);
    }
  }
}

template <int kRows>
void launch_rows(int64_t N, int64_t K, float alpha, const uint16_t* x, int64_t ldx,
                 const uint16_t* W, int64_t ldw, float beta, void* y, GemmOutType y_type,
                 int64_t ldy, CUstream_st* stream) {
  const int blocks = ceil_div(N, kCols);
  if (y_type == GemmOutType::F32)
    gemv_bf16_kernel<kRows, float><<<blocks, kWarps * 32, 0, stream>>>(
        x, ldx, W, ldw, static_cast<float*>(y), ldy, N, K, alpha, beta);
  else
    gemv_bf16_kernel<kRows, __nv_bfloat16><<<blocks, kWarps * 32, 0, stream>>>(
        x, ldx, W, ldw, static_cast<__nv_bfloat16*>(y), ldy, N, K, alpha, beta);
  check_last_error("gemv_bf16_kernel");
}

bool gemv_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("DM_GEMV");
    if (env == nullptr || *env == '\0' || !std::strcmp(env, "ours")) return true;
    DM_CHECK(!std::strcmp(env, "cublas"), "DM_GEMV: expected ours or cublas, got '", env, "'");
    return false;
  }();
  return enabled;
}

}  // namespace

bool gemv_applies(int64_t M, int64_t K, const uint16_t* x, int64_t ldx, const uint16_t* W,
                  int64_t ldw) {
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return M >= 1 && M <= kGemvMaxRows && K > 0 && K % kChunk == 0 && ldx % kChunk == 0 &&
         ldw % kChunk == 0 && aligned16(x) && aligned16(W) && gemv_enabled();
}

void launch_gemv_bf16(int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* x,
                      int64_t ldx, const uint16_t* W, int64_t ldw, float beta, void* y,
                      GemmOutType y_type, int64_t ldy, CUstream_st* stream) {
  DM_CHECK(gemv_applies(M, K, x, ldx, W, ldw), "launch_gemv_bf16: unsupported product M=", M,
           " K=", K, " ldx=", ldx, " ldw=", ldw);
  if (N == 0) return;
  switch (M) {
    case 1: launch_rows<1>(N, K, alpha, x, ldx, W, ldw, beta, y, y_type, ldy, stream); break;
    case 2: launch_rows<2>(N, K, alpha, x, ldx, W, ldw, beta, y, y_type, ldy, stream); break;
    case 3: launch_rows<3>(N, K, alpha, x, ldx, W, ldw, beta, y, y_type, ldy, stream); break;
    default: launch_rows<4>(N, K, alpha, x, ldx, W, ldw, beta, y, y_type, ldy, stream); break;
  }
}

}  // namespace dm::cuda
