// Kernels of the MoE backward (moe_kernels.h "Backward" section; checked entry points in
// moe_backward.cpp): router backward, routing-weight gradients, the weighted gather of the
// output gradient into expert-sorted rows and the per-token sum of the rows' input gradients.
// All memory-bound; every reduction has a fixed order (deterministic run to run, no atomics).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/moe_kernels.h"

namespace dm::cuda::moe_detail {

namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = 256;

void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  DM_CHECK(status == cudaSuccess, what, ": ", cudaGetErrorString(status));
}

// Grid of a grid-stride loop over n items: enough blocks to fill the GPU, never 0.
int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return int(blocks < 65535 * 32 ? (blocks > 0 ? blocks : 1) : 65535 * 32);
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(uint32_t(bits) << 16);
}

// One warp per token: zero the row [E], then each selected expert's logit gradient. The sums run
// serially in slot (= ascending expert) order in every lane, like the CPU op and the forward's
// renormalisation, so all lanes agree bit for bit.
__global__ void route_backward_kernel(const float* scores, const int32_t* idx,
                                      const float* dweights, int64_t N, int E, int k,
                                      bool renormalize, float scaling, float* dlogits) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= N) return;  // uniform per warp; no block-wide barrier below
  const float* score_row = scores + t * E;
  const int32_t* idx_row = idx + t * k;
  const float* dw_row = dweights + t * k;
  float* out = dlogits + t * E;
  for (int e = lane; e < E; e += 32) out[e] = 0.0f;
  // w_i = s_i·c, c = scaling/(S + ε):  ds_j = c·(dw_j − Σ_i dw_i·s_i/(S + ε)).
  float scale = scaling, correction = 0.0f;
  if (renormalize) {
    float sum = 0.0f, weighted = 0.0f;
    for (int i = 0; i < k; ++i) {
      const float s = score_row[idx_row[i]];
      sum += s;
      weighted += dw_row[i] * s;
    }
    const float denominator = sum + 1e-20f;  // the forward's ε
    scale = scaling / denominator;
    correction = weighted / denominator;
  }
  __syncwarp();  // the zeros above land before the selected entries below (other lanes' writes)
  for (int i = lane; i < k; i += 32) {
    const int e = idx_row[i];
    const float s = score_row[e];
    out[e] = scale * (dw_row[i] - correction) * s * (1.0f - s);  // σ' = s(1 − s)
  }
}

// One warp per (token, slot) pair: dweights[pair] = <dy[t], out[row]> over D, lane-strided
// partial sums then a fixed butterfly.
__global__ void expert_weight_grads_kernel(const float* dy, const uint16_t* out,
                                           const int32_t* row_of_pair, int64_t N, int k,
                                           int64_t D, float* dweights) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t pair = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (pair >= N * k) return;
  const int64_t t = pair / k;
  const float* dy_row = dy + t * D;
  const uint16_t* out_row = out + int64_t(row_of_pair[pair]) * D;
  float acc = 0.0f;
  for (int64_t c = lane; c < D; c += 32) acc += dy_row[c] * bf16_bits_to_float(out_row[c]);
  acc = warp_sum(acc);
  if (lane == 0) dweights[pair] = acc;
}

// Four columns per thread: dout[r, 4c..4c+3] = bf16(weight·dy[token, 4c..4c+3]).
__global__ void scale_permute_rows_kernel(const float4* dy, const int32_t* token,
                                          const int32_t* slot, const float* w, int64_t rows,
                                          int k, int64_t chunks, uint2* dout) {
  const int64_t total = rows * chunks;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks, c = i - r * chunks;
    const int64_t t = token[r];
    const float weight = w[t * k + slot[r]];
    const float4 v = dy[t * chunks + c];
    uint2 packed;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
    pairs[0] = __floats2bfloat162_rn(weight * v.x, weight * v.y);
    pairs[1] = __floats2bfloat162_rn(weight * v.z, weight * v.w);
    dout[i] = packed;
  }
}

// Four columns per thread: dx[t] (+)= Σ_s sorted[row_of_pair[t·k + s]] in slot order.
__global__ void unpermute_sum_rows_kernel(const float4* sorted, const int32_t* row_of_pair,
                                          int64_t N, int k, int64_t chunks, float4* dx,
                                          bool accumulate) {
  const int64_t total = N * chunks;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / chunks, c = i - t * chunks;
    float4 acc = accumulate ? dx[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < k; ++s) {
      const float4 v = sorted[int64_t(row_of_pair[t * k + s]) * chunks + c];
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    dx[i] = acc;
  }
}

}  // namespace

void launch_route_backward(const float* scores, const int32_t* idx, const float* dweights,
                           int64_t N, int E, int k, bool renormalize, float scaling,
                           float* dlogits, CUstream_st* stream) {
  if (N == 0) return;
  const int64_t blocks = (N + kWarpsPerBlock - 1) / kWarpsPerBlock;
  route_backward_kernel<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      scores, idx, dweights, N, E, k, renormalize, scaling, dlogits);
  check_launch("route_backward_kernel");
}

void launch_expert_weight_grads(const float* dy, const uint16_t* out, const int32_t* row_of_pair,
                                int64_t N, int k, int64_t D, float* dweights,
                                CUstream_st* stream) {
  if (N == 0) return;
  const int64_t blocks = (N * k + kWarpsPerBlock - 1) / kWarpsPerBlock;
  expert_weight_grads_kernel<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      dy, out, row_of_pair, N, k, D, dweights);
  check_launch("expert_weight_grads_kernel");
}

void launch_scale_permute_rows(const float* dy, const int32_t* token, const int32_t* slot,
                               const float* w, int64_t rows, int k, int64_t D, uint16_t* dout,
                               CUstream_st* stream) {
  if (rows == 0 || D == 0) return;
  const int64_t chunks = D / 4;
  scale_permute_rows_kernel<<<grid_for(rows * chunks), kThreads, 0, stream>>>(
      reinterpret_cast<const float4*>(dy), token, slot, w, rows, k, chunks,
      reinterpret_cast<uint2*>(dout));
  check_launch("scale_permute_rows_kernel");
}

void launch_unpermute_sum_rows(const float* sorted, const int32_t* row_of_pair, int64_t N, int k,
                               int64_t D, float* dx, bool accumulate, CUstream_st* stream) {
  if (N == 0 || D == 0) return;
  const int64_t chunks = D / 4;
  unpermute_sum_rows_kernel<<<grid_for(N * chunks), kThreads, 0, stream>>>(
      reinterpret_cast<const float4*>(sorted), row_of_pair, N, k, chunks,
      reinterpret_cast<float4*>(dx), accumulate);
  check_launch("unpermute_sum_rows_kernel");
}

}  // namespace dm::cuda::moe_detail
