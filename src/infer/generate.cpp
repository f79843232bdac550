#include "infer/generate.h"

#include <algorithm>
#include <memory>

#include "core/error.h"
#include "infer/decode.h"

namespace dm {

std::vector<int32_t> generate_loop(const ModelConfig& c, const std::vector<int32_t>& prompt,
                                   const GenerateOptions& opt,
                                   const std::function<void(float*)>& prefill,
                                   const std::function<void(int32_t, float*)>& step,
                                   const std::function<void(int32_t)>& on_token) {
  DM_CHECK(!prompt.empty(), "generate: empty prompt");
  DM_CHECK(opt.max_new_tokens >= 0, "generate: max_new_tokens must be ≥ 0");
  DM_CHECK(int64_t(prompt.size()) + opt.max_new_tokens <= c.max_context, "generate: prompt (",
           prompt.size(), " tokens) + max_new_tokens (", opt.max_new_tokens,
           ") exceeds the context limit ", c.max_context);
  std::vector<int32_t> seq = prompt, out;
  if (opt.max_new_tokens == 0) return out;
  const int64_t V = c.vocab_size;
  std::vector<float> logits(static_cast<size_t>(V));
  prefill(logits.data());
  Sampler sampler(opt.sampling);
  for (int64_t s = 0; s < opt.max_new_tokens; ++s) {
    const int32_t next = sampler.sample(logits.data(), V, seq);
    seq.push_back(next);
    out.push_back(next);
    if (on_token) on_token(next);
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), next) != opt.stop_ids.end()) break;
    if (s + 1 < opt.max_new_tokens) step(next, logits.data());
  }
  return out;
}

std::vector<int32_t> generate(Model& model, const std::vector<int32_t>& prompt,
                              const GenerateOptions& opt, const std::function<void(int32_t)>& on_token) {
  // One slot holding the prompt and every new token but the last (whose logits are not needed).
  // The slot is sized only when there is something to generate (generate_loop checks first).
  std::unique_ptr<DecodeState> state;
  auto prefill_fn = [&](float* logits) {
    state = std::make_unique<DecodeState>(model.config(), 1,
                                          int64_t(prompt.size()) + opt.max_new_tokens);
    prefill(model, *state, 0, prompt.data(), int64_t(prompt.size()), logits);
  };
  auto step_fn = [&](int32_t token, float* logits) {
    decode_step(model, *state, &token, nullptr, logits);
  };
  return generate_loop(model.config(), prompt, opt, prefill_fn, step_fn, on_token);
}

}  // namespace dm
