// The cases shared by the GPU KDA layer tests (test_cuda_kda_layer.cpp forward,
// test_cuda_kda_layer_backward.cpp backward): edits of configs/test.json that cover both gates,
// both output-gate ranks and wider heads with a shorter conv. Only meaningful when
// DELTAMOE_HAVE_CUDA.
#pragma once
#if DELTAMOE_HAVE_CUDA
#include <functional>

#include "io/config.h"

namespace dm::test::kda_layer {

// Larger than the default 0.02 so the gates, β and the decay vary across tokens and channels
// (with 0.02 every projection is nearly zero and g ≈ its bias).
constexpr float kTestInitStd = 0.1f;

struct KdaCase {
  const char* name;
  std::function<void(ModelConfig&)> edit;  // applied to configs/test.json
};

// configs/test.json as is: safe gate (lower bound −5), full-rank output gate, H = 2, K = 32.
inline const KdaCase kSafeFull{"SafeFullRank", [](ModelConfig&) {}};
inline const KdaCase kSoftplusLow{"SoftplusLowRank", [](ModelConfig& cfg) {
                                    cfg.kda.gate = KdaGateKind::Softplus;
                                    cfg.kda.full_rank_output_gate = false;
                                  }};
// H·K = 192 (not a power of two), K = 64, conv kernel 3.
inline const KdaCase kWide{"WideHeadsConv3", [](ModelConfig& cfg) {
                             cfg.kda.num_heads = 3;
                             cfg.kda.head_dim = 64;
                             cfg.kda.conv_kernel = 3;
                             cfg.kda.full_rank_output_gate = false;
                           }};

}  // namespace dm::test::kda_layer
#endif  // DELTAMOE_HAVE_CUDA
