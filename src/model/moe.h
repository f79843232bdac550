// Stable Latent MoE channel mixer (SPEC §1.5) and the dense FFN: forward and backward, templated on
// the scalar (float engine, double for finite-difference checks; docs/backward.md).
//
//   logits = x·W_rᵀ; s = σ(logits); T = top_k(s + b); p = renorm(s_T)·scaling   (router, fp32)
//   z = x·W↓ᵀ (latent) or x;  u = Σ_{j∈T} p_j·E_j(z);  y = [RMSNorm(u)]·W↑ᵀ (latent) or u
//   y += Σ_shared E_s(x)                                    (shared experts fused, full width)
//
// The layers are token-wise (nothing mixes tokens), so sizes take the token count N = B·T.
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/arena.h"
#include "io/config.h"
#include "model/weights.h"
#include "ops/cpu/ffn.h"
#include "ops/cpu/moe.h"

namespace dm {

GluActivation glu_activation(const ModelConfig& cfg);

// Sizes of one MoE layer (shared by the CPU layer and its GPU twin, model/cuda/moe_gpu.cpp):
// E experts, top-k, width d, latent width ℓ (= d without a latent), expert hidden F, shared
// experts' total hidden.
struct MoeShape {
  int64_t E, k, d, latent, F, shared_F;
  bool has_latent, has_latent_norm, has_shared;
};
MoeShape moe_shape(const ModelConfig& cfg);
RouterParams router_params(const ModelConfig& cfg);

// Router decisions of one MoE layer for N tokens (views into the caller's arena).
template <typename Real>
struct MoeRoutingT {
  int32_t* idx = nullptr;   // [N, k] ascending expert ids
  Real* weight = nullptr;   // [N, k] routing weights p (renormalised × scaling)
  Real* cutoff = nullptr;   // [N] (k+1)-th biased score (QB, SPEC §1.6)
  Real* scores = nullptr;   // [N, E] sigmoid scores (unbiased)
};
using MoeRouting = MoeRoutingT<float>;

// What moe_layer_backward needs from the forward (buffers from the caller's saved arena).
// The routing decisions are kept here too: the trainer reads scores/cutoff for Quantile
// Balancing and idx for the loads. Routed experts' g/u are *not* saved (k·F values per token, the
// largest activation of the layer); the backward recomputes them per tile from z.
template <typename Real>
struct MoeSaved {
  int64_t N = 0;
  MoeRoutingT<Real> routing;
  Real* latent_in = nullptr;   // z [N, ℓ] (latent MoE only; plain MoE routes x itself)
  Real* latent_out = nullptr;  // u [N, ℓ] combined expert output before the latent norm (latent only)
  Real* shared_gate = nullptr; // [N, Fs] shared experts' pre-activations (Fs = num_shared·shared_ffn)
  Real* shared_up = nullptr;   // [N, Fs]
};

// x: normed input [N, d]; y: output [N, d] (overwritten).
// `routing` (optional) receives views of the routing decisions: into `saved`'s buffers when saving,
// else into ws, valid until the caller releases ws past its mark at the call (they are allocated
// before the layer's scratch scope). `saved` (training) needs `saved_arena`, which must hold
// moe_layer_saved_bytes(cfg, N, sizeof(Real)) and outlive the backward.
template <typename Real>
void moe_layer_forward(const ModelConfig& cfg, const MoeWeightsT<Real>& w, const Real* x, Real* y,
                       int64_t N, Arena& ws,
                       std::type_identity_t<MoeRoutingT<Real>>* routing = nullptr,
                       std::type_identity_t<MoeSaved<Real>>* saved = nullptr,
                       Arena* saved_arena = nullptr);
// Forward scratch (from ws) including the routing views it leaves allocated when not saving.
size_t moe_layer_workspace_bytes(const ModelConfig& cfg, int64_t N,
                                 size_t elem_bytes = sizeof(float));
size_t moe_layer_saved_bytes(const ModelConfig& cfg, int64_t N, size_t elem_bytes = sizeof(float));

// Accumulates (docs/backward.md): dx[N,d] += ∂L/∂x and every parameter gradient in `grad` (same
// layout as `w`) += ∂L/∂θ, from dy[N,d] = ∂L/∂y, with the forward's routing held fixed. x is the
// forward's input. grad.router_bias gets nothing (the bias steers selection only; QB sets it).
// Through: shared experts, latent up-projection, latent RMSNorm, routed experts (with their
// routing weights), latent down-projection, router (via the weights' dependence on the logits).
template <typename Real>
void moe_layer_backward(const ModelConfig& cfg, const MoeWeightsT<Real>& w, MoeWeightsT<Real>& grad,
                        const Real* x, const MoeSaved<Real>& saved, const Real* dy,
                        std::type_identity_t<Real>* dx, int64_t N, Arena& ws);
size_t moe_layer_backward_workspace_bytes(const ModelConfig& cfg, int64_t N,
                                          size_t elem_bytes = sizeof(float));

// Dense FFN layer: the gate/up pre-activations are saved for the backward when training.
template <typename Real>
struct DenseFfnSaved {
  int64_t N = 0;
  Real* gate = nullptr;  // [N, F]
  Real* up = nullptr;    // [N, F]
};

template <typename Real>
void dense_ffn_forward(const ModelConfig& cfg, const FfnWeightsT<Real>& w, const Real* x, Real* y,
                       int64_t N, Arena& ws,
                       std::type_identity_t<DenseFfnSaved<Real>>* saved = nullptr,
                       Arena* saved_arena = nullptr);
size_t dense_ffn_workspace_bytes(const ModelConfig& cfg, int64_t N,
                                 size_t elem_bytes = sizeof(float));
size_t dense_ffn_saved_bytes(const ModelConfig& cfg, int64_t N, size_t elem_bytes = sizeof(float));
// Accumulates dx and grad.{gate,up,down}. `saved` may be nullptr: g/u are then recomputed from x.
template <typename Real>
void dense_ffn_backward(const ModelConfig& cfg, const FfnWeightsT<Real>& w, FfnWeightsT<Real>& grad,
                        const Real* x, const std::type_identity_t<DenseFfnSaved<Real>>* saved,
                        const Real* dy, std::type_identity_t<Real>* dx, int64_t N, Arena& ws);
size_t dense_ffn_backward_workspace_bytes(const ModelConfig& cfg, int64_t N,
                                          size_t elem_bytes = sizeof(float));

}  // namespace dm
