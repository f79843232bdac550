// Gated RMSNorm of the KDA output (SPEC §1.1), templated on the scalar (float engine, double
// reference checks). Per row of D (= the head dim):
//   y = x · rsqrt(mean(x²) + eps) · w ⊙ sigmoid(gate)          x, gate, y [N, D]; w [D]
// The forward computes the same values as the float rmsnorm_gated_forward in norm.h (sum of
// squares in double); y may alias x. The backward accumulates (+=) into dx, dw, dgate.
#pragma once
#include <cstdint>

namespace dm {

template <typename Real>
void rmsnorm_gated_forward(const Real* x, const Real* w, const Real* gate, Real* y, int64_t N,
                           int64_t D, float eps);

// dy [N, D] → dx [N, D], dw [D], dgate [N, D] (all +=; dx, dgate must not alias dy).
template <typename Real>
void rmsnorm_gated_backward(const Real* x, const Real* w, const Real* gate, const Real* dy,
                            Real* dx, Real* dw, Real* dgate, int64_t N, int64_t D, float eps);

}  // namespace dm
