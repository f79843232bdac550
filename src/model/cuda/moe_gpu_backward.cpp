// Backward of the Stable Latent MoE layer on the GPU (layers.h moe_layer_backward_gpu): the twin
// of model/moe.cpp moe_layer_backward (the dense FFN's backward is in ffn_gpu.cpp). The forward
// internals are RECOMPUTED from xn with the forward's ops (moe_gpu.cpp), so identical inputs and
// bias give identical routing:
//
//   logits [N,E] fp32 = xn·W_rᵀ;  moe_route → scores, idx, w;  dispatch plan (one sync)
//   latent:  z [N,ℓ] bf16 = xn·W↓ᵀ;  out_r = E_j(z_t) per sorted row;  u [N,ℓ] fp32 = Σ w·out
//            up_in [N,ℓ] bf16 = bf16(RMSNorm(u)) (or bf16(u) without the norm)
//   plain:   the experts read xn and u is the output itself
//
// then back-propagates dy [N,d] (fp32; rounded to bf16 once for the GEMMs that take it):
//   dxn = 0 (plain only: with a latent the down-projection's GEMM writes it first)
//   latent:  dW↑ [d,ℓ] += dyᵀ·up_in;  d(up_in) [N,ℓ] fp32 = dy·W↑;  RMSNorm backward (fp32,
//            deterministic dw) → du [N,ℓ] fp32  (plain: du = dy)
//   experts: dp [N,k] = <du_t, out_r>;  down / GLU / gate-up backward per expert (grads fp32,
//            beta = 1);  dz [N,ℓ] fp32 = Σ_slots dz_r  (plain: accumulated into dxn)
//   latent:  dW↓ [ℓ,d] += bf16(dz)ᵀ·xn;  dxn = bf16(dz)·W↓
//   router:  dlogits [N,E] fp32 (selection fixed);  dW_r [E,d] += bf16(dlogits)ᵀ·xn;
//            dxn += bf16(dlogits)·W_r
//   shared:  the gated FFN backward at full width, dxn += its input gradient
//   (latent + shared with the weights in a row: the last three input gradients as one product,
//   one_dx_product below)
// The routing bias gets nothing (QB sets it). With `kept` (training without recompute) the
// routing, plan, z, u and the experts' intermediates come from the forward instead: no router,
// latent-down or expert forward GEMM and no stream synchronisation here.
//
// Scratch (run.scratch, one scope; a sub-scope per phase, so the byte count is the base plus the
// largest phase):
//   base:    dy bf16 [N,d] (when a GEMM takes it), scores [N,E], idx [N,k], w [N,k], dp [N,k],
//            plan; latent: z bf16 [N,ℓ], dz fp32 [N,ℓ]
//   phases:  routing: logits [N,E]
//            experts: expert workspace; latent: u, du fp32 [N,ℓ] + {norm: normed fp32 [N,ℓ],
//                     RMSNorm workspace, d(up_in) fp32 [N,ℓ]; up_in bf16 [N,ℓ]}
//            latent down: bf16(dz) [N,ℓ];  router: dlogits fp32 + bf16 [N,E];
//            shared: the gated FFN workspace
#include <algorithm>
#include <tuple>
#include <vector>

#include "core/env.h"
#include "core/error.h"
#include "model/cuda/layers.h"
#include "model/cuda/moe_gpu_internal.h"
#include "model/moe.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/moe_backward.h"
#include "ops/cuda/moe_layer_ops.h"

namespace dm::cuda {
namespace {
using moe_gpu::aligned;
using moe_gpu::n_bytes;
using moe_gpu::expert_weights;

// Host copy of the plan's E+1 offsets: grows only, so steady-state calls do not allocate.
int64_t* host_offsets_buffer(int64_t E) {
  thread_local std::vector<int64_t> buffer;
  if (buffer.size() < size_t(E) + 1) buffer.resize(size_t(E) + 1);
  return buffer.data();
}

size_t base_bytes(const MoeShape& s, int64_t N) {
  size_t b = 0;
  if (s.has_latent || s.has_shared) b += n_bytes(N * s.d, 2);  // dy bf16
  b += n_bytes(N * s.E, 4) + n_bytes(N * s.k, 4) + n_bytes(N * s.k, 4) + n_bytes(N * s.k, 4);
  b += moe_dispatch_plan_bytes(N, int(s.k), int(s.E));
  if (s.has_latent) b += n_bytes(N * s.latent, 2) + n_bytes(N * s.latent, 4);  // z, dz
  return b;
}

size_t experts_phase_bytes(const MoeShape& s, int64_t N) {
  size_t b = aligned(moe_experts_backward_workspace_bytes(N, int(s.k),
                                                          expert_weights(nullptr, nullptr, s)));
  if (s.has_latent) {
    b += 2 * n_bytes(N * s.latent, 4);  // u, du
    if (s.has_latent_norm)
      b += n_bytes(N * s.latent, 4) + aligned(rmsnorm_backward_workspace_bytes(N, s.latent)) +
           n_bytes(N * s.latent, 4);  // normed, RMSNorm workspace, d(up_in)
    b += n_bytes(N * s.latent, 2);    // up_in
  }
  return b;
}

size_t phase_peak_bytes(const MoeShape& s, int64_t N) {
  size_t peak = std::max(n_bytes(N * s.E, 4), experts_phase_bytes(s, N));  // logits | experts
  if (s.has_latent) {
    peak = std::max(peak, n_bytes(N * s.latent, 2));
    // The fused down-projection + router phase: [dz | dlogits] bf16, [W↓; W_r], dlogits fp32.
    const int64_t K = s.latent + s.E;
    peak = std::max(peak, n_bytes(N * K, 2) + n_bytes(K * s.d, 2) + n_bytes(N * s.E, 4));
  }
  peak = std::max(peak, n_bytes(N * s.E, 4) + n_bytes(N * s.E, 2));
  if (s.has_shared) peak = std::max(peak, aligned(glu_ffn_backward_workspace_bytes(N, s.shared_F)));
  if (s.has_latent && s.has_shared) {
    // one_dx_product: [dg | du | dz | dlogits] bf16, dlogits fp32, the gated FFN workspace.
    peak = std::max(peak, n_bytes(N * (2 * s.shared_F + s.latent + s.E), 2) + n_bytes(N * s.E, 4) +
                              aligned(glu_ffn_backward_workspace_bytes(N, s.shared_F)));
  }
  return peak;
}

// The layer's input gradient as ONE product over the stacked rows [W_sg; W_su; W↓; W_r]
// (weights.cpp adds the shared experts' gate and up, the latent down-projection and the router
// in a row): dxn = [dg | du | dz | dlogits]·[W_sg; W_su; W↓; W_r], K = 2·Fs + ℓ + E (2592 at
// gpu_1b), writing the fp32 dxn once where the down+router product wrote it and the shared
// experts' K = 2·Fs product read and wrote it again. DM_MOE_ONE_DX_PRODUCT=0 (or the
// two-product path's DM_MOE_FUSED_GRAD_GEMMS=0): the products apart (the A/B reference).
bool one_dx_product(const MoeShape& s, const DeviceWeights& dw, const MoeWeights& w) {
  if (!s.has_latent || !s.has_shared || !env_flag("DM_MOE_FUSED_GRAD_GEMMS", true) ||
      !env_flag("DM_MOE_ONE_DX_PRODUCT", true))
    return false;
  const uint16_t* gate = dw.bf16(w.shared.gate);
  const int64_t Fs = s.shared_F, d = s.d;
  return glu_gate_up_adjacent(gate, dw.bf16(w.shared.up), Fs, d) &&
         dw.bf16(w.latent_down) == gate + 2 * Fs * d &&
         dw.bf16(w.router) == gate + (2 * Fs + s.latent) * d;
}

// bf16 copy of dy [N, d] for the GEMMs (rounded once).
uint16_t* dy_to_bf16(GpuRun& run, const float* dy, int64_t N, int64_t d) {
  uint16_t* dy_b = run.scratch.alloc<uint16_t>(size_t(N * d));
  convert_f32_to_bf16(dy, dy_b, N * d, run.stream);
  return dy_b;
}

}  // namespace

// ---- MoE layer ------------------------------------------------------------------------------

size_t moe_layer_backward_gpu_bytes(const ModelConfig& c, int64_t N) {
  const MoeShape s = moe_shape(c);
  // +256: the caller's arena mark may sit mid-way through a 256-byte block.
  return base_bytes(s, N) + phase_peak_bytes(s, N) + 256;
}

void moe_layer_backward_gpu(GpuRun& run, const DeviceWeights& dw, const DeviceGrads& grads,
                            const MoeWeights& w, const uint16_t* xn, const float* dy, float* dxn,
                            int64_t N, const MoeKept* kept) {
  const ModelConfig& cfg = dw.config();
  const MoeShape s = moe_shape(cfg);
  const int64_t E = s.E, k = s.k, d = s.d, l = s.latent;
  DM_CHECK(N >= 0, "moe_layer_backward_gpu: negative token count ", N);
  DM_CHECK(w.router && w.expert_gate && w.expert_up && w.expert_down,
           "moe_layer_backward_gpu: MoE weights missing (not an MoE layer?)");
  DM_CHECK(!s.has_latent || (w.latent_down && w.latent_up), "moe_layer_backward_gpu: latent "
           "projections missing");
  DM_CHECK(!s.has_latent_norm || w.latent_norm, "moe_layer_backward_gpu: latent norm missing");
  DM_CHECK(!s.has_shared || (w.shared.gate && w.shared.up && w.shared.down),
           "moe_layer_backward_gpu: shared experts missing");
  if (N == 0) return;
  DM_CHECK(xn && dy && dxn, "moe_layer_backward_gpu: null argument");
  DM_CHECK(!kept || kept->N == N, "moe_layer_backward_gpu: kept internals are for ",
           kept ? kept->N : 0, " rows, not ", N);
  CUstream_st* stream = run.stream;
  DeviceArena& arena = run.scratch;
  const GluActivation act = glu_activation(cfg);
  DeviceArenaScope scope(arena);

  // Every contribution below accumulates into dxn (the routed experts of plain MoE through a
  // kernel, the rest through beta = 1 GEMMs) but the first: with a latent, the down-projection's
  // GEMM writes it (beta = 0), so dxn needs no zeroing pass there.
  if (!s.has_latent) fill_zero_async(dxn, size_t(N * d) * sizeof(float), stream);
  const uint16_t* dy_b = (s.has_latent || s.has_shared) ? dy_to_bf16(run, dy, N, d) : nullptr;

  // ---- The routing: kept by the forward, or recomputed exactly as the forward did it (same
  // ops, same inputs).
  const float* scores = kept ? kept->scores : nullptr;
  const int32_t* idx = kept ? kept->idx : nullptr;
  const float* weight = kept ? kept->weight : nullptr;
  float* dweight = arena.alloc<float>(size_t(N * k));
  MoeDispatchPlan recomputed_plan;
  if (!kept) {
    float* scores_new = arena.alloc<float>(size_t(N * E));
    int32_t* idx_new = arena.alloc<int32_t>(size_t(N * k));
    float* weight_new = arena.alloc<float>(size_t(N * k));
    {
      DeviceArenaScope routing_scope(arena);
      float* logits = arena.alloc<float>(size_t(N * E));
      linear(run, xn, dw.bf16(w.router), N, d, E, logits, GemmOutType::F32);
      const float* bias = w.router_bias ? dw.f32(w.router_bias) : nullptr;
      moe_route(logits, bias, N, router_params(cfg), scores_new, idx_new, weight_new, nullptr,
                stream);
    }
    // The cuBLAS expert paths synchronise the stream here: the per-expert row counts go to
    // the host. GroupedOwn reads them on the device.
    const bool host_plan = moe_gemm_default_path() != MoeGemmPath::GroupedOwn;
    moe_dispatch_plan_build(idx_new, N, int(k), int(E), &recomputed_plan, arena,
                            host_plan ? host_offsets_buffer(E) : nullptr, stream);
    scores = scores_new;
    idx = idx_new;
    weight = weight_new;
  }
  const MoeDispatchPlan& plan = kept ? kept->plan : recomputed_plan;

  const uint16_t* z = xn;  // the experts' input: z = xn·W↓ᵀ [N,ℓ] (latent) or xn (plain)
  float* dz = nullptr;     // ∂L/∂z [N,ℓ] fp32 (latent only; plain accumulates into dxn)
  if (s.has_latent) {
    if (kept) {
      z = kept->z;
    } else {
      uint16_t* latent_in = arena.alloc<uint16_t>(size_t(N * l));
      linear(run, xn, dw.bf16(w.latent_down), N, d, l, latent_in, GemmOutType::Bf16);
      z = latent_in;
    }
    dz = arena.alloc<float>(size_t(N * l));
  }

  // ---- Routed experts (and the latent up-projection / norm, which need their output u).
  {
    DeviceArenaScope experts_scope(arena);
    const ExpertWeightsBf16 ew = expert_weights(&dw, &w, s);
    void* workspace = kept ? kept->workspace
                           : arena.alloc_bytes(moe_experts_backward_workspace_bytes(N, int(k), ew));
    const float* du = dy;  // ∂L/∂u [N,ℓ] fp32; plain MoE: y = u (+ shared), so du = dy
    float* u = nullptr;
    float* du_latent = nullptr;
    if (s.has_latent) {
      u = kept ? kept->u : arena.alloc<float>(size_t(N * l));
      du_latent = arena.alloc<float>(size_t(N * l));
      du = du_latent;
    }
    if (!kept)
      moe_experts_recompute(run.gemm, z, plan, weight, ew, act, u, workspace,
                            moe_gemm_default_path(), stream);
    if (s.has_latent) {
      DeviceArenaScope latent_scope(arena);
      // y = up_in·W↑ᵀ with up_in = bf16(RMSNorm(u)) or bf16(u), the forward's rounding.
      uint16_t* up_in = arena.alloc<uint16_t>(size_t(N * l));
      float* normed = nullptr;
      float* d_up_in = du_latent;  // without the norm, ∂L/∂up_in is ∂L/∂u
      void* norm_workspace = nullptr;
      if (s.has_latent_norm) {
        normed = arena.alloc<float>(size_t(N * l));
        norm_workspace = arena.alloc_bytes(rmsnorm_backward_workspace_bytes(N, l));
        d_up_in = arena.alloc<float>(size_t(N * l));
        rmsnorm_forward(u, dw.f32(w.latent_norm), normed, N, l, double(cfg.rms_eps), stream);
        convert_f32_to_bf16(normed, up_in, N * l, stream);
      } else {
        convert_f32_to_bf16(u, up_in, N * l, stream);
      }
      // dW↑ [d,ℓ] += dyᵀ·up_in;  d(up_in) [N,ℓ] fp32 = dy·W↑.
      linear_backward(run, up_in, dw.bf16(w.latent_up), dy_b, N, l, d, d_up_in, GemmOutType::F32,
                      0.0f, grads, w.latent_up);
      if (s.has_latent_norm) {
        // du stored; dw (the norm weight) is summed in a fixed order into its gradient slot.
        rmsnorm_backward(u, dw.f32(w.latent_norm), d_up_in, du_latent, grads.at(w.latent_norm), N,
                         l, double(cfg.rms_eps), norm_workspace, stream,
                         /*accumulate_dx=*/false);
      }
    }
    ExpertGradsF32 expert_grads;
    expert_grads.gate = grads.at(w.expert_gate);
    expert_grads.up = grads.at(w.expert_up);
    expert_grads.down = grads.at(w.expert_down);
    // Store-first ranges (DeviceParamArena): pending after zero_deferred, so the products store.
    const bool gate_pending = grads.take_pending(w.expert_gate);
    const bool up_pending = grads.take_pending(w.expert_up);
    const bool down_pending = grads.take_pending(w.expert_down);
    DM_CHECK(gate_pending == up_pending && up_pending == down_pending,
             "moe_layer_backward_gpu: expert gradients pending unevenly");
    expert_grads.store = gate_pending;
    // Latent: dz is written; plain: the experts' input is xn, so dz accumulates into dxn.
    moe_experts_backward(run.gemm, plan, weight, ew, act, du, dweight, s.has_latent ? dz : dxn,
                         /*dx_accumulate=*/!s.has_latent, expert_grads, workspace, stream,
                         moe_gemm_default_path());
  }

  if (one_dx_product(s, dw, w)) {
    // ---- Shared experts, latent down-projection and router: one input-gradient product
    // (one_dx_product); their weight gradients as in the paths below.
    DeviceArenaScope joint_scope(arena);
    const int64_t Fs = s.shared_F, J = 2 * Fs + l + E;
    uint16_t* joint = arena.alloc<uint16_t>(size_t(N * J));  // [dg | du | dz | dlogits] bf16
    float* dlogits = arena.alloc<float>(size_t(N * E));
    convert_f32_to_bf16_rows(dz, joint + 2 * Fs, N, l, J, stream);
    moe_route_backward(scores, idx, dweight, N, router_params(cfg), dlogits, stream);
    convert_f32_to_bf16_rows(dlogits, joint + 2 * Fs + l, N, E, J, stream);
    weight_gradient(run, grads, w.latent_down, joint + 2 * Fs, J, xn, N, d, l);
    weight_gradient(run, grads, w.router, joint + 2 * Fs + l, J, xn, N, d, E);
    void* workspace = arena.alloc_bytes(glu_ffn_backward_workspace_bytes(N, Fs));
    glu_ffn_backward(run.gemm, xn, dw.bf16(w.shared.gate), dw.bf16(w.shared.up),
                     dw.bf16(w.shared.down), dy_b, /*dx=*/nullptr, 0.0f, grads.at(w.shared.gate),
                     grads.at(w.shared.up), grads.at(w.shared.down), N, d, Fs, act, workspace,
                     stream, kept ? kept->shared_gate_up : nullptr, joint, J);
    run.gemm.gemm_bf16(false, false, N, d, J, 1.0f, joint, J, dw.bf16(w.shared.gate), d, 0.0f, dxn,
                       GemmOutType::F32, d, stream);
    return;
  }

  // ---- Latent down-projection z = xn·W↓ᵀ and the router (the routing weights depend on
  // logits = xn·W_rᵀ, selection held fixed) in one product: dxn = [dz | dlogits]·[W↓; W_r] over
  // K = ℓ + E (the first write), the two operands side by side in one bf16 [N, ℓ + E] buffer and
  // the two weights copied into one [ℓ + E, d] operand (a K = E product alone is all traffic on
  // the fp32 dxn); dW↓ [ℓ,d] += dzᵀ·xn, dW_r [E,d] += dlogitsᵀ·xn. DM_MOE_FUSED_GRAD_GEMMS=0
  // keeps one product each (read at each call). The logit gradient is fp32; its GEMMs take it
  // rounded to bf16.
  if (s.has_latent && env_flag("DM_MOE_FUSED_GRAD_GEMMS", true)) {
    DeviceArenaScope down_scope(arena);
    const int64_t K = l + E;
    uint16_t* dzr = arena.alloc<uint16_t>(size_t(N * K));   // [dz | dlogits] bf16
    uint16_t* w_zr = arena.alloc<uint16_t>(size_t(K * d));  // [W↓; W_r]
    float* dlogits = arena.alloc<float>(size_t(N * E));
    convert_f32_to_bf16_rows(dz, dzr, N, l, K, stream);
    moe_route_backward(scores, idx, dweight, N, router_params(cfg), dlogits, stream);
    convert_f32_to_bf16_rows(dlogits, dzr + l, N, E, K, stream);
    copy_device_to_device_async(w_zr, dw.bf16(w.latent_down), size_t(l * d) * 2, stream);
    copy_device_to_device_async(w_zr + l * d, dw.bf16(w.router), size_t(E * d) * 2, stream);
    run.gemm.gemm_bf16(false, false, N, d, K, 1.0f, dzr, K, w_zr, d, 0.0f, dxn, GemmOutType::F32, d,
                       stream);
    for (const auto& [W, rows, A] :
         {std::tuple{w.latent_down, l, dzr}, std::tuple{w.router, E, dzr + l}})
      weight_gradient(run, grads, W, A, K, xn, N, d, rows);
  } else {
    // ---- Latent down-projection z = xn·W↓ᵀ: dW↓ [ℓ,d] += dzᵀ·xn; dxn = dz·W↓ (the first write).
    if (s.has_latent) {
      DeviceArenaScope down_scope(arena);
      uint16_t* dz_b = arena.alloc<uint16_t>(size_t(N * l));
      convert_f32_to_bf16(dz, dz_b, N * l, stream);
      linear_backward(run, xn, dw.bf16(w.latent_down), dz_b, N, d, l, dxn, GemmOutType::F32, 0.0f,
                      grads, w.latent_down);
    }

    // ---- Router.
    {
      DeviceArenaScope router_scope(arena);
      float* dlogits = arena.alloc<float>(size_t(N * E));
      uint16_t* dlogits_b = arena.alloc<uint16_t>(size_t(N * E));
      moe_route_backward(scores, idx, dweight, N, router_params(cfg), dlogits, stream);
      convert_f32_to_bf16(dlogits, dlogits_b, N * E, stream);
      linear_backward(run, xn, dw.bf16(w.router), dlogits_b, N, d, E, dxn, GemmOutType::F32, 1.0f,
                      grads, w.router);
    }
  }

  // ---- Shared experts at full width (the gated FFN backward), dxn += their input gradient.
  if (s.has_shared) {
    DeviceArenaScope shared_scope(arena);
    void* workspace = arena.alloc_bytes(glu_ffn_backward_workspace_bytes(N, s.shared_F));
    glu_ffn_backward(run.gemm, xn, dw.bf16(w.shared.gate), dw.bf16(w.shared.up),
                     dw.bf16(w.shared.down), dy_b, dxn, 1.0f, grads.at(w.shared.gate),
                     grads.at(w.shared.up), grads.at(w.shared.down), N, d, s.shared_F, act,
                     workspace, stream, kept ? kept->shared_gate_up : nullptr);
  }
}

}  // namespace dm::cuda
