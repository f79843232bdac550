// The scheduler's GPU cache: GpuDecoder (chunked prefill into a slot, one batched decode step
// per iteration over the active slots), sampling stays on the host.
#include "core/error.h"
#include "infer/decode_backend.h"
#include "model/cuda/decode_gpu.h"
#include "ops/cuda/device.h"

namespace dm {
namespace {

class GpuDecodeBackend final : public DecodeBackend {
 public:
  GpuDecodeBackend(const Model& model, int64_t slots, int64_t max_length)
      : decoder_(model.weights(), slots, max_length) {}
  int64_t cached_tokens(int64_t) const override { return 0; }
  void prefill_slot(Model&, int64_t slot, std::span<const int32_t> prompt, float* row) override {
    decoder_.prefill(slot, prompt.data(), int64_t(prompt.size()), row);
  }
  void decode_active(Model&, const int32_t* next_ids, const int* active,
                     float* logits) override {
    decoder_.step(next_ids, logits, active);
  }
  void release_slot(int64_t slot) override { decoder_.release(slot); }

 private:
  cuda::GpuDecoder decoder_;
};

}  // namespace

std::unique_ptr<DecodeBackend> make_cuda_decode_backend(const Model& model, int64_t slots,
                                                        int64_t max_length) {
  DM_CHECK(cuda::device_available(), "--device cuda: ", cuda::device_description());
  return std::make_unique<GpuDecodeBackend>(model, slots, max_length);
}

}  // namespace dm
