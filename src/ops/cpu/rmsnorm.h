// RMSNorm forward and backward, templated on the scalar (SPEC §1: y = x · rsqrt(mean(x²) + eps) · w).
//   x, y, dy, dx : [N, D]     w, dw : [D]
// rmsnorm_forward<Real>:  y[n,:] = x[n,:] · r_n · w,   r_n = 1 / sqrt(mean(x[n,:]²) + eps).
//   y may alias x. The mean square is summed in double; r_n is formed in Real.
// rmsnorm_backward<Real>: ACCUMULATES (docs/backward.md)
//   dx[n,i] += r_n·w_i·dy[n,i] − x[n,i] · r_n³ · (Σ_k dy[n,k]·w_k·x[n,k]) / D
//   dw[i]   += Σ_n dy[n,i] · x[n,i] · r_n
//   r_n is recomputed from x (one extra pass over the row; nothing to save). dx must not alias x
//   or dy. dw is summed over rows in row order whatever the thread count (deterministic).
#pragma once
#include <cstdint>

namespace dm {

template <typename Real>
void rmsnorm_forward(const Real* x, const Real* w, Real* y, int64_t N, int64_t D, double eps);

template <typename Real>
void rmsnorm_backward(const Real* x, const Real* w, const Real* dy, Real* dx, Real* dw, int64_t N,
                      int64_t D, double eps);

}  // namespace dm
