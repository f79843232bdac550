// The cache a Scheduler decodes with (SPEC §5): the CPU DecodeState (infer/decode.h, with the
// hybrid prefix cache) or the GPU decoder (model/cuda/decode_gpu.h; infer/cuda/
// decode_backend_gpu.cpp). The scheduler's engine thread is the only caller.
//   slots: S decode slots of up to max_length tokens; logits rows are [V] per slot.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "model/model.h"

namespace dm {

class DecodeBackend {
 public:
  virtual ~DecodeBackend() = default;
  virtual int64_t num_slots() const = 0;
  // Prompt tokens the last prefill of `slot` took from the prefix cache (0 without one).
  virtual int64_t cached_tokens(int64_t slot) const = 0;
  // Prompt ids into `slot` (replacing what it held); the last position's logits → row [V].
  virtual void prefill_slot(Model& model, int64_t slot, std::span<const int32_t> prompt,
                            float* row) = 0;
  // One token per active slot: next_ids [S], active [S] (0/1) → logits [S, V] (active rows).
  virtual void decode_active(Model& model, const int32_t* next_ids, const int* active,
                             float* logits) = 0;
  // The same step with the logits left where the backend has them: active slot s's row is
  // rows + row_of[s]·V (row_of [S]; −1 for inactive slots), valid (and the caller's to modify,
  // as sampling does) until the backend's next call.
  // The default decodes into scratch [S, V] (row_of[s] = s); the GPU backend returns the
  // decoder's pinned rows without a host copy.
  virtual float* decode_active_rows(Model& model, const int32_t* next_ids, const int* active,
                                    float* scratch, int64_t* row_of);
  // The slot's sequence is done (its cache may be reused at once).
  virtual void release_slot(int64_t slot) = 0;
};

// device "cpu": DecodeState with prefix_cache_bytes of prefix cache (0 = off). device "cuda":
// GpuDecoder over a bf16 upload of model's weights (which must outlive it), with a GPU prefix
// cache of prefix_cache_bytes (infer/cuda/prefix_cache_gpu.h; 0 = off). Throws dm::Error for an
// unknown device, a build without the CUDA backend or a machine without a GPU.
std::unique_ptr<DecodeBackend> make_decode_backend(const std::string& device, const Model& model,
                                                   int64_t slots, int64_t max_length,
                                                   size_t prefix_cache_bytes);
// The GPU backend (CUDA builds only).
std::unique_ptr<DecodeBackend> make_cuda_decode_backend(const Model& model, int64_t slots,
                                                        int64_t max_length,
                                                        size_t prefix_cache_bytes = 0);

}  // namespace dm
