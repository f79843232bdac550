// The scheduler's GPU cache: GpuDecoder (chunked prefill into a slot, one batched decode step
// per iteration over the active slots) with the GPU prefix cache (prefix_cache_gpu.h) when it
// has a budget; sampling stays on the host, from the decoder's pinned logits rows.
#include <memory>
#include <vector>

#include "core/error.h"
#include "infer/cuda/prefix_cache_gpu.h"
#include "infer/decode_backend.h"
#include "model/cuda/decode_gpu.h"
#include "ops/cuda/device.h"

namespace dm {
namespace {

class GpuDecodeBackend final : public DecodeBackend {
 public:
  GpuDecodeBackend(const Model& model, int64_t slots, int64_t max_length, size_t prefix_cache_bytes)
      : decoder_(model.weights(), slots, max_length), cached_(size_t(slots), 0) {
    if (prefix_cache_bytes > 0)
      prefix_cache_ = std::make_unique<cuda::GpuPrefixCache>(decoder_, prefix_cache_bytes);
  }
  int64_t num_slots() const override { return int64_t(cached_.size()); }
  int64_t cached_tokens(int64_t slot) const override { return cached_.at(size_t(slot)); }
  void prefill_slot(Model&, int64_t slot, std::span<const int32_t> prompt, float* row) override {
    DM_CHECK(slot >= 0 && slot < int64_t(cached_.size()), "prefill: slot ", slot, " outside [0, ",
             cached_.size(), ")");
    cached_[size_t(slot)] = 0;
    if (prefix_cache_)
      cached_[size_t(slot)] =
          prefix_cache_->prefill(decoder_, slot, prompt.data(), int64_t(prompt.size()), row);
    else
      decoder_.prefill(slot, prompt.data(), int64_t(prompt.size()), row);
  }
  void decode_active(Model&, const int32_t* next_ids, const int* active,
                     float* logits) override {
    decoder_.step(next_ids, logits, active);
  }
  // The decoder's pinned rows, no host copy (GpuDecoder::step_rows: active slots in order).
  float* decode_active_rows(Model&, const int32_t* next_ids, const int* active, float*,
                            int64_t* row_of) override {
    int64_t r = 0;
    for (size_t s = 0; s < cached_.size(); ++s) row_of[s] = active[s] ? r++ : -1;
    return decoder_.step_rows(next_ids, active);
  }
  void release_slot(int64_t slot) override { decoder_.release(slot); }

 private:
  cuda::GpuDecoder decoder_;
  std::vector<int64_t> cached_;
  std::unique_ptr<cuda::GpuPrefixCache> prefix_cache_;  // after decoder_: destroyed first
};

}  // namespace

std::unique_ptr<DecodeBackend> make_cuda_decode_backend(const Model& model, int64_t slots,
                                                        int64_t max_length,
                                                        size_t prefix_cache_bytes) {
  DM_CHECK(cuda::device_available(), "--device cuda: ", cuda::device_description());
  return std::make_unique<GpuDecodeBackend>(model, slots, max_length, prefix_cache_bytes);
}

}  // namespace dm
