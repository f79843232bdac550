// Normalisations and elementwise activations (CPU, fp32 compute).
//   rmsnorm_forward:        y[n,:] = x[n,:] · rsqrt(mean(x[n,:]²) + eps) · w          x,y [N,D]
//   rmsnorm_gated_forward:  y = rmsnorm(x)·w ⊙ sigmoid(gate)     (KDA output: per-head norm, D = head dim)
// y may alias x.
#pragma once
#include "core/fastmath.h"
#include <cmath>
#include <cstdint>

namespace dm {

void rmsnorm_forward(const float* x, const float* w, float* y, int64_t N, int64_t D, float eps);
void rmsnorm_gated_forward(const float* x, const float* w, const float* gate, float* y, int64_t N,
                           int64_t D, float eps);

inline float sigmoidf_stable(float x) { return sigmoid(x); }  // core/fastmath.h
inline float siluf(float x) { return x * sigmoidf_stable(x); }
inline float softplusf(float x) {  // log(1 + e^x), PyTorch threshold 20
  return x > 20.0f ? x : std::log1p(std::exp(x));
}

void sigmoid_inplace(float* x, int64_t n);
// y = a + b elementwise (y may alias a).
void add_inplace(float* y, const float* b, int64_t n);

}  // namespace dm
