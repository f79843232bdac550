// Gated feed-forward pieces (CPU, fp32). SPEC §1.4.
//   SwiGLU : h = SiLU(g) · u
//   SiTU   : h = [β1·tanh(g/β1)·sigmoid(g)] · [β2·tanh(u/β2)]
// ffn_forward: y[N,d] = W_down[d,F] · act(W_gate[F,d] x, W_up[F,d] x), x [N,d]; scratch from ws.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/arena.h"
#include "io/config.h"

namespace dm {

struct GluActivation {
  Activation kind = Activation::SwiGLU;
  float beta1 = 4.0f, beta2 = 25.0f;
};

// h[i] = act(g[i], u[i]) for i < n. h may alias g or u (element-wise, in place is fine).
// Finite for every finite input (sigmoid only ever exponentiates a non-positive number).
void glu_forward(const float* g, const float* u, float* h, int64_t n, const GluActivation& a);
// Analytic derivative (SPEC §1.4: no finite differences): dg[i] = dh[i]·∂act/∂g, du[i] =
// dh[i]·∂act/∂u at (g[i], u[i]). dg/du may alias g/u respectively.
void glu_backward(const float* g, const float* u, const float* dh, float* dg, float* du, int64_t n,
                  const GluActivation& a);
// Reference in double (tests, finite differences).
double glu_reference(double g, double u, const GluActivation& a);

void ffn_forward(const float* x, const float* w_gate, const float* w_up, const float* w_down,
                 float* y, int64_t N, int64_t d, int64_t F, const GluActivation& a, Arena& ws);
// Scratch ffn_forward takes from ws (released again before it returns): two [N,F] fp32 buffers.
size_t ffn_forward_workspace_bytes(int64_t N, int64_t F);

}  // namespace dm
