// generate_gpu: infer/generate.cpp's loop over GpuDecoder instead of the CPU DecodeState.
#include "model/cuda/generate_gpu.h"

#include <algorithm>
#include <memory>

#include "core/error.h"
#include "model/cuda/decode_gpu.h"

namespace dm::cuda {

std::vector<int32_t> generate_gpu(const DeviceWeights& dw, const std::vector<int32_t>& prompt,
                                  const GenerateOptions& opt,
                                  const std::function<void(int32_t)>& on_token) {
  std::unique_ptr<GpuDecoder> decoder;
  auto prefill = [&](float* logits) {
    decoder = std::make_unique<GpuDecoder>(dw, 1, int64_t(prompt.size()) + opt.max_new_tokens);
    decoder->prefill(0, prompt.data(), int64_t(prompt.size()), logits);
  };
  auto step = [&](int32_t token, float* logits) { decoder->step(&token, logits); };
  return generate_loop(dw.config(), prompt, opt, prefill, step, on_token);
}

std::vector<int32_t> generate_gpu_fp32(GpuModel& model, const std::vector<int32_t>& prompt,
                                       const GenerateOptions& opt,
                                       const std::function<void(int32_t)>& on_token) {
  const ModelConfig& c = model.config();
  std::vector<int64_t> sequence(prompt.begin(), prompt.end());
  sequence.reserve(prompt.size() + size_t(std::max<int64_t>(opt.max_new_tokens, 0)));
  auto run = [&](float* logits) {
    DM_CHECK(int64_t(sequence.size()) <= c.max_context, "generate (cuda, fp32): ", sequence.size(),
             " tokens exceed the context limit ", c.max_context);
    model.forward_last(sequence.data(), int64_t(sequence.size()), logits);
  };
  auto step = [&](int32_t token, float* logits) {
    sequence.push_back(token);
    run(logits);
  };
  return generate_loop(c, prompt, opt, run, step, on_token);
}

}  // namespace dm::cuda
