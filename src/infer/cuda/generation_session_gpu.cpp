// GpuGenerationSession (generation_session_gpu.h): generate_loop over one kept GpuDecoder slot,
// prefilled through the GPU prefix cache.
#include "infer/cuda/generation_session_gpu.h"

#include <algorithm>

#include "core/error.h"

namespace dm::cuda {

GpuGenerationSession::GpuGenerationSession(const DeviceWeights& dw, size_t prefix_cache_bytes)
    : dw_(dw), budget_(prefix_cache_bytes) {
  DM_CHECK(prefix_cache_bytes > 0, "GpuGenerationSession: the prefix cache needs a budget");
}

GpuGenerationSession::~GpuGenerationSession() = default;

std::vector<int32_t> GpuGenerationSession::generate(const std::vector<int32_t>& prompt,
                                                    const GenerateOptions& opt,
                                                    const std::function<void(int32_t)>& on_token) {
  const ModelConfig& c = dw_.config();
  const int64_t n = int64_t(prompt.size());
  const int64_t needed = n + std::max<int64_t>(opt.max_new_tokens, 0);
  DM_CHECK(n > 0 && needed <= c.max_context, "generate (cuda): ", n, " prompt tokens + ",
           opt.max_new_tokens, " new ones exceed the context limit ", c.max_context);
  if (!decoder_ || decoder_->max_length() < needed) {
    // Room for a few more turns (4096-token steps), so a growing conversation rarely reallocates;
    // the cache's entries do not depend on the decoder.
    const int64_t length = std::min<int64_t>(c.max_context, (needed + 4095) / 4096 * 4096);
    decoder_.reset();
    decoder_ = std::make_unique<GpuDecoder>(dw_, 1, length);
    if (!cache_) cache_ = std::make_unique<GpuPrefixCache>(*decoder_, budget_);
  }
  last_cached_ = 0;
  auto prefill = [&](float* logits) {
    last_cached_ = cache_->prefill(*decoder_, 0, prompt.data(), n, logits);
  };
  auto step = [&](int32_t token, float* logits) { decoder_->step(&token, logits); };
  return generate_loop(c, prompt, opt, prefill, step, on_token);
}

}  // namespace dm::cuda
