// Autoregressive generation for one prompt: prefill the prompt once, then one cached decode step
// per new token (infer/decode.h: recurrent KDA state, absorbed MLA over the latent cache), so
// each new token costs O(T) instead of a full re-forward.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "infer/sampler.h"
#include "model/model.h"

namespace dm {

struct GenerateOptions {
  int64_t max_new_tokens = 32;
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these
};

// Returns the new tokens (prompt excluded). on_token (optional) sees each new token as it comes.
std::vector<int32_t> generate(Model& model, const std::vector<int32_t>& prompt,
                              const GenerateOptions& opt,
                              const std::function<void(int32_t)>& on_token = nullptr);

// The sampling loop any decoder plugs into (the CPU one above, model/cuda/generate_gpu.h):
// checks the request against the config, then prefill(logits [V]) once for the prompt and
// step(token, logits) per new token but the last. Returns the new tokens.
std::vector<int32_t> generate_loop(const ModelConfig& c, const std::vector<int32_t>& prompt,
                                   const GenerateOptions& opt,
                                   const std::function<void(float*)>& prefill,
                                   const std::function<void(int32_t, float*)>& step,
                                   const std::function<void(int32_t)>& on_token);

}  // namespace dm
