// The per-token preparation around the KDA operator (CPU; Real = float for the engine, double for
// reference checks). SPEC §1.1.
//   short_conv_silu_forward: depthwise causal conv (kernel Kc, no bias) + SiLU, per sequence.
//       x, y [B, T, C]; w [C, Kc] (checkpoint [C,1,Kc]); y[t,c] = SiLU(Σ_j w[c,j]·x[t−Kc+1+j, c]),
//       positions before 0 read from `tail` [B, Kc−1, C] (nullptr = zeros; decode carries it).
//       doc_start [B·T] (optional, docs/backward.md): the conv of token t reads no position
//       before doc_start[t] (zeros instead); `tail` only feeds tokens of a row's first document.
//   kda_gate_forward: log-decay g [N, H·K] from the raw low-rank output f [N, H·K]:
//       softplus gate: g = −exp(A_log[h]) · softplus(f + dt_bias)       (softplus linear above 20)
//       safe gate:     g = lb · sigmoid(exp(A_log[h]) · (f + dt_bias))          (lb < 0)
// Backwards accumulate (+=) into every gradient they produce.
#pragma once
#include "core/fastmath.h"
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "io/config.h"

namespace dm {

template <typename Real>
void short_conv_silu_forward(const Real* x, const Real* w, const std::type_identity_t<Real>* tail,
                             Real* y, int64_t B, int64_t T, int64_t C, int Kc,
                             const int32_t* doc_start = nullptr);
// dy [B, T, C] → dx [B, T, C] and dw [C, Kc] (both +=). The pre-activation is recomputed from x
// (and tail, whose gradient is not produced: it is the previous call's input).
template <typename Real>
void short_conv_silu_backward(const Real* x, const Real* w, const std::type_identity_t<Real>* tail,
                              const Real* dy, Real* dx, Real* dw, int64_t B, int64_t T, int64_t C,
                              int Kc, const int32_t* doc_start = nullptr);

template <typename Real>
void kda_gate_forward(const Real* f, const Real* A_log, const Real* dt_bias, Real* g, int64_t N,
                      int64_t H, int64_t K, KdaGateKind kind, float lower_bound);
// dg [N, H·K] → df [N, H·K], dA_log [H], ddt_bias [H·K] (all +=).
template <typename Real>
void kda_gate_backward(const Real* f, const Real* A_log, const Real* dt_bias, const Real* dg,
                       Real* df, Real* dA_log, Real* ddt_bias, int64_t N, int64_t H, int64_t K,
                       KdaGateKind kind, float lower_bound);

// Scalar helpers in the compute type (the float versions in norm.h compute the same values).
template <typename Real>
inline Real kda_sigmoid(Real x) {
  return sigmoid(x);  // core/fastmath.h
}
template <typename Real>
inline Real kda_softplus(Real x) {  // log(1 + e^x), linear above PyTorch's threshold 20
  return x > Real(20) ? x : std::log1p(std::exp(x));
}

}  // namespace dm
