// The KDA decay gate and β activation as device functions (formulas in kda_layer_ops.h; CPU
// twins in ops/cpu/kda_prep.cpp), shared by their own kernels (kda_layer_ops.cu) and the decode
// step, which applies them inside the recurrent kernel (kda_recurrent.cu) to save two launches.
// Included only by nvcc-compiled files.
#pragma once
#include <cuda_bf16.h>

#include "ops/cuda/elementwise_storage.cuh"

namespace dm::cuda {

// log(1 + e^z), linear above PyTorch's threshold 20 (as kda_softplus on the CPU).
__device__ __forceinline__ float softplus_f32(float z) { return z > 20.0f ? z : log1pf(expf(z)); }

// g = −e^{A}·softplus(f + dt_bias), or with the safe gate lower_bound·σ(e^{A}·(f + dt_bias));
// a = e^{A_log[h]}, z = f + dt_bias[c].
__device__ __forceinline__ float kda_gate_value(float a, float z, bool safe_gate,
                                                float lower_bound) {
  return safe_gate ? lower_bound * sigmoid_f32(a * z) : -a * softplus_f32(z);
}

// x rounded to bf16 and back (what a bf16 store then load gives).
__device__ __forceinline__ float round_through_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

}  // namespace dm::cuda
