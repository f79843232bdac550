// Stable Latent MoE channel mixer and dense FFN layers: forward (optionally saving what the
// backward needs) and backward. SPEC §1.4, §1.5; conventions in docs/backward.md.
#include "model/moe.h"

#include <algorithm>

#include "core/error.h"
#include "core/gemm.h"
#include "ops/cpu/rmsnorm.h"

namespace dm {

MoeShape moe_shape(const ModelConfig& cfg) {
  const MoeConfig& m = cfg.moe;
  MoeShape s;
  s.E = m.num_experts;
  s.k = m.top_k;
  s.d = cfg.hidden;
  s.has_latent = m.latent_dim > 0;
  s.latent = s.has_latent ? m.latent_dim : s.d;
  s.has_latent_norm = s.has_latent && m.latent_norm;
  s.F = m.expert_ffn;
  s.shared_F = int64_t(m.num_shared) * m.shared_ffn;
  s.has_shared = m.num_shared > 0;
  return s;
}
namespace {

// y[N,out] = x[N,in]·W[out,in]ᵀ for either scalar.
template <typename Real>
inline void layer_linear(Real* y, const Real* x, const Real* W, int64_t N, int64_t in,
                         int64_t out) {
  gemm(false, true, N, out, in, Real(1), x, in, W, in, Real(0), y, out);
}

// Byte counting for a scalar chosen at run time (SizeCounter takes the type statically).
struct ElementCounter {
  size_t elem_bytes;
  size_t bytes = 0;
  void add_real(int64_t n) { bytes += Arena::round_up(size_t(std::max<int64_t>(n, 0)) * elem_bytes); }
  template <typename T>
  void add(int64_t n) { bytes += Arena::round_up(size_t(std::max<int64_t>(n, 0)) * sizeof(T)); }
};


}  // namespace

GluActivation glu_activation(const ModelConfig& cfg) {
  return {cfg.activation, cfg.situ_beta1, cfg.situ_beta2};
}

RouterParams router_params(const ModelConfig& cfg) {
  RouterParams p;
  p.num_experts = cfg.moe.num_experts;
  p.top_k = cfg.moe.top_k;
  p.n_group = cfg.moe.n_group;
  p.topk_group = cfg.moe.topk_group;
  p.renormalize = cfg.moe.renormalize;
  p.scaling = cfg.moe.routed_scaling;
  return p;
}

// ---------------------------------------------------------------------------------------------
// Dense FFN

size_t dense_ffn_workspace_bytes(const ModelConfig& cfg, int64_t N, size_t elem_bytes) {
  return ffn_forward_workspace_bytes(N, cfg.dense_ffn, elem_bytes) + 4096;
}

size_t dense_ffn_saved_bytes(const ModelConfig& cfg, int64_t N, size_t elem_bytes) {
  ElementCounter c{elem_bytes};
  c.add_real(N * cfg.dense_ffn);  // gate
  c.add_real(N * cfg.dense_ffn);  // up
  return c.bytes;
}

size_t dense_ffn_backward_workspace_bytes(const ModelConfig& cfg, int64_t N, size_t elem_bytes) {
  return ffn_backward_workspace_bytes(N, cfg.dense_ffn, elem_bytes) + 4096;
}

template <typename Real>
void dense_ffn_forward(const ModelConfig& cfg, const FfnWeightsT<Real>& w, const Real* x, Real* y,
                       int64_t N, Arena& ws, std::type_identity_t<DenseFfnSaved<Real>>* saved,
                       Arena* saved_arena) {
  const int64_t F = cfg.dense_ffn;
  Real* saved_gate = nullptr;
  Real* saved_up = nullptr;
  if (saved) {
    DM_CHECK(saved_arena, "dense_ffn_forward: saving activations needs a saved arena");
    saved->N = N;
    saved->gate = saved_gate = saved_arena->alloc<Real>(size_t(N) * size_t(F));
    saved->up = saved_up = saved_arena->alloc<Real>(size_t(N) * size_t(F));
  }
  ffn_forward(x, w.gate, w.up, w.down, y, N, cfg.hidden, F, glu_activation(cfg), ws, saved_gate,
              saved_up);
}

template <typename Real>
void dense_ffn_backward(const ModelConfig& cfg, const FfnWeightsT<Real>& w, FfnWeightsT<Real>& grad,
                        const Real* x, const std::type_identity_t<DenseFfnSaved<Real>>* saved,
                        const Real* dy, std::type_identity_t<Real>* dx, int64_t N, Arena& ws) {
  if (saved)
    DM_CHECK(saved->N == N, "dense_ffn_backward: saved activations are for ", saved->N,
             " tokens, called with ", N);
  ffn_backward(x, w.gate, w.up, w.down, saved ? saved->gate : nullptr,
               saved ? saved->up : nullptr, dy, dx, grad.gate, grad.up, grad.down, N, cfg.hidden,
               cfg.dense_ffn, glu_activation(cfg), ws);
}

// ---------------------------------------------------------------------------------------------
// MoE layer

size_t moe_layer_workspace_bytes(const ModelConfig& cfg, int64_t N, size_t elem_bytes) {
  const MoeShape s = moe_shape(cfg);
  ElementCounter c{elem_bytes};
  c.add_real(N * s.E);         // scores (routing views, when not saved)
  c.add<int32_t>(N * s.k);     // idx
  c.add_real(N * s.k);         // weight
  c.add_real(N);               // cutoff
  c.add_real(N * s.E);         // logits
  c.bytes += moe_plan_bytes(N, int(s.k), int(s.E));
  c.add_real(N * s.latent);    // z
  c.add_real(N * s.latent);    // u
  c.add_real(N * s.latent);    // normed u (only when saving: u must survive)
  c.add_real(N * s.d);         // shared experts' output
  const ExpertWeights ew{nullptr, nullptr, nullptr, s.E, s.latent, s.F};
  return c.bytes +
         std::max(moe_experts_forward_workspace_bytes(N, int(s.k), ew, num_threads(), elem_bytes),
                  ffn_forward_workspace_bytes(N, s.shared_F, elem_bytes)) +
         8192;
}

size_t moe_layer_saved_bytes(const ModelConfig& cfg, int64_t N, size_t elem_bytes) {
  const MoeShape s = moe_shape(cfg);
  ElementCounter c{elem_bytes};
  c.add_real(N * s.E);      // scores
  c.add<int32_t>(N * s.k);  // idx
  c.add_real(N * s.k);      // weight
  c.add_real(N);            // cutoff
  if (s.has_latent) {
    c.add_real(N * s.latent);  // z
    c.add_real(N * s.latent);  // u
  }
  if (s.has_shared) {
    c.add_real(N * s.shared_F);  // shared gate
    c.add_real(N * s.shared_F);  // shared up
  }
  return c.bytes;
}

size_t moe_layer_backward_workspace_bytes(const ModelConfig& cfg, int64_t N, size_t elem_bytes) {
  const MoeShape s = moe_shape(cfg);
  ElementCounter c{elem_bytes};
  c.add_real(N * s.latent);  // normed u
  c.add_real(N * s.latent);  // d(normed u)
  c.add_real(N * s.latent);  // du
  c.bytes += moe_plan_bytes(N, int(s.k), int(s.E));
  c.add_real(N * s.k);       // dweights
  c.add_real(N * s.latent);  // dz
  c.add_real(N * s.E);       // dlogits
  const ExpertWeights ew{nullptr, nullptr, nullptr, s.E, s.latent, s.F};
  return c.bytes +
         std::max(moe_experts_backward_workspace_bytes(N, int(s.k), ew, num_threads(), elem_bytes),
                  ffn_backward_workspace_bytes(N, s.shared_F, elem_bytes)) +
         8192;
}

template <typename Real>
void moe_layer_forward(const ModelConfig& cfg, const MoeWeightsT<Real>& w, const Real* x, Real* y,
                       int64_t N, Arena& ws, std::type_identity_t<MoeRoutingT<Real>>* routing,
                       std::type_identity_t<MoeSaved<Real>>* saved, Arena* saved_arena) {
  const MoeShape s = moe_shape(cfg);
  const int64_t E = s.E, k = s.k, d = s.d, l = s.latent;
  DM_CHECK(!saved || saved_arena, "moe_layer_forward: saving activations needs a saved arena");
  // Routing decisions outlive the call: in the saved arena when training, else just below the
  // layer's scratch scope in ws (the caller releases them).
  Arena& routing_arena = saved ? *saved_arena : ws;
  MoeRoutingT<Real> r;
  r.scores = routing_arena.alloc<Real>(size_t(N * E));
  r.idx = routing_arena.alloc<int32_t>(size_t(N * k));
  r.weight = routing_arena.alloc<Real>(size_t(N * k));
  r.cutoff = routing_arena.alloc<Real>(size_t(N));
  if (routing) *routing = r;
  if (saved) {
    *saved = MoeSaved<Real>{};
    saved->N = N;
    saved->routing = r;
    if (s.has_latent) {
      saved->latent_in = saved_arena->alloc<Real>(size_t(N * l));
      saved->latent_out = saved_arena->alloc<Real>(size_t(N * l));
    }
    if (s.has_shared) {
      saved->shared_gate = saved_arena->alloc<Real>(size_t(N * s.shared_F));
      saved->shared_up = saved_arena->alloc<Real>(size_t(N * s.shared_F));
    }
  }
  ArenaScope scope(ws);

  // Router reads the full-width normed x; the bias only affects selection.
  Real* logits = ws.alloc<Real>(size_t(N * E));
  layer_linear(logits, x, w.router, N, d, E);
  moe_route(logits, w.router_bias, N, router_params(cfg), r.scores, r.idx, r.weight, r.cutoff);
  MoePlan plan;
  moe_plan_build(r.idx, N, int(k), int(E), &plan, ws);

  // Routed path in the latent space z = W↓ x (or x itself for plain MoE).
  const Real* z = x;
  if (s.has_latent) {
    Real* latent_in = saved ? saved->latent_in : ws.alloc<Real>(size_t(N * l));
    layer_linear(latent_in, x, w.latent_down, N, d, l);
    z = latent_in;
  }
  Real* u = y;  // plain MoE: the combined expert output is the layer output
  if (s.has_latent) u = saved ? saved->latent_out : ws.alloc<Real>(size_t(N * l));
  const ExpertWeightsT<Real> ew{w.expert_gate, w.expert_up, w.expert_down, E, l, s.F};
  moe_experts_forward(z, plan, r.weight, ew, glu_activation(cfg), u, ws);
  if (s.has_latent) {
    const Real* up_in = u;
    if (s.has_latent_norm) {
      // In place for inference; when saving, u (the norm's input) must survive for the backward.
      Real* normed = saved ? ws.alloc<Real>(size_t(N * l)) : u;
      rmsnorm_forward<Real>(u, w.latent_norm, normed, N, l, double(cfg.rms_eps));
      up_in = normed;
    }
    layer_linear(y, up_in, w.latent_up, N, l, d);
  }
  if (s.has_shared) {
    Real* shared_out = ws.alloc<Real>(size_t(N * d));
    ffn_forward(x, w.shared.gate, w.shared.up, w.shared.down, shared_out, N, d, s.shared_F,
                glu_activation(cfg), ws, saved ? saved->shared_gate : nullptr,
                saved ? saved->shared_up : nullptr);
    for (int64_t i = 0; i < N * d; ++i) y[i] += shared_out[i];
  }
}

template <typename Real>
void moe_layer_backward(const ModelConfig& cfg, const MoeWeightsT<Real>& w, MoeWeightsT<Real>& grad,
                        const Real* x, const MoeSaved<Real>& saved, const Real* dy,
                        std::type_identity_t<Real>* dx, int64_t N, Arena& ws) {
  const MoeShape s = moe_shape(cfg);
  const int64_t E = s.E, k = s.k, d = s.d, l = s.latent;
  DM_CHECK(saved.N == N, "moe_layer_backward: saved activations are for ", saved.N,
           " tokens, called with ", N);
  if (N == 0) return;
  ArenaScope scope(ws);
  const GluActivation act = glu_activation(cfg);
  const MoeRoutingT<Real>& r = saved.routing;

  // Shared experts: y += E_s(x) at full width.
  if (s.has_shared)
    ffn_backward(x, w.shared.gate, w.shared.up, w.shared.down, saved.shared_gate, saved.shared_up,
                 dy, dx, grad.shared.gate, grad.shared.up, grad.shared.down, N, d, s.shared_F, act,
                 ws);

  // du [N,ℓ]: gradient w.r.t. the combined routed output u.
  const Real* du = dy;  // plain MoE: y = u (+ shared)
  if (s.has_latent) {
    const Real* up_in = saved.latent_out;  // the latent up-projection's input [N,ℓ]
    if (s.has_latent_norm) {
      Real* normed = ws.alloc<Real>(size_t(N * l));
      rmsnorm_forward<Real>(saved.latent_out, w.latent_norm, normed, N, l, double(cfg.rms_eps));
      up_in = normed;
    }
    // y = up_in·W↑ᵀ: dW↑[d,ℓ] += dyᵀ[d,N]·up_in[N,ℓ]; d(up_in)[N,ℓ] = dy[N,d]·W↑[d,ℓ].
    gemm(true, false, d, l, N, Real(1), dy, d, up_in, l, Real(1), grad.latent_up, l);
    Real* dup_in = ws.alloc<Real>(size_t(N * l));
    gemm(false, false, N, l, d, Real(1), dy, d, w.latent_up, l, Real(0), dup_in, l);
    du = dup_in;
    if (s.has_latent_norm) {
      Real* du_before_norm = ws.alloc<Real>(size_t(N * l));
      std::fill(du_before_norm, du_before_norm + N * l, Real(0));
      rmsnorm_backward<Real>(saved.latent_out, w.latent_norm, dup_in, du_before_norm,
                             grad.latent_norm, N, l, double(cfg.rms_eps));
      du = du_before_norm;
    }
  }

  // Routed experts with the forward's routing; g/u recomputed per tile from z.
  MoePlan plan;
  moe_plan_build(r.idx, N, int(k), int(E), &plan, ws);
  Real* dweights = ws.alloc<Real>(size_t(N * k));
  std::fill(dweights, dweights + N * k, Real(0));
  const Real* z = s.has_latent ? saved.latent_in : x;
  Real* dz = dx;  // plain MoE routes x itself: its gradient accumulates straight into dx
  if (s.has_latent) {
    dz = ws.alloc<Real>(size_t(N * l));
    std::fill(dz, dz + N * l, Real(0));
  }
  const ExpertWeightsT<Real> ew{w.expert_gate, w.expert_up, w.expert_down, E, l, s.F};
  const ExpertGradsT<Real> expert_grads{grad.expert_gate, grad.expert_up, grad.expert_down};
  moe_experts_backward(z, plan, r.weight, ew, act, nullptr, nullptr, du, dz, dweights,
                       expert_grads, ws);

  // Latent down-projection z = x·W↓ᵀ: dW↓[ℓ,d] += dzᵀ[ℓ,N]·x[N,d]; dx[N,d] += dz[N,ℓ]·W↓[ℓ,d].
  if (s.has_latent) {
    gemm(true, false, l, d, N, Real(1), dz, l, x, d, Real(1), grad.latent_down, d);
    if (dx) gemm(false, false, N, d, l, Real(1), dz, l, w.latent_down, d, Real(1), dx, d);
  }

  // Router: the routing weights depend on the logits = x·W_rᵀ (selection held fixed).
  Real* dlogits = ws.alloc<Real>(size_t(N * E));
  std::fill(dlogits, dlogits + N * E, Real(0));
  moe_route_backward(r.scores, r.idx, dweights, N, router_params(cfg), dlogits);
  gemm(true, false, E, d, N, Real(1), dlogits, E, x, d, Real(1), grad.router, d);
  if (dx) gemm(false, false, N, d, E, Real(1), dlogits, E, w.router, d, Real(1), dx, d);
}

#define DM_MOE_LAYER_INSTANTIATE(Real)                                                          \
  template void dense_ffn_forward<Real>(const ModelConfig&, const FfnWeightsT<Real>&,          \
                                        const Real*, Real*, int64_t, Arena&,                    \
                                        DenseFfnSaved<Real>*, Arena*);                          \
  template void dense_ffn_backward<Real>(const ModelConfig&, const FfnWeightsT<Real>&,         \
                                         FfnWeightsT<Real>&, const Real*,                       \
                                         const DenseFfnSaved<Real>*, const Real*, Real*,        \
                                         int64_t, Arena&);                                      \
  template void moe_layer_forward<Real>(const ModelConfig&, const MoeWeightsT<Real>&,          \
                                        const Real*, Real*, int64_t, Arena&,                    \
                                        MoeRoutingT<Real>*, MoeSaved<Real>*, Arena*);           \
  template void moe_layer_backward<Real>(const ModelConfig&, const MoeWeightsT<Real>&,         \
                                         MoeWeightsT<Real>&, const Real*, const MoeSaved<Real>&, \
                                         const Real*, Real*, int64_t, Arena&);
DM_MOE_LAYER_INSTANTIATE(float)
DM_MOE_LAYER_INSTANTIATE(double)
#undef DM_MOE_LAYER_INSTANTIATE

}  // namespace dm
