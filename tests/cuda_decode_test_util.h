// Helpers shared by the GPU decoder tests (test_cuda_decode.cpp, test_cuda_prefix_cache.cpp):
// a random model with bf16-rounded weights (the GPU and the CPU then see the same model), random
// prompts, the CPU's full-forward logits, and per-row comparison statistics.
#pragma once
#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "cuda_test_util.h"
#include "model/model.h"
#include "test_util.h"

namespace dm::test {

inline std::unique_ptr<Model> bf16_model(const ModelConfig& c, uint64_t seed) {
  auto W = weights_allocate<float>(c);
  weights_init(*W, seed);
  round_weights_to_bf16(*W);
  return std::make_unique<Model>(std::move(W));
}

inline std::vector<int32_t> random_tokens(int64_t n, int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& t : ids) t = int32_t(rng() % uint64_t(V));
  return ids;
}

// CPU full forward of one sequence: logits [T, V].
inline std::vector<float> cpu_logits(Model& m, const std::vector<int32_t>& seq) {
  const std::vector<int64_t> ids(seq.begin(), seq.end());
  std::vector<float> logits(seq.size() * size_t(m.config().vocab_size));
  m.forward(ids.data(), 1, int64_t(seq.size()), logits.data());
  return logits;
}

inline int64_t argmax(const float* x, int64_t V) { return std::max_element(x, x + V) - x; }

// Per-row comparison statistics of GPU rows against CPU rows.
struct RowStats {
  double worst = 0, sum = 0;
  int64_t rows = 0, agree = 0;
  void add(const float* gpu, const float* cpu, int64_t V) {
    const double e = rel_rms(gpu, cpu, size_t(V));
    worst = std::max(worst, std::isfinite(e) ? e : 1e30);
    sum += e;
    ++rows;
    agree += argmax(gpu, V) == argmax(cpu, V);
  }
  double agreement() const { return rows ? double(agree) / double(rows) : 0.0; }
};

}  // namespace dm::test

#endif  // DELTAMOE_HAVE_CUDA
