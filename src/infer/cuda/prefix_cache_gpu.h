// The prefix cache of the GPU decoder (SPEC §5): the CPU's PrefixCache (infer/prefix_cache.h) as
// the index — a trie over G-token segments, verified token by token, LRU eviction of leaves —
// with the GPU's storage behind it:
//   KDA checkpoints: in the index's host arena (fp32 state and conv tails per KDA layer), copied
//     from the device while the prompt's one chunked pass runs (the operator's chunk-start states,
//     KdaCarry checkpoints) and back into a slot on a hit (GpuDecoder::restore);
//   latent rows: one device "page" per entry = that entry's G tokens of every MLA layer's rows
//     ([mla_layers, G, kv_lora + rope] bf16), copied out of the slot after the pass and into a
//     slot on a hit (GpuDecoder::read_latents / write_latents). The decoder's page tables are
//     static per slot, so rows are copied rather than shared.
// A hit is used when the rest of the prompt is at most kMaxExtendTokens: GpuDecoder::extend()
// attends through the paged decode kernel, whose cost grows with rows × context; a longer rest
// is prefilled from scratch (its checkpoints are still taken).
//
// Memory: the budget is split by the index into entries of (KDA checkpoint + G token ids + one
// page): the KDA part on the host, page-locked so the checkpoint copies run at DMA speed and
// overlap the pass, the page in one device allocation made up front.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "infer/page_pool.h"
#include "infer/prefix_cache.h"
#include "model/cuda/decode_gpu.h"
#include "ops/cuda/device.h"
#include "ops/cuda/graph.h"

namespace dm::cuda {

class GpuPrefixCache {
 public:
  static constexpr int64_t kDefaultGridTokens = kGpuPrefixGridTokens;
  static constexpr int64_t kMaxExtendTokens = 4096;

  // grid_tokens: a positive multiple of 64 (the KDA operator's chunk).
  GpuPrefixCache(const GpuDecoder& decoder, size_t budget_bytes,
                 int64_t grid_tokens = kDefaultGridTokens);
  ~GpuPrefixCache();
  GpuPrefixCache(const GpuPrefixCache&) = delete;
  GpuPrefixCache& operator=(const GpuPrefixCache&) = delete;

  // Prefills slot `slot` of `decoder` with ids [n] (replacing what it held) through the cache;
  // the last position's logits → last_logits [V] (host). Returns the prompt tokens taken from the
  // cache (0: computed from scratch).
  int64_t prefill(GpuDecoder& decoder, int64_t slot, const int32_t* ids, int64_t n,
                  float* last_logits);

  const PrefixCache& index() const { return *index_; }

 private:
  const ModelConfig& config_;
  int64_t grid_ = 0, tail_elems_ = 0, state_elems_ = 0;
  size_t page_elems_ = 0;  // bf16 elements of one page
  Arena pool_arena_;
  LatentPagePool pool_;
  std::unique_ptr<PrefixCache> index_;
  std::unique_ptr<DeviceArena> store_;
  uint16_t* pages_ = nullptr;      // [pool pages, page_elems] bf16 (device)
  // Page-locked host bf16 conv tails of one pass's checkpoints / of a restore (grown on demand).
  uint16_t* staging(size_t elements);
  std::unique_ptr<PinnedBuffer> staging_;
  bool pinned_ = false;  // the index's KDA storage is page-locked (host_register)
};

}  // namespace dm::cuda
