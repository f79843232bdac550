// Gated feed-forward (CPU, fp32): SwiGLU and SiTU-GLU activations, their analytic derivatives,
// and the dense FFN block. SPEC §1.4.
#include "ops/cpu/ffn.h"

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

// σ(x) without overflow: exp only ever sees −|x| ≤ 0, so it lies in (0, 1] and 1 + e never
// overflows; for x < 0 the result e/(1+e) keeps full relative precision down to denormals.
template <typename Real>
inline Real sigmoid_stable(Real x) {
  const Real e = std::exp(-std::fabs(x));
  const Real r = Real(1) / (Real(1) + e);
  return x >= Real(0) ? r : e * r;
}

// SiTU gate half: a(g) = β1·tanh(g/β1)·σ(g); |a| < β1 since |tanh| ≤ 1 and σ ∈ [0, 1].
template <typename Real>
inline Real situ_gate(Real g, Real beta1) {
  return beta1 * std::tanh(g / beta1) * sigmoid_stable(g);
}
// SiTU up half: b(u) = β2·tanh(u/β2), bounded by β2.
template <typename Real>
inline Real situ_up(Real u, Real beta2) {
  return beta2 * std::tanh(u / beta2);
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

}  // namespace

void glu_forward(const float* g, const float* u, float* h, int64_t n, const GluActivation& a) {
  check_glu_params(a);
  const bool parallel = glu_should_parallelise(n);
  if (a.kind == Activation::SiTU) {
    const float beta1 = a.beta1, beta2 = a.beta2;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) h[i] = situ_gate(g[i], beta1) * situ_up(u[i], beta2);
  } else {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) h[i] = g[i] * sigmoid_stable(g[i]) * u[i];
  }
}

void glu_backward(const float* g, const float* u, const float* dh, float* dg, float* du, int64_t n,
                  const GluActivation& a) {
  check_glu_params(a);
  const bool parallel = glu_should_parallelise(n);
  if (a.kind == Activation::SiTU) {
    const float beta1 = a.beta1, beta2 = a.beta2;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) {
      const float gi = g[i], ui = u[i], dhi = dh[i];
      const float sig = sigmoid_stable(gi);
      const float sig_complement = sigmoid_stable(-gi);  // 1 − σ(g) without cancellation
      const float tanh_g = std::tanh(gi / beta1), tanh_u = std::tanh(ui / beta2);
      const float gate_half = beta1 * tanh_g * sig;
      const float up_half = beta2 * tanh_u;
      // a'(g) = (1 − tanh²(g/β1))·σ(g) + β1·tanh(g/β1)·σ(g)(1 − σ(g)); b'(u) = 1 − tanh²(u/β2).
      const float gate_half_grad = (1.0f - tanh_g * tanh_g) * sig + gate_half * sig_complement;
      const float up_half_grad = 1.0f - tanh_u * tanh_u;
      dg[i] = dhi * gate_half_grad * up_half;
      du[i] = dhi * gate_half * up_half_grad;
    }
  } else {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) {
      const float gi = g[i], ui = u[i], dhi = dh[i];
      const float sig = sigmoid_stable(gi);
      const float sig_complement = sigmoid_stable(-gi);
      // SiLU'(g) = σ(g)·(1 + g·(1 − σ(g))); at g → −∞ this is 0·(finite) → 0, never NaN.
      const float silu_grad = sig * (1.0f + gi * sig_complement);
      dg[i] = dhi * ui * silu_grad;
      du[i] = dhi * gi * sig;
    }
  }
}

double glu_reference(double g, double u, const GluActivation& a) {
  return glu_value<double>(g, u, a.kind, double(a.beta1), double(a.beta2));
}

size_t ffn_forward_workspace_bytes(int64_t N, int64_t F) {
  return 2 * Arena::round_up(size_t(N) * size_t(F) * sizeof(float));
}

void ffn_forward(const float* x, const float* w_gate, const float* w_up, const float* w_down,
                 float* y, int64_t N, int64_t d, int64_t F, const GluActivation& a, Arena& ws) {
  DM_CHECK(N >= 0 && d > 0 && F > 0, "ffn_forward: bad shape N=", N, " d=", d, " F=", F);
  if (N == 0) return;
  ArenaScope scope(ws);
  float* gate = ws.alloc<float>(size_t(N) * size_t(F));  // [N,F]; becomes h after the GLU
  float* up = ws.alloc<float>(size_t(N) * size_t(F));    // [N,F]
  linear(gate, x, w_gate, N, d, F);
  linear(up, x, w_up, N, d, F);
  glu_forward(gate, up, gate, N * F, a);  // in place: h overwrites the gate pre-activation
  linear(y, gate, w_down, N, F, d);
}

}  // namespace dm
