// Autoregressive generation for one prompt. This version re-runs the full forward pass for every
// new token (O(T²) per sequence): correct and simple, used until the cached decode path
// (recurrent KDA state + absorbed MLA over a latent cache) lands with the inference issue.
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

}  // namespace dm
