// GpuDecoder's copies for the prefix cache (decode_gpu.h; used by infer/cuda/
// decode_backend_gpu.cpp): a slot's latent rows to and from device buffers, and restoring a
// slot's KDA carry and length from a checkpoint. The static page table gives slot s the pages
// [s·P, (s+1)·P), so its rows 0 … length−1 of one MLA layer are contiguous: [length, Wd] from the
// slot's first page, and a range of rows is one copy per layer.
#include <algorithm>

#include "core/error.h"
#include "model/cuda/decode_gpu.h"
#include "model/cuda/decode_gpu_internal.h"

namespace dm::cuda {

using decode_detail::kPageTokens;

int GpuDecoder::mla_layers() const {
  const ModelConfig& c = config();
  return int(std::count(c.mixers.begin(), c.mixers.end(), MixerKind::MLA));
}

int64_t GpuDecoder::latent_width() const {
  return int64_t(config().mla.kv_lora_rank) + config().mla.qk_rope_dim;
}

namespace {

void check_rows(int64_t slot, int64_t S, int64_t begin, int64_t count, int64_t max_length,
                const char* who) {
  DM_CHECK(slot >= 0 && slot < S, who, ": slot ", slot, " outside [0, ", S, ")");
  DM_CHECK(begin >= 0 && count >= 0 && begin + count <= max_length, who, ": rows [", begin, ", ",
           begin + count, ") outside the slot's ", max_length, " positions");
}

}  // namespace

void GpuDecoder::copy_latents(int64_t slot, int64_t begin, int64_t count, uint16_t* buffer,
                              bool into_slot) {
  check_rows(slot, S_, begin, count, max_length_,
             into_slot ? "GpuDecoder::write_latents" : "GpuDecoder::read_latents");
  const ModelConfig& c = config();
  const int64_t Wd = latent_width(), first = (slot * pages_per_slot_ * kPageTokens + begin) * Wd;
  const size_t bytes = size_t(count * Wd) * sizeof(uint16_t);
  int j = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.mixers[i] != MixerKind::MLA) continue;
    uint16_t* rows = mla_pages_[size_t(i)] + first;
    uint16_t* other = buffer + j++ * count * Wd;
    if (into_slot)
      copy_device_to_device(rows, other, bytes);
    else
      copy_device_to_device(other, rows, bytes);
  }
}

void GpuDecoder::read_latents(int64_t slot, int64_t begin, int64_t count, uint16_t* dst) {
  copy_latents(slot, begin, count, dst, /*into_slot=*/false);
}

void GpuDecoder::write_latents(int64_t slot, int64_t begin, int64_t count, const uint16_t* src) {
  // The buffer is only read on this path.
  copy_latents(slot, begin, count, const_cast<uint16_t*>(src), /*into_slot=*/true);
}

void GpuDecoder::restore(int64_t slot, int64_t length,
                         const std::function<const float*(int)>& state,
                         const std::function<const uint16_t*(int, int)>& tail) {
  check_rows(slot, S_, 0, length, max_length_, "GpuDecoder::restore");
  const ModelConfig& c = config();
  const int64_t HK = int64_t(c.kda.num_heads) * c.kda.head_dim, K = c.kda.head_dim;
  const int64_t tail_elems = std::max(c.kda.conv_kernel - 1, 0) * HK;
  // The slot's own stream may still hold work on this slot (release() queues its zeroing there):
  // the copies below are synchronous on the legacy stream, so order them after it.
  stream_synchronize(run_->stream);
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.mixers[i] != MixerKind::KDA) continue;
    const size_t l = size_t(i);
    copy_to_device(kda_state_[l] + slot * HK * K, state(i), size_t(HK * K) * sizeof(float));
    uint16_t* tails[3] = {kda_tail_q_[l], kda_tail_k_[l], kda_tail_v_[l]};
    if (tail_elems > 0)
      for (int b = 0; b < 3; ++b)
        copy_to_device(tails[b] + slot * tail_elems, tail(i, b),
                       size_t(tail_elems) * sizeof(uint16_t));
  }
  const int32_t len = int32_t(length);
  copy_to_device(lengths_ + slot, &len, sizeof(int32_t));
  host_lengths_[size_t(slot)] = length;
}

}  // namespace dm::cuda
