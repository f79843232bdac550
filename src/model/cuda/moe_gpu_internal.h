// Shared by the MoE layer's GPU forward (moe_gpu.cpp) and backward (moe_gpu_backward.cpp): the
// scratch arithmetic and the device view of the stacked expert weights.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "model/cuda/gpu_run.h"
#include "model/moe.h"
#include "ops/cuda/moe.h"

namespace dm::cuda::moe_gpu {

// DeviceArena starts every view on a 256-byte boundary.
inline size_t aligned(size_t bytes) { return (bytes + 255) & ~size_t(255); }
inline size_t n_bytes(int64_t n, size_t elem) {
  return aligned(size_t(std::max<int64_t>(n, 1)) * elem);
}

// Device bf16 views of the layer's experts (dw, w nullable: shapes only, for byte counts).
// Host layout (model/weights.cpp): gate, up [E, F, ℓ]; down [E, ℓ, F] = what ops/cuda/moe.h expects.
inline ExpertWeightsBf16 expert_weights(const DeviceWeights* dw, const MoeWeights* w,
                                        const MoeShape& s) {
  ExpertWeightsBf16 ew;
  if (dw && w) {
    ew.gate = dw->bf16(w->expert_gate);
    ew.up = dw->bf16(w->expert_up);
    ew.down = dw->bf16(w->expert_down);
  }
  ew.E = s.E;
  ew.Din = s.latent;
  ew.F = s.F;
  return ew;
}

// Scratch of the fp32 mode's layer forward (moe_gpu_f32.cpp), without the routing outputs.
size_t forward_f32_bytes(const MoeShape& s, int64_t N);

}  // namespace dm::cuda::moe_gpu
