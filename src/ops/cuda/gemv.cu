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

// The products of one launch (gemv.h GemvOutput), with the first block of each: blocks
// [block_begin[i], block_begin[i + 1]) compute kCols outputs each of product i.
struct GemvBatch {
  const uint16_t* W[kGemvMaxOutputs];
  void* y[kGemvMaxOutputs];
  int64_t ldw[kGemvMaxOutputs], N[kGemvMaxOutputs], ldy[kGemvMaxOutputs];
  int block_begin[kGemvMaxOutputs + 1];
  bool f32[kGemvMaxOutputs];
  int count;
};

template <int kRows>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_bf16_kernel(const uint16_t* __restrict__ x, int64_t ldx, int64_t K, float alpha,
                     float beta, const GemvBatch batch) {
  __shared__ float partial[kWarps][kRows * kCols];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int target = 0;
  while (target + 1 < batch.count && int(blockIdx.x) >= batch.block_begin[target + 1]) ++target;
  const uint16_t* __restrict__ W = batch.W[target];
  const int64_t ldw = batch.ldw[target], N = batch.N[target], ldy = batch.ldy[target];
  const int64_t n0 = int64_t(int(blockIdx.x) - batch.block_begin[target]) * kCols;
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
      const int64_t at = r * ldy + n0 + c;
      if (batch.f32[target])
        store_out(static_cast<float*>(batch.y[target]) + at, alpha * sum, beta);
      else
        store_out(static_cast<__nv_bfloat16*>(batch.y[target]) + at, alpha * sum, beta);
    }
  }
}

template <int kRows>
void launch_rows(int64_t K, float alpha, const uint16_t* x, int64_t ldx, float beta,
                 const GemvBatch& batch, CUstream_st* stream) {
  gemv_bf16_kernel<kRows><<<batch.block_begin[batch.count], kWarps * 32, 0, stream>>>(
      x, ldx, K, alpha, beta, batch);
  check_last_error("gemv_bf16_kernel");
}

void launch_batch(int64_t M, int64_t K, float alpha, const uint16_t* x, int64_t ldx, float beta,
                  const GemvBatch& batch, CUstream_st* stream) {
  if (batch.block_begin[batch.count] == 0) return;
  switch (M) {
    case 1: launch_rows<1>(K, alpha, x, ldx, beta, batch, stream); break;
    case 2: launch_rows<2>(K, alpha, x, ldx, beta, batch, stream); break;
    case 3: launch_rows<3>(K, alpha, x, ldx, beta, batch, stream); break;
    default: launch_rows<4>(K, alpha, x, ldx, beta, batch, stream); break;
  }
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
  const GemvOutput out{W, ldw, N, y, y_type, ldy};
  launch_gemv_bf16_many(M, K, x, ldx, &out, 1, stream, alpha, beta);
}

void launch_gemv_bf16_many(int64_t M, int64_t K, const uint16_t* x, int64_t ldx,
                           const GemvOutput* outputs, int count, CUstream_st* stream, float alpha,
                           float beta) {
  DM_CHECK(count >= 1 && count <= kGemvMaxOutputs, "launch_gemv_bf16_many: ", count,
           " outputs (1 to ", kGemvMaxOutputs, ")");
  GemvBatch batch{};
  batch.count = count;
  int64_t blocks = 0;
  for (int i = 0; i < count; ++i) {
    const GemvOutput& o = outputs[i];
    DM_CHECK(gemv_applies(M, K, x, ldx, o.W, o.ldw), "launch_gemv_bf16: unsupported product M=",
             M, " K=", K, " ldx=", ldx, " ldw=", o.ldw);
    DM_CHECK(o.N >= 0 && (o.N == 0 || o.ldy >= o.N), "launch_gemv_bf16: output ", i, " has N=",
             o.N, ", ldy=", o.ldy);
    batch.W[i] = o.W;
    batch.y[i] = o.y;
    batch.ldw[i] = o.ldw;
    batch.N[i] = o.N;
    batch.ldy[i] = o.ldy;
    batch.f32[i] = o.y_type == GemmOutType::F32;
    batch.block_begin[i] = int(blocks);
    blocks += (o.N + kCols - 1) / kCols;
  }
  DM_CHECK(blocks < (int64_t(1) << 31), "launch_gemv_bf16: ", blocks, " blocks");
  batch.block_begin[count] = int(blocks);
  launch_batch(M, K, alpha, x, ldx, beta, batch, stream);
}

}  // namespace dm::cuda
