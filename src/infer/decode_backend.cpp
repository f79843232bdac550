#include "infer/decode_backend.h"

#include <string>

#include "core/error.h"
#include "infer/decode.h"

namespace dm {
namespace {

class CpuDecodeBackend final : public DecodeBackend {
 public:
  CpuDecodeBackend(const ModelConfig& cfg, int64_t slots, int64_t max_length,
                   size_t prefix_cache_bytes)
      : state_(cfg, slots, max_length, pool_options(cfg, slots, max_length, prefix_cache_bytes)) {
    if (prefix_cache_bytes > 0) state_.enable_prefix_cache(prefix_cache_bytes);
  }
  int64_t num_slots() const override { return int64_t(state_.cached_tokens.size()); }
  int64_t cached_tokens(int64_t slot) const override {
    return state_.cached_tokens[size_t(slot)];
  }
  void prefill_slot(Model& model, int64_t slot, std::span<const int32_t> prompt,
                    float* row) override {
    prefill(model, state_, slot, prompt.data(), int64_t(prompt.size()), row);
  }
  void decode_active(Model& model, const int32_t* next_ids, const int* active,
                     float* logits) override {
    decode_step(model, state_, next_ids, active, logits);
  }
  // Its latent-cache pages go back to the pool at once (pages a prefix-cache entry shares stay
  // pinned by it).
  void release_slot(int64_t slot) override { release(state_, slot); }

 private:
  // Pages for every slot at full length, plus room for the prefix cache's pinned pages.
  static DecodeStateOptions pool_options(const ModelConfig& cfg, int64_t slots,
                                         int64_t max_length, size_t prefix_cache_bytes) {
    DecodeStateOptions o;
    if (prefix_cache_bytes == 0) return o;
    const size_t page = DecodeState::page_bytes(cfg, o.page_tokens);
    if (page == 0) return o;  // no MLA layer: nothing paged
    const int64_t per_slot = (max_length + o.page_tokens - 1) / o.page_tokens;
    o.page_pool_bytes = size_t(slots * per_slot) * page + prefix_cache_bytes;
    return o;
  }
  DecodeState state_;
};

}  // namespace

float* DecodeBackend::decode_active_rows(Model& model, const int32_t* next_ids, const int* active,
                                         float* scratch, int64_t* row_of) {
  decode_active(model, next_ids, active, scratch);
  for (int64_t s = 0; s < num_slots(); ++s) row_of[s] = active[s] ? s : -1;
  return scratch;
}

std::unique_ptr<DecodeBackend> make_decode_backend(const std::string& device, const Model& model,
                                                   int64_t slots, int64_t max_length,
                                                   size_t prefix_cache_bytes) {
  if (device == "cpu")
    return std::make_unique<CpuDecodeBackend>(model.config(), slots, max_length,
                                              prefix_cache_bytes);
  DM_CHECK(device == "cuda", "unknown device '", device, "' (cpu or cuda)");
#if DELTAMOE_HAVE_CUDA
  return make_cuda_decode_backend(model, slots, max_length, prefix_cache_bytes);
#else
  throw Error("--device cuda: this build has no CUDA backend (configure with -DDELTAMOE_CUDA=ON)");
#endif
}

}  // namespace dm
