// KDA token mixer layer (SPEC §1.1): projections, short convs, gates, the KDA operator, the gated
// per-head RMSNorm and the output projection. Kernels live in ops/cpu/{kda,kda_prep,norm}.
#pragma once
#include <cstdint>

#include "core/arena.h"
#include "io/config.h"
#include "model/weights.h"

namespace dm {

struct KdaRunOptions {
  int chunk = 64;          // chunked form (16/32/64); 0 = recurrent reference
};

// x: normed input [B, T, d]; y: output [B, T, d] (overwritten). Scratch from ws.
void kda_layer_forward(const ModelConfig& cfg, const KdaWeights& w, const float* x, float* y,
                       int64_t B, int64_t T, Arena& ws, const KdaRunOptions& opt = {});
size_t kda_layer_workspace_bytes(const ModelConfig& cfg, int64_t B, int64_t T, int chunk = 64);

}  // namespace dm
