// Next-token sampling from logits (SPEC §5): greedy, temperature, top-k, top-p, min-p,
// repetition penalty, seeded. One Sampler per sequence; its RNG state is its own.
#pragma once
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace dm {

struct SamplingParams {
  float temperature = 1.0f;       // 0 = greedy (argmax)
  int top_k = 0;                  // 0 = off
  float top_p = 1.0f;             // 1 = off
  float min_p = 0.0f;             // 0 = off; keep tokens with p ≥ min_p · p_max
  float repetition_penalty = 1.0f;  // > 1 discourages tokens already in the context (CTRL rule)
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // logits [V] (modified in place by penalties); context = tokens seen so far (for the penalty).
  int32_t sample(float* logits, int64_t V, std::span<const int32_t> context);
  // log-probabilities of the (unpenalised, temperature-1) distribution, for `logprobs`.
  static void log_softmax(const float* logits, int64_t V, float* out);

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> cand_;  // reused candidate buffer
};

}  // namespace dm
