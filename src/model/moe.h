// Stable Latent MoE channel mixer (SPEC §1.5) and the dense FFN.
#pragma once
#include <cstdint>

#include "core/arena.h"
#include "io/config.h"
#include "model/weights.h"
#include "ops/cpu/ffn.h"
#include "ops/cpu/moe.h"

namespace dm {

GluActivation glu_activation(const ModelConfig& cfg);
RouterParams router_params(const ModelConfig& cfg);

// Router decisions of one MoE layer for N tokens (views into the caller's workspace).
struct MoeRouting {
  int32_t* idx = nullptr;   // [N, k] ascending expert ids
  float* weight = nullptr;  // [N, k]
  float* cutoff = nullptr;  // [N] (k+1)-th biased score (QB)
  float* scores = nullptr;  // [N, E] sigmoid scores
};

// x: normed input [N, d]; y: output [N, d]. `routing` (optional) receives views valid until the
// caller releases ws past its current mark (allocated before the layer's scratch scope).
void moe_layer_forward(const ModelConfig& cfg, const MoeWeights& w, const float* x, float* y,
                       int64_t N, Arena& ws, MoeRouting* routing = nullptr);
size_t moe_layer_workspace_bytes(const ModelConfig& cfg, int64_t N);

void dense_ffn_forward(const ModelConfig& cfg, const FfnWeights& w, const float* x, float* y,
                       int64_t N, Arena& ws);
size_t dense_ffn_workspace_bytes(const ModelConfig& cfg, int64_t N);

}  // namespace dm
