// Gated feed-forward pieces (CPU). SPEC §1.4. Templated on the scalar (float engine, double for
// finite-difference checks; docs/backward.md), explicitly instantiated for both in ffn.cpp.
//   SwiGLU : h = SiLU(g) · u
//   SiTU   : h = [β1·tanh(g/β1)·sigmoid(g)] · [β2·tanh(u/β2)]
// ffn_forward:  y[N,d] = W_down[d,F] · act(W_gate[F,d] x, W_up[F,d] x), x [N,d]; scratch from ws.
// ffn_backward: dx, dW_gate, dW_up, dW_down from dy, with g/u saved by the forward or recomputed.
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/arena.h"
#include "io/config.h"

namespace dm {

struct GluActivation {
  Activation kind = Activation::SwiGLU;
  float beta1 = 4.0f, beta2 = 25.0f;
};

// h[i] = act(g[i], u[i]) for i < n. h may alias g or u (element-wise, in place is fine).
// Finite for every finite input (sigmoid only ever exponentiates a non-positive number).
template <typename Real>
void glu_forward(const Real* g, const Real* u, Real* h, int64_t n, const GluActivation& a);
// Analytic derivative (SPEC §1.4: no finite differences): dg[i] = dh[i]·∂act/∂g, du[i] =
// dh[i]·∂act/∂u at (g[i], u[i]). Element-wise and *overwriting* (not accumulating) so that dg
// may alias g or dh, and du may alias u.
template <typename Real>
void glu_backward(const Real* g, const Real* u, const Real* dh, Real* dg, Real* du, int64_t n,
                  const GluActivation& a);
// Reference in double (tests, finite differences).
double glu_reference(double g, double u, const GluActivation& a);

// saved_gate / saved_up (optional, [N,F] each, both or neither): receive the pre-activations
// g = x·W_gateᵀ and u = x·W_upᵀ for ffn_backward; then the forward takes only h from ws.
template <typename Real>
void ffn_forward(const Real* x, const Real* w_gate, const Real* w_up, const Real* w_down, Real* y,
                 int64_t N, int64_t d, int64_t F, const GluActivation& a, Arena& ws,
                 std::type_identity_t<Real>* saved_gate = nullptr,
                 std::type_identity_t<Real>* saved_up = nullptr);
// Scratch ffn_forward takes from ws (released again before it returns): two [N,F] buffers.
size_t ffn_forward_workspace_bytes(int64_t N, int64_t F, size_t elem_bytes = sizeof(float));

// Accumulates (docs/backward.md): dx[N,d] += ∂L/∂x, dw_gate[F,d] += …, dw_up[F,d] += …,
// dw_down[d,F] += …, given dy[N,d] = ∂L/∂y. Any of dx / dw_* may be nullptr (not wanted).
// saved_gate / saved_up: the forward's g/u; nullptr (both) → recomputed from x (two GEMMs).
// Gradients must not alias the inputs. (Nullable pointers are non-deduced: nullptr is fine.)
template <typename Real>
void ffn_backward(const Real* x, const Real* w_gate, const Real* w_up, const Real* w_down,
                  const std::type_identity_t<Real>* saved_gate,
                  const std::type_identity_t<Real>* saved_up, const Real* dy,
                  std::type_identity_t<Real>* dx, std::type_identity_t<Real>* dw_gate,
                  std::type_identity_t<Real>* dw_up, std::type_identity_t<Real>* dw_down, int64_t N,
                  int64_t d, int64_t F, const GluActivation& a, Arena& ws);
// Upper bound of the scratch ffn_backward takes from ws (released before it returns).
size_t ffn_backward_workspace_bytes(int64_t N, int64_t F, size_t elem_bytes = sizeof(float));

}  // namespace dm
