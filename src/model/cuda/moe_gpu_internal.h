// Shared by the MoE layer's GPU forward (moe_gpu.cpp) and backward (moe_gpu_backward.cpp): the
// scratch arithmetic and the device view of the stacked expert weights.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "model/cuda/gpu_run.h"
#include "model/cuda/layers.h"
#include "model/moe.h"
#include "ops/cuda/moe.h"

namespace dm::cuda::moe_gpu {

// DeviceArena starts every view on a 256-byte boundary.
inline size_t aligned(size_t bytes) { return (bytes + 255) & ~size_t(255); }
inline size_t n_bytes(int64_t n, size_t elem) {
  return aligned(size_t(std::max<int64_t>(n, 1)) * elem);
}

// Device views of the layer's experts for activations of type A (uint16_t: the bf16 mirror,
// ExpertWeightsBf16; float: the fp32 mode's, ExpertWeightsF32); dw, w nullable: shapes only, for
// byte counts. Host layout (model/weights.cpp): gate, up [E, F, ℓ]; down [E, ℓ, F] = what
// ops/cuda/moe.h expects.
template <typename A>
using ExpertWeightsOf =
    std::conditional_t<std::is_same_v<A, float>, ExpertWeightsF32, ExpertWeightsBf16>;
template <typename A = uint16_t>
ExpertWeightsOf<A> expert_weights(const DeviceWeights* dw, const MoeWeights* w, const MoeShape& s) {
  ExpertWeightsOf<A> ew;
  if (dw && w) {
    ew.gate = dw->operand<A>(w->expert_gate);
    ew.up = dw->operand<A>(w->expert_up);
    ew.down = dw->operand<A>(w->expert_down);
  }
  ew.E = s.E;
  ew.Din = s.latent;
  ew.F = s.F;
  return ew;
}

// The routing outputs a caller asked for (MoeRoutingDevice), carved from `arena` below the
// layer's scope so they outlive the call: scores [N, E], cutoff [N], idx [N, k] (≥ 1 element
// each, so N = 0 still gets valid pointers).
inline MoeRoutingDevice carve_routing(DeviceArena& arena, int64_t N, int64_t E, int64_t k) {
  MoeRoutingDevice r;
  r.scores = arena.alloc<float>(size_t(std::max<int64_t>(N * E, 1)));
  r.cutoff = arena.alloc<float>(size_t(std::max<int64_t>(N, 1)));
  r.idx = arena.alloc<int32_t>(size_t(std::max<int64_t>(N * k, 1)));
  return r;
}

// Scratch of the fp32 mode's layer forward (moe_gpu_f32.cpp), without the routing outputs.
size_t forward_f32_bytes(const MoeShape& s, int64_t N);

}  // namespace dm::cuda::moe_gpu
