// The MoE layer forward of the fp32 GPU mode (layers.h): model/moe.cpp moe_layer_forward op for
// op with every activation and weight in fp32, the reference twin of moe_gpu.cpp's bf16 layer:
//
//   logits [N,E] = xn·W_rᵀ;  moe_route (σ, biased top-k, renormalised weights, cutoff)
//   dispatch plan with host offsets (one stream synchronisation: the fp32 experts launch one
//   cuBLAS GEMM per non-empty expert)
//   latent:  z [N,ℓ] = xn·W↓ᵀ;  u [N,ℓ] = Σ_j w_j·E_j(z);  RMSNorm(u) in place;  y = u·W↑ᵀ
//   plain:   y [N,d] = Σ_j w_j·E_j(xn)
//   shared:  y += act(xn·W_gᵀ, xn·W_uᵀ)·W_dᵀ
//
// Scratch (run.scratch): [routing: scores, cutoff, idx] | scope: logits, weight, plan, z, u,
// then the experts' workspace, released before the shared experts' gate and up [N, Fs].
#include <algorithm>
#include <vector>

#include "core/error.h"
#include "model/cuda/layers.h"
#include "model/cuda/moe_gpu_internal.h"
#include "model/moe.h"
#include "ops/cpu/ffn.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/moe.h"

namespace dm::cuda {
namespace moe_gpu {

size_t forward_f32_bytes(const MoeShape& s, int64_t N) {
  size_t b = n_bytes(N * s.E, 4) + n_bytes(N * s.k, 4) +  // logits, weight
             aligned(moe_dispatch_plan_bytes(N, int(s.k), int(s.E)));
  if (s.has_latent) b += 2 * n_bytes(N * s.latent, 4);  // z, u
  const size_t experts = aligned(
      moe_experts_forward_workspace_bytes(N, int(s.k), expert_weights<float>(nullptr, nullptr, s)));
  const size_t shared = s.has_shared ? 2 * n_bytes(N * s.shared_F, 4) : 0;
  return b + std::max(experts, shared);
}

}  // namespace moe_gpu

void moe_layer_forward_gpu(GpuRun& run, const DeviceWeights& dw, const MoeWeights& w,
                           const float* xn, float* y, int64_t N, MoeRoutingDevice* routing) {
  const ModelConfig& cfg = dw.config();
  const MoeShape s = moe_shape(cfg);
  const int64_t E = s.E, k = s.k, d = s.d, l = s.latent;
  DM_CHECK(N >= 0, "moe_layer_forward_gpu (fp32): negative token count ", N);
  DM_CHECK(w.router && w.expert_gate && w.expert_up && w.expert_down,
           "moe_layer_forward_gpu (fp32): MoE weights missing (not an MoE layer?)");
  DM_CHECK(!s.has_latent || (w.latent_down && w.latent_up),
           "moe_layer_forward_gpu (fp32): latent projections missing");
  DM_CHECK(!s.has_latent_norm || w.latent_norm,
           "moe_layer_forward_gpu (fp32): latent norm missing");
  DM_CHECK(!s.has_shared || (w.shared.gate && w.shared.up && w.shared.down),
           "moe_layer_forward_gpu (fp32): shared experts missing");
  CUstream_st* stream = run.stream;
  DeviceArena& arena = run.scratch;

  // Routing outputs the caller keeps: carved below the scope so they survive the call.
  MoeRoutingDevice r;
  if (routing) {
    r = moe_gpu::carve_routing(arena, N, E, k);
    *routing = r;
  }
  if (N == 0) return;
  DeviceArenaScope scope(arena);
  if (!routing) {
    r.scores = arena.alloc<float>(size_t(N * E));
    r.idx = arena.alloc<int32_t>(size_t(N * k));
  }
  float* logits = arena.alloc<float>(size_t(N * E));
  float* weight = arena.alloc<float>(size_t(N * k));
  linear(run, xn, dw.f32(w.router), N, d, E, logits, GemmOutType::F32);
  const float* bias = w.router_bias ? dw.f32(w.router_bias) : nullptr;
  moe_route(logits, bias, N, router_params(cfg), r.scores, r.idx, weight, r.cutoff, stream);
  std::vector<int64_t> host_offsets(size_t(E) + 1);
  MoeDispatchPlan plan;
  moe_dispatch_plan_build(r.idx, N, int(k), int(E), &plan, arena, host_offsets.data(), stream);

  const float* z = xn;
  float* u = y;
  if (s.has_latent) {
    float* latent_in = arena.alloc<float>(size_t(N * l));
    linear(run, xn, dw.f32(w.latent_down), N, d, l, latent_in, GemmOutType::F32);
    z = latent_in;
    u = arena.alloc<float>(size_t(N * l));
  }
  {
    DeviceArenaScope experts_scope(arena);
    const ExpertWeightsF32 ew = moe_gpu::expert_weights<float>(&dw, &w, s);
    void* workspace = arena.alloc_bytes(moe_experts_forward_workspace_bytes(N, int(k), ew));
    moe_experts_forward(run.gemm, z, plan, weight, ew, glu_activation(cfg), u, workspace, stream);
  }
  if (s.has_latent) {
    if (s.has_latent_norm)
      rmsnorm_forward(u, dw.f32(w.latent_norm), u, N, l, double(cfg.rms_eps), stream);
    linear(run, u, dw.f32(w.latent_up), N, l, d, y, GemmOutType::F32);
  }
  if (s.has_shared) {
    const int64_t Fs = s.shared_F;
    float* gate = arena.alloc<float>(size_t(N * Fs));
    float* up = arena.alloc<float>(size_t(N * Fs));
    linear(run, xn, dw.f32(w.shared.gate), N, d, Fs, gate, GemmOutType::F32);
    linear(run, xn, dw.f32(w.shared.up), N, d, Fs, up, GemmOutType::F32);
    glu_forward(gate, up, gate, N * Fs, glu_activation(cfg), stream);
    linear(run, gate, dw.f32(w.shared.down), N, Fs, d, y, GemmOutType::F32, 1.0f);
  }
}

}  // namespace dm::cuda
