// Block Attention Residual mixing (CPU, fp32). SPEC §1.3.
// For each token n, over S candidate vectors V_j = src[j][n, :] (each [N, D]):
//   logit_j = Σ_d RMSNorm(V_j)_d · γ_d · w_d = rsqrt(mean(V_j²) + eps) · Σ_d V_jd γ_d w_d
//   out[n]  = Σ_j softmax_j(logit) · V_j        (raw V_j, no 1/√d)
// weights (optional) [N, S] receives the softmax (for inspection / backward).
#pragma once
#include <cstdint>

namespace dm {

void attnres_forward(const float* const* src, int S, const float* query, const float* norm_w,
                     float* out, float* weights, int64_t N, int64_t D, float eps);

}  // namespace dm
