// Block Attention Residual mixing (CPU). SPEC §1.3.
// For each token n, over S candidate vectors V_j = src[j][n, :] (each [N, D]):
//   logit_j = Σ_d RMSNorm(V_j)_d · γ_d · w_d = r_j · Σ_d V_jd γ_d w_d,  r_j = rsqrt(mean(V_j²) + eps)
//   out[n]  = Σ_j softmax_j(logit) · V_j        (raw V_j, no 1/√d), logits in fp32 or better
// weights (optional) [N, S] receives the softmax (for inspection).
#pragma once
#include <cstdint>

#include "core/arena.h"

namespace dm {

inline constexpr int kAttnResMaxSources = 256;  // sealed blocks + 1; the full model needs 93/12 + 2

template <typename Real>
void attnres_forward(const Real* const* src, int S, const Real* query, const Real* norm_w, Real* out,
                     Real* weights, int64_t N, int64_t D, float eps);

// Backward of attnres_forward (recomputes the softmax). Accumulates into dsrc[j] [N, D] (each
// may be nullptr to skip), dquery [D] and dnorm_w [D]. Scratch: attnres_backward_workspace_bytes.
template <typename Real>
void attnres_backward(const Real* const* src, int S, const Real* query, const Real* norm_w,
                      const Real* dout, Real* const* dsrc, Real* dquery, Real* dnorm_w, int64_t N,
                      int64_t D, float eps, Arena& ws);
size_t attnres_backward_workspace_bytes(int64_t D, size_t real_size);

}  // namespace dm
