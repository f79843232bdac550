// Gated MLA token mixer layer, expanded form for prefill/training (SPEC §1.2).
#pragma once
#include <cstdint>

#include "core/arena.h"
#include "io/config.h"
#include "model/weights.h"

namespace dm {

// x: normed input [B, T, d]; y: output [B, T, d]. Positions are 0..T−1 per sequence.
void mla_layer_forward(const ModelConfig& cfg, const MlaWeights& w, const float* x, float* y,
                       int64_t B, int64_t T, Arena& ws);
size_t mla_layer_workspace_bytes(const ModelConfig& cfg, int64_t B, int64_t T);
// Softmax scale: (nope+rope)^-1/2, × m² under YaRN.
float mla_softmax_scale(const MlaConfig& m);

}  // namespace dm
