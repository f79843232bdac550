// Generation across calls whose prompts share prefixes (the turns of `deltamoe chat --device
// cuda`): one GPU decoder kept between calls (grown when a call needs more positions) and a GPU
// prefix cache (prefix_cache_gpu.h), so each turn's prompt — the whole conversation so far —
// prefills only what the cache does not hold: the history up to its last 512-token grid point
// inside an earlier prompt is restored, not recomputed. Same results as generate_gpu
// (model/cuda/generate_gpu.h) up to bf16 noise.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "infer/cuda/prefix_cache_gpu.h"
#include "infer/generate.h"
#include "model/cuda/decode_gpu.h"

namespace dm::cuda {

class GpuGenerationSession {
 public:
  // `dw` must outlive the session; prefix_cache_bytes > 0.
  GpuGenerationSession(const DeviceWeights& dw, size_t prefix_cache_bytes);
  ~GpuGenerationSession();

  // generate_gpu's contract: the new tokens (prompt excluded), on_token per token.
  std::vector<int32_t> generate(const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                                const std::function<void(int32_t)>& on_token = nullptr);

  // Prompt tokens the last call restored from the cache.
  int64_t last_cached_tokens() const { return last_cached_; }

 private:
  const DeviceWeights& dw_;
  size_t budget_ = 0;
  std::unique_ptr<GpuDecoder> decoder_;
  std::unique_ptr<GpuPrefixCache> cache_;
  int64_t last_cached_ = 0;
};

}  // namespace dm::cuda
