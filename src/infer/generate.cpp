#include "infer/generate.h"

#include <algorithm>

#include "core/error.h"

namespace dm {

std::vector<int32_t> generate(Model& model, const std::vector<int32_t>& prompt,
                              const GenerateOptions& opt, const std::function<void(int32_t)>& on_token) {
  const ModelConfig& c = model.config();
  DM_CHECK(!prompt.empty(), "generate: empty prompt");
  DM_CHECK(opt.max_new_tokens >= 0, "generate: max_new_tokens must be ≥ 0");
  DM_CHECK(int64_t(prompt.size()) + opt.max_new_tokens <= c.max_context, "generate: prompt (",
           prompt.size(), " tokens) + max_new_tokens (", opt.max_new_tokens,
           ") exceeds the context limit ", c.max_context);
  std::vector<int32_t> seq = prompt, out;
  std::vector<int64_t> ids;
  std::vector<float> logits;
  Sampler sampler(opt.sampling);
  const int64_t V = c.vocab_size;
  for (int64_t s = 0; s < opt.max_new_tokens; ++s) {
    const int64_t T = int64_t(seq.size());
    ids.assign(seq.begin(), seq.end());
    logits.resize(size_t(T * V));
    model.forward(ids.data(), 1, T, logits.data());
    const int32_t next = sampler.sample(logits.data() + (T - 1) * V, V, seq);
    seq.push_back(next);
    out.push_back(next);
    if (on_token) on_token(next);
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), next) != opt.stop_ids.end()) break;
  }
  return out;
}

}  // namespace dm
