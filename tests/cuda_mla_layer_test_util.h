// The setup shared by the GPU MLA layer tests (test_cuda_mla_layer.cpp forward,
// test_cuda_mla_layer_backward.cpp backward): configs/test.json, its MLA layer, weights rounded
// through bf16 for both sides, packed documents, and the case type. Only meaningful when
// DELTAMOE_HAVE_CUDA.
#pragma once
#if DELTAMOE_HAVE_CUDA
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "cuda_test_util.h"
#include "io/config.h"
#include "model/weights.h"
#include "test_util.h"

namespace dm::test::mla_layer {

// Weights large enough that the softmax is far from uniform (so RoPE positions, document masks
// and the scale all matter): init std 0.2 instead of 0.02 (score std ≈ 1.5), norm weights perturbed
// around 1. A CPU emulation of the GPU's bf16 rounding points gives ≈ 4.5e-3 … 6e-3 relative
// error at this size (it grows with the score spread), under the 1e-2 bound.
constexpr float kTestInitStd = 0.2f;

inline ModelConfig base_config() { return load_config(source_dir() + "/configs/test.json"); }

inline int mla_layer_index(const ModelConfig& cfg) {
  for (int l = 0; l < cfg.num_layers; ++l)
    if (cfg.mixers[size_t(l)] == MixerKind::MLA) return l;
  return -1;
}

// Every parameter rounded through bf16, so the CPU and the GPU see identical weights; the latent
// norm weights perturbed around 1 so that neither they nor their gradients are degenerate.
inline std::unique_ptr<ModelWeights> rounded_weights(const ModelConfig& cfg, uint64_t seed) {
  auto w = weights_allocate<float>(cfg);
  weights_init(*w, seed);
  const MlaWeights& m = w->layers[size_t(mla_layer_index(cfg))].mla;
  std::mt19937_64 rng(seed + 1);
  std::normal_distribution<float> normal(0.0f, 0.2f);
  if (m.q_a_norm)
    for (int64_t i = 0; i < cfg.mla.q_lora_rank; ++i) m.q_a_norm[i] = 1.0f + normal(rng);
  for (int64_t i = 0; i < cfg.mla.kv_lora_rank; ++i) m.kv_a_norm[i] = 1.0f + normal(rng);
  round_weights_to_bf16(*w);
  return w;
}

// Two documents per row: row b restarts at split[b] (doc_start[t] = 0 before it, split after).
inline std::vector<int32_t> two_documents(int64_t B, int64_t T) {
  std::vector<int32_t> doc_start(size_t(B * T));
  for (int64_t b = 0; b < B; ++b) {
    const int32_t split = int32_t(T * (b == 0 ? 37 : 61) / 100);
    for (int64_t t = 0; t < T; ++t) doc_start[size_t(b * T + t)] = t < split ? 0 : split;
  }
  return doc_start;
}

struct LayerCase {
  const char* name;
  std::function<void(ModelConfig&)> edit;  // applied to configs/test.json
};

}  // namespace dm::test::mla_layer
#endif  // DELTAMOE_HAVE_CUDA
