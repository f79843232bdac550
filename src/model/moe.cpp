#include "model/moe.h"

#include <algorithm>

#include "core/gemm.h"
#include "ops/cpu/norm.h"

namespace dm {

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

size_t dense_ffn_workspace_bytes(const ModelConfig& cfg, int64_t N) {
  return ffn_forward_workspace_bytes(N, cfg.dense_ffn) + 4096;
}

void dense_ffn_forward(const ModelConfig& cfg, const FfnWeights& w, const float* x, float* y,
                       int64_t N, Arena& ws) {
  ffn_forward(x, w.gate, w.up, w.down, y, N, cfg.hidden, cfg.dense_ffn, glu_activation(cfg), ws);
}

size_t moe_layer_workspace_bytes(const ModelConfig& cfg, int64_t N) {
  const MoeConfig& m = cfg.moe;
  const int64_t E = m.num_experts, k = m.top_k, d = cfg.hidden;
  const int64_t l = m.latent_dim ? m.latent_dim : d, F = m.expert_ffn;
  SizeCounter c;
  c.add<float>(N * E * 2);                 // logits, scores
  c.add<int32_t>(N * k);
  c.add<float>(N * k);
  c.add<float>(N);
  c.add<int64_t>(E + 1);                   // plan
  c.add<int32_t>(N * k * 2);
  c.add<float>(N * l * 2);                 // z, u
  c.add<float>(N * d);                     // shared expert output
  const ExpertWeights ew{nullptr, nullptr, nullptr, E, l, F};
  const int64_t Fs = int64_t(m.num_shared) * m.shared_ffn;
  return c.bytes + std::max(moe_experts_forward_workspace_bytes(N, int(k), ew, num_threads()),
                            ffn_forward_workspace_bytes(N, Fs)) + 8192;
}

void moe_layer_forward(const ModelConfig& cfg, const MoeWeights& w, const float* x, float* y,
                       int64_t N, Arena& ws, MoeRouting* routing) {
  const MoeConfig& m = cfg.moe;
  const int64_t E = m.num_experts, k = m.top_k, d = cfg.hidden;
  const int64_t l = m.latent_dim ? m.latent_dim : d;
  MoeRouting r;
  r.scores = ws.alloc<float>(N * E);
  r.idx = ws.alloc<int32_t>(N * k);
  r.weight = ws.alloc<float>(N * k);
  r.cutoff = ws.alloc<float>(N);
  if (routing) *routing = r;
  ArenaScope scope(ws);

  // Router reads the full-width normed x, in fp32; the bias only affects selection.
  float* logits = ws.alloc<float>(N * E);
  linear(logits, x, w.router, N, d, E);
  moe_route(logits, w.router_bias, N, router_params(cfg), r.scores, r.idx, r.weight, r.cutoff);
  MoePlan plan;
  moe_plan_build(r.idx, N, int(k), int(E), &plan, ws);

  // Routed path in the latent space z = W↓ x (or x itself for plain MoE).
  const float* z = x;
  if (m.latent_dim > 0) {
    float* zl = ws.alloc<float>(N * l);
    linear(zl, x, w.latent_down, N, d, l);
    z = zl;
  }
  float* u = m.latent_dim > 0 ? ws.alloc<float>(N * l) : y;
  const ExpertWeights ew{w.expert_gate, w.expert_up, w.expert_down, E, l, m.expert_ffn};
  moe_experts_forward(z, plan, r.weight, ew, glu_activation(cfg), u, ws);
  if (m.latent_dim > 0) {
    if (m.latent_norm) rmsnorm_forward(u, w.latent_norm, u, N, l, cfg.rms_eps);
    linear(y, u, w.latent_up, N, l, d);
  }
  if (m.num_shared > 0) {
    float* s = ws.alloc<float>(N * d);
    ffn_forward(x, w.shared.gate, w.shared.up, w.shared.down, s, N, d,
                int64_t(m.num_shared) * m.shared_ffn, glu_activation(cfg), ws);
    add_inplace(y, s, N * d);
  }
}

}  // namespace dm
