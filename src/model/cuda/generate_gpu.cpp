// generate_gpu: infer/generate.cpp's loop over GpuDecoder instead of the CPU DecodeState.
#include "model/cuda/generate_gpu.h"

#include <algorithm>

#include "core/error.h"
#include "model/cuda/decode_gpu.h"

namespace dm::cuda {

std::vector<int32_t> generate_gpu(const DeviceWeights& dw, const std::vector<int32_t>& prompt,
                                  const GenerateOptions& opt,
                                  const std::function<void(int32_t)>& on_token) {
  const ModelConfig& c = dw.config();
  DM_CHECK(!prompt.empty(), "generate: empty prompt");
  DM_CHECK(opt.max_new_tokens >= 0, "generate: max_new_tokens must be ≥ 0");
  DM_CHECK(int64_t(prompt.size()) + opt.max_new_tokens <= c.max_context, "generate: prompt (",
           prompt.size(), " tokens) + max_new_tokens (", opt.max_new_tokens,
           ") exceeds the context limit ", c.max_context);
  std::vector<int32_t> seq = prompt, out;
  if (opt.max_new_tokens == 0) return out;
  // One slot holding the prompt and every new token but the last (whose logits are not needed).
  const int64_t V = c.vocab_size;
  GpuDecoder decoder(dw, 1, int64_t(prompt.size()) + opt.max_new_tokens);
  std::vector<float> logits(static_cast<size_t>(V));
  decoder.prefill(0, prompt.data(), int64_t(prompt.size()), logits.data());
  Sampler sampler(opt.sampling);
  for (int64_t s = 0; s < opt.max_new_tokens; ++s) {
    const int32_t next = sampler.sample(logits.data(), V, seq);
    seq.push_back(next);
    out.push_back(next);
    if (on_token) on_token(next);
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), next) != opt.stop_ids.end()) break;
    if (s + 1 < opt.max_new_tokens) decoder.step(&next, logits.data());
  }
  return out;
}

}  // namespace dm::cuda
