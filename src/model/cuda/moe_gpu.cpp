// Stable Latent MoE layer forward on the GPU (layers.h moe_layer_forward_gpu): the twin of
// model/moe.cpp moe_layer_forward, op for op:
//
//   logits [N,E] fp32 = xn·W_rᵀ                       (bf16 operands, fp32 out: router in fp32)
//   moe_route: s = σ(logits), idx = top_k(s + b), w = renorm(s_idx)·scaling, cutoff
//   dispatch plan (one stream synchronisation: per-expert row counts to the host) — only on the
//   Grouped path; the Gathered path (ops/cuda/moe_decode.h) reads idx and w on the device
//   latent:  z [N,ℓ] bf16 = xn·W↓ᵀ;  u [N,ℓ] = Σ_j w_j·E_j(z);  RMSNorm(u) (fp32, latent_norm);
//            y [N,d] fp32 = bf16(u)·W↑ᵀ
//   plain:   y [N,d] fp32 = Σ_j w_j·E_j(xn)
//   shared:  y += (act(xn·W_gᵀ, xn·W_uᵀ))·W_dᵀ   (fused shared experts, width
//   num_shared·shared_ffn;
//            the down GEMM accumulates into y with beta = 1, the CPU's y += shared_out)
//   latent + shared (one_output_product): y = [bf16(u') | h]·[W↑ | W_d]ᵀ (+ residual), one
//            product over K = ℓ + Fs writing the fp32 y once instead of twice
//
// Scratch layout inside run.scratch (the routing outputs the caller asked for sit below the
// layer's scope so they outlive it):
//   [routing: scores, cutoff, idx] | scope: logits, weight, plan (Grouped), z, u |
//       then either the experts' workspace (Grouped or Gathered), or (after it is released)
//       bf16(u) and the shared experts' gate/up buffers.
// With `kept` (training without recompute) the weights, plan, z, u and the experts' workspace
// are carved from the kept memory instead, and the experts run moe_experts_recompute (the same
// GEMMs, keeping g, u, h and the outputs); the latent norm then writes a scratch copy.
#include <algorithm>
#include <vector>

#include "core/env.h"
#include "core/error.h"
#include "model/cuda/layers.h"
#include "model/cuda/moe_gpu_internal.h"
#include "model/moe.h"
#include "ops/cpu/ffn.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/moe_backward.h"
#include "ops/cuda/moe_decode.h"
#include "ops/cuda/moe_layer_ops.h"
#include "ops/cuda/residual_ops.h"

namespace dm::cuda {
namespace {
using moe_gpu::aligned;
using moe_gpu::n_bytes;
using moe_gpu::expert_weights;

// Bytes of the routing outputs (scores [N,E] fp32, cutoff [N] fp32, idx [N,k] int32).
size_t routing_bytes(const MoeShape& s, int64_t N) {
  return n_bytes(N * s.E, 4) + n_bytes(N, 4) + n_bytes(N * s.k, 4);
}

// Decode-sized layers (N ≤ kGemvMaxRows, nothing kept) run the router and the shared experts'
// gate and up projections of x as one GEMV launch; their outputs then live across the scope.
bool fused_input_projections(const MoeShape& s, int64_t N, bool kept) {
  return !kept && s.has_shared && N >= 1 && N <= kGemvMaxRows;
}

// Bytes live across the whole layer scope: logits, routing weights, plan, z, u (and the shared
// experts' gate and up when fused_input_projections).
size_t scope_base_bytes(const MoeShape& s, int64_t N) {
  size_t b = n_bytes(N * s.E, 4) + n_bytes(N * s.k, 4) +
             moe_dispatch_plan_bytes(N, int(s.k), int(s.E));
  if (fused_input_projections(s, N, false)) b += 2 * n_bytes(N * s.shared_F, 2);
  if (s.has_latent) {
    b += n_bytes(N * s.latent, 2);                             // z bf16
    b += n_bytes(N * s.latent, s.has_latent_norm ? 4 : 2);     // u: fp32 for the norm, else bf16
  }
  return b;
}

// Peak of what follows the scope base: the experts' workspace (the larger of the two paths),
// then (released) bf16(u) plus the shared experts' [N, Fs] bf16 views: g | u as one [N, 2·Fs]
// matrix (unless the kept memory holds it) and h, or gate and up with h written over gate.
size_t scope_peak_bytes(const MoeShape& s, int64_t N) {
  const ExpertWeightsBf16 ew = expert_weights(nullptr, nullptr, s);
  const size_t experts = aligned(std::max(moe_experts_forward_workspace_bytes(N, int(s.k), ew),
                                          moe_decode_workspace_bytes(N, int(s.k), ew, true)));
  size_t after = 0;
  if (s.has_latent_norm) after += n_bytes(N * s.latent, 2);
  if (s.has_shared) after += n_bytes(2 * N * s.shared_F, 2) + n_bytes(N * s.shared_F, 2);
  // one_output_product: bf16(u') and h are column blocks of one [N, ℓ + Fs] operand (the same
  // bytes as the two apart), plus the joint [d, ℓ + Fs] weight.
  if (s.has_latent && s.has_shared) after += n_bytes(s.d * (s.latent + s.shared_F), 2) + 256;
  return std::max(experts, after);
}

// The latent up-projection and the shared experts' down-projection as one product over the
// joint operand [bf16(u') | h] [N, ℓ + Fs] against [W↑ | W_d] [d, ℓ + Fs] (copied column-wise
// each call: 6 MB for gpu_1b, ~4 us): the fp32 y [N, d] is written once instead of written, then
// read and written again (the two K = 512 / 1024 products each adding into the fp32 stream ran
// at 229 and ~240 TFLOP/s at B 4 × 4096). Taken where bf16(u') is produced by a conversion (the
// latent norm, or kept u) and the shared experts run their own products (not the decode
// GEMV / gathered path). DM_MOE_ONE_OUTPUT_PRODUCT=0: the two products (the A/B reference).
bool one_output_product(const MoeShape& s, bool gathered, bool kept) {
  return s.has_latent && s.has_shared && !gathered && (s.has_latent_norm || kept) &&
         env_flag("DM_MOE_ONE_OUTPUT_PRODUCT", true);
}

// Training without recompute keeps the shared experts' g and u (and the trainer a dense FFN's):
// DM_TRAIN_KEEP_GLU_INPUTS=0 recomputes them in the backward instead (the A/B reference).
bool keep_glu_inputs() { return env_flag("DM_TRAIN_KEEP_GLU_INPUTS", true); }

// Host copy of the plan's E+1 offsets: grows only, so steady-state calls do not allocate.
int64_t* host_offsets_buffer(int64_t E) {
  thread_local std::vector<int64_t> buffer;
  if (buffer.size() < size_t(E) + 1) buffer.resize(size_t(E) + 1);
  return buffer.data();
}

}  // namespace

size_t moe_layer_kept_gpu_bytes(const ModelConfig& c, int64_t N) {
  const MoeShape s = moe_shape(c);
  size_t b = n_bytes(N * s.E, 4) + 2 * n_bytes(N * s.k, 4) +
             aligned(moe_dispatch_plan_bytes(N, int(s.k), int(s.E)));
  if (s.has_latent) b += n_bytes(N * s.latent, 2) + n_bytes(N * s.latent, 4);  // z, u
  b += aligned(moe_experts_backward_workspace_bytes(N, int(s.k), expert_weights(nullptr, nullptr, s)));
  if (s.has_shared) b += n_bytes(2 * N * s.shared_F, 2);  // the shared experts' g, u
  return b + 256;
}

size_t moe_layer_forward_gpu_bytes(const ModelConfig& c, int64_t N, WeightPrecision precision) {
  const MoeShape s = moe_shape(c);
  // +256: the caller's arena mark may sit mid-way through a 256-byte block.
  if (precision == WeightPrecision::F32)
    return routing_bytes(s, N) + moe_gpu::forward_f32_bytes(s, N) + 256;
  return routing_bytes(s, N) + scope_base_bytes(s, N) + scope_peak_bytes(s, N) + 256;
}

void moe_layer_forward_gpu(GpuRun& run, const DeviceWeights& dw, const MoeWeights& w,
                           const uint16_t* xn, float* y, int64_t N, MoeRoutingDevice* routing,
                           MoeExpertsPath path, MoeKept* kept, const float* residual) {
  const ModelConfig& cfg = dw.config();
  const MoeShape s = moe_shape(cfg);
  const int64_t E = s.E, k = s.k, d = s.d, l = s.latent;
  DM_CHECK(N >= 0, "moe_layer_forward_gpu: negative token count ", N);
  DM_CHECK(w.router && w.expert_gate && w.expert_up && w.expert_down,
           "moe_layer_forward_gpu: MoE weights missing (not an MoE layer?)");
  DM_CHECK(!s.has_latent || (w.latent_down && w.latent_up), "moe_layer_forward_gpu: latent "
           "projections missing");
  DM_CHECK(!s.has_latent_norm || w.latent_norm, "moe_layer_forward_gpu: latent norm missing");
  DM_CHECK(!s.has_shared || (w.shared.gate && w.shared.up && w.shared.down),
           "moe_layer_forward_gpu: shared experts missing");
  const bool gathered = path == MoeExpertsPath::Gathered;
  DM_CHECK(!gathered || moe_decode_supported(N, int(k), expert_weights(nullptr, nullptr, s)),
           "moe_layer_forward_gpu: the gathered expert path does not take E=", E, " k=", k,
           " (see moe_decode_supported)");
  DM_CHECK(!(gathered && kept), "moe_layer_forward_gpu: keeping internals needs the grouped path");
  // A decode step's gathered experts take the shared expert as one more pair per token (its
  // gate/up and down in the routed kernels' launches, moe_decode.h) when it has the routed width
  // and feeds y directly (no latent projection between the routed sum and the shared add).
  const bool fold_shared =
      gathered && s.has_shared && !s.has_latent &&
      moe_decode_folds_shared(N, int(k), expert_weights(nullptr, nullptr, s), s.shared_F);
  CUstream_st* stream = run.stream;
  DeviceArena& arena = run.scratch;
  // Kept internals (training without recompute) are carved from the caller's memory instead.
  DeviceArena kept_arena(kept ? kept->device : nullptr, kept ? kept->bytes : 0);
  DeviceArena& keep = kept ? kept_arena : arena;

  // Routing outputs the caller keeps: carved below the scope so they survive the call.
  MoeRoutingDevice r;
  if (routing) {
    r = moe_gpu::carve_routing(arena, N, E, k);
    *routing = r;
  }
  if (N == 0) return;
  DeviceArenaScope scope(arena);
  if (kept) {
    // The backward reads the routing from here; the caller's report points at it too.
    r.scores = keep.alloc<float>(size_t(N * E));
    r.idx = keep.alloc<int32_t>(size_t(N * k));
    if (routing) {
      routing->scores = r.scores;
      routing->idx = r.idx;
    }
  } else if (!routing) {
    r.scores = arena.alloc<float>(size_t(N * E));
    r.idx = arena.alloc<int32_t>(size_t(N * k));
    // cutoff stays nullptr: moe_route skips it (the CPU computes it for QB only).
  }

  // Router on the full-width normed x, fp32 logits; the bias only steers selection. At decode
  // sizes the shared experts' gate and up projections of x ride in the same launch.
  float* logits = arena.alloc<float>(size_t(N * E));
  float* weight = keep.alloc<float>(size_t(N * k));
  uint16_t *shared_gate = nullptr, *shared_up = nullptr;
  if (!fold_shared && fused_input_projections(s, N, kept != nullptr)) {
    shared_gate = arena.alloc<uint16_t>(size_t(N * s.shared_F));
    shared_up = arena.alloc<uint16_t>(size_t(N * s.shared_F));
    const LinearOut projections[] = {
        {dw.bf16(w.router), E, logits, GemmOutType::F32},
        {dw.bf16(w.shared.gate), s.shared_F, shared_gate, GemmOutType::Bf16},
        {dw.bf16(w.shared.up), s.shared_F, shared_up, GemmOutType::Bf16}};
    linear_many(run, xn, N, d, projections, 3);
  } else {
    linear(run, xn, dw.bf16(w.router), N, d, E, logits, GemmOutType::F32);
  }
  const float* bias = w.router_bias ? dw.f32(w.router_bias) : nullptr;
  // (At decode every gathered gate/up block selecting its own token's experts from the logits,
  // without this launch, measured no faster at one row and 0.3 ms a step slower at four on the
  // 48B shape: the route's ~5 us in the step's chain is its own work, not its launch.)
  moe_route(logits, bias, N, router_params(cfg), r.scores, r.idx, weight, r.cutoff, stream);
  MoeDispatchPlan local_plan;
  MoeDispatchPlan& plan = kept ? kept->plan : local_plan;
  // The cuBLAS expert paths need the plan's offsets on the host (a synchronisation); ours
  // (GroupedOwn) reads them on the device.
  const MoeGemmPath gemm_path =
      path == MoeExpertsPath::GroupedCublas ? MoeGemmPath::Grouped : moe_gemm_default_path();
  const bool host_plan = gemm_path != MoeGemmPath::GroupedOwn;
  int64_t* host_offsets = host_plan ? host_offsets_buffer(E) : nullptr;
  if (kept && host_plan) {
    kept->host_offsets.resize(size_t(E) + 1);
    host_offsets = kept->host_offsets.data();
  }
  if (!gathered)
    moe_dispatch_plan_build(r.idx, N, int(k), int(E), &plan, keep, host_offsets, stream);

  // Routed path in the latent space z = xn·W↓ᵀ [N,ℓ] (or xn itself for plain MoE).
  const uint16_t* z = xn;
  if (s.has_latent) {
    uint16_t* latent_in = keep.alloc<uint16_t>(size_t(N * l));
    linear(run, xn, dw.bf16(w.latent_down), N, d, l, latent_in, GemmOutType::Bf16);
    z = latent_in;
  }
  // Combined expert output u [N,ℓ]: plain MoE writes y directly; latent MoE keeps u fp32 when
  // the norm follows (norm statistics in fp32) or when the backward keeps it, else bf16 (the
  // up-projection's operand).
  void* u = y;
  GemmOutType u_type = GemmOutType::F32;
  if (s.has_latent) {
    const bool u_f32 = s.has_latent_norm || kept;
    u_type = u_f32 ? GemmOutType::F32 : GemmOutType::Bf16;
    u = (kept ? keep : arena).alloc_bytes(size_t(N * l) * (u_f32 ? 4 : 2));
  }
  if (kept) {
    // The forward's expert GEMMs, leaving their intermediates in the kept workspace.
    const ExpertWeightsBf16 ew = expert_weights(&dw, &w, s);
    kept->workspace = keep.alloc_bytes(moe_experts_backward_workspace_bytes(N, int(k), ew));
    moe_experts_recompute(run.gemm, z, plan, weight, ew, glu_activation(cfg),
                          static_cast<float*>(u), kept->workspace, gemm_path, stream);
    kept->scores = r.scores;
    kept->idx = r.idx;
    kept->weight = weight;
    kept->z = z;
    kept->u = s.has_latent ? static_cast<float*>(u) : nullptr;
    kept->N = N;
  } else {
    DeviceArenaScope experts_scope(arena);
    const ExpertWeightsBf16 ew = expert_weights(&dw, &w, s);
    if (gathered) {
      void* workspace = arena.alloc_bytes(moe_decode_workspace_bytes(N, int(k), ew, fold_shared));
      SharedExpertBf16 shared;
      if (fold_shared)
        shared = {dw.bf16(w.shared.gate), dw.bf16(w.shared.up), dw.bf16(w.shared.down)};
      moe_decode_experts_forward(z, r.idx, weight, N, int(k), ew,
                                 glu_kernel_params(glu_activation(cfg)), u, u_type, workspace,
                                 stream, fold_shared ? &shared : nullptr);
    } else {
      void* workspace = arena.alloc_bytes(moe_experts_forward_workspace_bytes(N, int(k), ew));
      moe_experts_forward(run.gemm, z, plan, weight, ew, glu_activation(cfg), u, u_type, workspace,
                          gemm_path, stream);
    }
  }

  // one_output_product: bf16(u') goes into columns [0, ℓ) of `joint`, h into [ℓ, ℓ + Fs).
  const bool joint_product = one_output_product(s, gathered, kept != nullptr);
  const int64_t ld_joint = l + s.shared_F;
  uint16_t* joint = joint_product ? arena.alloc<uint16_t>(size_t(N * ld_joint)) : nullptr;
  if (s.has_latent) {
    const uint16_t* up_in = static_cast<const uint16_t*>(u);
    const float* to_round = nullptr;  // fp32 u' to round into the up-projection's operand
    if (s.has_latent_norm) {
      // RMSNorm(u) in fp32 (in place unless u is kept for the backward), then bf16.
      float* u32 = static_cast<float*>(u);
      float* normed32 = kept ? arena.alloc<float>(size_t(N * l)) : u32;
      rmsnorm_forward(u32, dw.f32(w.latent_norm), normed32, N, l, double(cfg.rms_eps), stream);
      to_round = normed32;
    } else if (kept) {
      to_round = static_cast<const float*>(u);
    }
    if (joint_product) {
      convert_f32_to_bf16_rows(to_round, joint, N, l, ld_joint, stream);
    } else {
      if (to_round) {
        uint16_t* rounded = arena.alloc<uint16_t>(size_t(N * l));
        convert_f32_to_bf16(to_round, rounded, N * l, stream);
        up_in = rounded;
      }
      linear_plus(run, up_in, dw.bf16(w.latent_up), N, l, d, y, residual);
      residual = nullptr;  // added
    }
  }

  if (s.has_shared && !fold_shared) {
    // Fused shared experts at full width: h = act(g, u) over [N, Fs], y += h·W_dᵀ.
    // g | u from one [N, 2·Fs] GEMM when the two weights are adjacent (kept for the backward in
    // the kept memory, else scratch), h in scratch; the decode GEMV's separate g, u as they are.
    const int64_t Fs = s.shared_F;
    uint16_t* gate = shared_gate;
    uint16_t* up = shared_up;
    GluRows rows;
    uint16_t* h = gate;
    if (kept) kept->shared_gate_up = nullptr;
    if (joint_product) {
      h = joint + l;
      rows.h_ld = ld_joint;
    }
    if (!gate) {
      if (glu_gate_up_adjacent(dw.bf16(w.shared.gate), dw.bf16(w.shared.up), Fs, d)) {
        const bool keep_gu = kept && keep_glu_inputs();
        gate = (keep_gu ? keep : arena).alloc<uint16_t>(size_t(2 * N * Fs));
        up = gate + Fs;
        rows = GluRows{Fs, 2 * Fs, rows.h_ld};
        if (!joint_product) h = arena.alloc<uint16_t>(size_t(N * Fs));
        if (keep_gu) kept->shared_gate_up = gate;
        linear(run, xn, dw.bf16(w.shared.gate), N, d, 2 * Fs, gate, GemmOutType::Bf16);
      } else {
        gate = arena.alloc<uint16_t>(size_t(N * Fs));
        if (!joint_product) h = gate;
        up = arena.alloc<uint16_t>(size_t(N * Fs));
        linear(run, xn, dw.bf16(w.shared.gate), N, d, Fs, gate, GemmOutType::Bf16);
        linear(run, xn, dw.bf16(w.shared.up), N, d, Fs, up, GemmOutType::Bf16);
      }
    }
    if (rows.h_ld != 0 && rows.width == 0) rows = GluRows{Fs, Fs, ld_joint};  // g, u contiguous
    glu_forward(gate, up, h, N * Fs, glu_activation(cfg), stream, rows);
    if (joint_product) {
      uint16_t* w_joint = arena.alloc<uint16_t>(size_t(d * ld_joint));  // [W↑ | W_d] [d, ℓ+Fs]
      copy_rows_device_to_device_async(w_joint, size_t(ld_joint) * 2, dw.bf16(w.latent_up),
                                       size_t(l) * 2, size_t(l) * 2, size_t(d), stream);
      copy_rows_device_to_device_async(w_joint + l, size_t(ld_joint) * 2, dw.bf16(w.shared.down),
                                       size_t(Fs) * 2, size_t(Fs) * 2, size_t(d), stream);
      linear_plus(run, joint, w_joint, N, ld_joint, d, y, residual);
      residual = nullptr;  // added
    } else {
      linear(run, h, dw.bf16(w.shared.down), N, Fs, d, y, GemmOutType::F32, 1.0f);
    }
  }
  if (residual) add_inplace(y, residual, N * d, stream);  // plain MoE: the experts wrote y
}

}  // namespace dm::cuda
