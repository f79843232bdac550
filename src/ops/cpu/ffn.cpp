// Gated feed-forward (CPU; float engine, double for reference checks): SwiGLU and SiTU-GLU
// activations, their analytic derivatives, and the dense FFN block forward + backward. SPEC §1.4.
#include "ops/cpu/ffn.h"

#include "core/fastmath.h"

#include <cmath>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "core/error.h"
#include "core/gemm.h"

namespace dm {
namespace {

// Below this many elements a parallel region costs more than the transcendental math it splits.
constexpr int64_t kGluParallelMinElements = 1 << 15;

// True when a new parallel region would actually get threads: callers such as
// moe_experts_forward already run glu inside their own per-expert parallel loop.
inline bool glu_should_parallelise(int64_t n) {
#ifdef _OPENMP
  return n >= kGluParallelMinElements && !omp_in_parallel();
#else
  (void)n;
  return false;
#endif
}

template <typename Real>
inline Real sigmoid_stable(Real x) {
  return sigmoid(x);  // core/fastmath.h: vectorisable, no overflow at ±1e4
}

// SiTU gate half: a(g) = β1·tanh(g/β1)·σ(g); |a| < β1 since |tanh| ≤ 1 and σ ∈ [0, 1].
template <typename Real>
inline Real situ_gate(Real g, Real beta1) {
  return beta1 * tanh_fast(g / beta1) * sigmoid_stable(g);
}
// SiTU up half: b(u) = β2·tanh(u/β2), bounded by β2.
template <typename Real>
inline Real situ_up(Real u, Real beta2) {
  return beta2 * tanh_fast(u / beta2);
}

template <typename Real>
inline Real glu_value(Real g, Real u, Activation kind, Real beta1, Real beta2) {
  if (kind == Activation::SiTU) return situ_gate(g, beta1) * situ_up(u, beta2);
  // SwiGLU: SiLU(g)·u = g·σ(g)·u. For g → −∞, σ(g) underflows to 0 before g·σ(g) could be inf.
  return g * sigmoid_stable(g) * u;
}

void check_glu_params(const GluActivation& a) {
  if (a.kind == Activation::SiTU)
    DM_CHECK(a.beta1 > 0.0f && a.beta2 > 0.0f, "SiTU-GLU needs beta1 > 0 and beta2 > 0, got ",
             a.beta1, ", ", a.beta2);
}

// y[N,out] (+)= x[N,in] · W[out,in]ᵀ for either scalar (core/gemm.h has both gemm overloads).
template <typename Real>
inline void ffn_linear(Real* y, const Real* x, const Real* W, int64_t N, int64_t in, int64_t out,
                       bool accumulate) {
  gemm(false, true, N, out, in, Real(1), x, in, W, in, accumulate ? Real(1) : Real(0), y, out);
}

}  // namespace

template <typename Real>
void glu_forward(const Real* g, const Real* u, Real* h, int64_t n, const GluActivation& a) {
  check_glu_params(a);
  const bool parallel = glu_should_parallelise(n);
  if (a.kind == Activation::SiTU) {
    const Real beta1 = a.beta1, beta2 = a.beta2;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) h[i] = situ_gate(g[i], beta1) * situ_up(u[i], beta2);
  } else {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) h[i] = g[i] * sigmoid_stable(g[i]) * u[i];
  }
}

template <typename Real>
void glu_backward(const Real* g, const Real* u, const Real* dh, Real* dg, Real* du, int64_t n,
                  const GluActivation& a) {
  check_glu_params(a);
  const bool parallel = glu_should_parallelise(n);
  const Real one = Real(1);
  if (a.kind == Activation::SiTU) {
    const Real beta1 = a.beta1, beta2 = a.beta2;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) {
      // Every input of element i is read before dg[i]/du[i] are written: aliasing is safe.
      const Real gi = g[i], ui = u[i], dhi = dh[i];
      const Real sig = sigmoid_stable(gi);
      const Real sig_complement = sigmoid_stable(-gi);  // 1 − σ(g) without cancellation
      const Real tanh_g = tanh_fast(gi / beta1), tanh_u = tanh_fast(ui / beta2);
      const Real gate_half = beta1 * tanh_g * sig;
      const Real up_half = beta2 * tanh_u;
      // a'(g) = (1 − tanh²(g/β1))·σ(g) + β1·tanh(g/β1)·σ(g)(1 − σ(g)); b'(u) = 1 − tanh²(u/β2).
      const Real gate_half_grad = (one - tanh_g * tanh_g) * sig + gate_half * sig_complement;
      const Real up_half_grad = one - tanh_u * tanh_u;
      dg[i] = dhi * gate_half_grad * up_half;
      du[i] = dhi * gate_half * up_half_grad;
    }
  } else {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) {
      const Real gi = g[i], ui = u[i], dhi = dh[i];
      const Real sig = sigmoid_stable(gi);
      const Real sig_complement = sigmoid_stable(-gi);
      // SiLU'(g) = σ(g)·(1 + g·(1 − σ(g))); at g → −∞ this is 0·(finite) → 0, never NaN.
      const Real silu_grad = sig * (one + gi * sig_complement);
      dg[i] = dhi * ui * silu_grad;
      du[i] = dhi * gi * sig;
    }
  }
}

double glu_reference(double g, double u, const GluActivation& a) {
  return glu_value<double>(g, u, a.kind, double(a.beta1), double(a.beta2));
}

size_t ffn_forward_workspace_bytes(int64_t N, int64_t F, size_t elem_bytes) {
  return 2 * Arena::round_up(size_t(N) * size_t(F) * elem_bytes);
}

template <typename Real>
void ffn_forward(const Real* x, const Real* w_gate, const Real* w_up, const Real* w_down, Real* y,
                 int64_t N, int64_t d, int64_t F, const GluActivation& a, Arena& ws,
                 std::type_identity_t<Real>* saved_gate, std::type_identity_t<Real>* saved_up) {
  DM_CHECK(N >= 0 && d > 0 && F > 0, "ffn_forward: bad shape N=", N, " d=", d, " F=", F);
  DM_CHECK((saved_gate == nullptr) == (saved_up == nullptr),
           "ffn_forward: saved_gate and saved_up go together");
  if (N == 0) return;
  ArenaScope scope(ws);
  const size_t NF = size_t(N) * size_t(F);
  if (saved_gate) {
    // Training: g and u must survive for the backward, so h gets its own buffer.
    Real* h = ws.alloc<Real>(NF);  // [N,F]
    ffn_linear(saved_gate, x, w_gate, N, d, F, false);
    ffn_linear(saved_up, x, w_up, N, d, F, false);
    glu_forward(saved_gate, saved_up, h, N * F, a);
    ffn_linear(y, h, w_down, N, F, d, false);
    return;
  }
  Real* gate = ws.alloc<Real>(NF);  // [N,F]; becomes h after the GLU
  Real* up = ws.alloc<Real>(NF);    // [N,F]
  ffn_linear(gate, x, w_gate, N, d, F, false);
  ffn_linear(up, x, w_up, N, d, F, false);
  glu_forward(gate, up, gate, N * F, a);  // in place: h overwrites the gate pre-activation
  ffn_linear(y, gate, w_down, N, F, d, false);
}

size_t ffn_backward_workspace_bytes(int64_t N, int64_t F, size_t elem_bytes) {
  // g, u (when recomputed), h, dh (→ dg in place), du.
  return 5 * Arena::round_up(size_t(N) * size_t(F) * elem_bytes);
}

template <typename Real>
void ffn_backward(const Real* x, const Real* w_gate, const Real* w_up, const Real* w_down,
                  const std::type_identity_t<Real>* saved_gate,
                  const std::type_identity_t<Real>* saved_up, const Real* dy,
                  std::type_identity_t<Real>* dx, std::type_identity_t<Real>* dw_gate,
                  std::type_identity_t<Real>* dw_up, std::type_identity_t<Real>* dw_down, int64_t N,
                  int64_t d, int64_t F, const GluActivation& a, Arena& ws) {
  DM_CHECK(N >= 0 && d > 0 && F > 0, "ffn_backward: bad shape N=", N, " d=", d, " F=", F);
  DM_CHECK((saved_gate == nullptr) == (saved_up == nullptr),
           "ffn_backward: saved_gate and saved_up go together");
  if (N == 0) return;
  ArenaScope scope(ws);
  const size_t NF = size_t(N) * size_t(F);
  const Real* gate = saved_gate;  // [N,F]
  const Real* up = saved_up;      // [N,F]
  if (!saved_gate) {
    Real* gate_recomputed = ws.alloc<Real>(NF);
    Real* up_recomputed = ws.alloc<Real>(NF);
    ffn_linear(gate_recomputed, x, w_gate, N, d, F, false);
    ffn_linear(up_recomputed, x, w_up, N, d, F, false);
    gate = gate_recomputed;
    up = up_recomputed;
  }
  Real* h = ws.alloc<Real>(NF);   // [N,F] = act(g, u)
  Real* dh = ws.alloc<Real>(NF);  // [N,F]; becomes dg in place
  Real* du = ws.alloc<Real>(NF);  // [N,F]
  glu_forward(gate, up, h, N * F, a);
  // y = h·W_downᵀ: dW_down[d,F] += dyᵀ[d,N]·h[N,F]; dh[N,F] = dy[N,d]·W_down[d,F].
  if (dw_down) gemm(true, false, d, F, N, Real(1), dy, d, h, F, Real(1), dw_down, F);
  gemm(false, false, N, F, d, Real(1), dy, d, w_down, F, Real(0), dh, F);
  glu_backward(gate, up, dh, /*dg=*/dh, du, N * F, a);
  const Real* dg = dh;
  // g = x·W_gateᵀ: dW_gate[F,d] += dgᵀ[F,N]·x[N,d]; dx[N,d] += dg[N,F]·W_gate[F,d]; same for up.
  if (dw_gate) gemm(true, false, F, d, N, Real(1), dg, F, x, d, Real(1), dw_gate, d);
  if (dw_up) gemm(true, false, F, d, N, Real(1), du, F, x, d, Real(1), dw_up, d);
  if (dx) {
    gemm(false, false, N, d, F, Real(1), dg, F, w_gate, d, Real(1), dx, d);
    gemm(false, false, N, d, F, Real(1), du, F, w_up, d, Real(1), dx, d);
  }
}

#define DM_FFN_INSTANTIATE(Real)                                                                  \
  template void glu_forward<Real>(const Real*, const Real*, Real*, int64_t,                      \
                                  const GluActivation&);                                          \
  template void glu_backward<Real>(const Real*, const Real*, const Real*, Real*, Real*, int64_t, \
                                   const GluActivation&);                                         \
  template void ffn_forward<Real>(const Real*, const Real*, const Real*, const Real*, Real*,     \
                                  int64_t, int64_t, int64_t, const GluActivation&, Arena&, Real*, \
                                  Real*);                                                         \
  template void ffn_backward<Real>(const Real*, const Real*, const Real*, const Real*,           \
                                   const Real*, const Real*, const Real*, Real*, Real*, Real*,   \
                                   Real*, int64_t, int64_t, int64_t, const GluActivation&, Arena&);
DM_FFN_INSTANTIATE(float)
DM_FFN_INSTANTIATE(double)
#undef DM_FFN_INSTANTIATE

}  // namespace dm
