// Storage <-> fp32 conversions shared by the element/norm/loss/optimizer kernels and the KDA
// kernels: tensors are stored as float or as bf16 bit patterns (uint16_t) and every kernel
// computes in fp32. Included only by nvcc-compiled files.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace dm::cuda {

__device__ __forceinline__ float load_as_float(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_as_float(const uint16_t* p, int64_t i) {
  return __bfloat162float(__ushort_as_bfloat16(p[i]));
}
__device__ __forceinline__ void store_from_float(float* p, int64_t i, float x) { p[i] = x; }
// Round to nearest even, as the host float_to_bf16 does.
__device__ __forceinline__ void store_from_float(uint16_t* p, int64_t i, float x) {
  p[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// σ(x) = 1/(1 + e^{−x}); 0 below −87 like core/fastmath.h (e^{87} is still finite in fp32).
// The reciprocal is __frcp_rn: the correctly rounded 1/y, the same bits as the IEEE division
// 1.0f / y, without the division's slow-path call (a GLU element spent more on its divisions
// than on its loads).
__device__ __forceinline__ float sigmoid_f32(float x) {
  return x < -87.0f ? 0.0f : __frcp_rn(1.0f + expf(-x));
}

}  // namespace dm::cuda
