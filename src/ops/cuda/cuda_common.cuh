// Device-side helpers shared by the .cu files of the CUDA backend: error checks, bf16
// conversions and warp reductions. Included only by nvcc-compiled files.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/error.h"

#define DM_CUDA_CHECK(expr)                                                                   \
  do {                                                                                       \
    const cudaError_t dm_cuda_status_ = (expr);                                              \
    if (dm_cuda_status_ != cudaSuccess)                                                       \
      throw ::dm::Error(::dm::str_cat(#expr, ": ", cudaGetErrorString(dm_cuda_status_)));     \
  } while (0)

namespace dm::cuda {

// float or double (fp64 sums where a parameter gradient adds up many signed terms).
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, ≤ 1024); every thread gets the sum.
// `shared` holds ≥ 32 values; the leading barrier lets back-to-back calls reuse it.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : T(0);
  return warp_sum(v);
}

// Sums of two values over a block of kWarps warps, thread tid (linear), in warp order; every
// thread gets both. scratch holds 2 × kWarps floats. Its barrier also publishes what the block
// wrote to shared memory before the call; a caller that calls again must barrier in between.
template <int kWarps>
__device__ __forceinline__ void block_sum_pair(float& a, float& b, int tid,
                                               float (&scratch)[2][kWarps]) {
  a = warp_sum(a);
  b = warp_sum(b);
  if ((tid & 31) == 0) {
    scratch[0][tid >> 5] = a;
    scratch[1][tid >> 5] = b;
  }
  __syncthreads();
  a = 0.0f;
  b = 0.0f;
  for (int w = 0; w < kWarps; ++w) {
    a += scratch[0][w];
    b += scratch[1][w];
  }
}

inline int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

}  // namespace dm::cuda
