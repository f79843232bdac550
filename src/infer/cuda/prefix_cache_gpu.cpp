// GpuPrefixCache (prefix_cache_gpu.h): the CPU index over the GPU decoder's slots, the same
// protocol as DecodeState's prefill through the prefix cache (infer/decode.cpp): match, lock the
// match, restore it into the slot, compute the rest while checkpointing the new grid prefixes,
// then publish them (commit) or give them back (abandon) when the pass fails.
#include "infer/cuda/prefix_cache_gpu.h"

#include <algorithm>

#include "core/error.h"
#include "ops/cuda/kda.h"

namespace dm::cuda {

GpuPrefixCache::GpuPrefixCache(const GpuDecoder& decoder, size_t budget_bytes, int64_t grid_tokens)
    : config_(decoder.config()), grid_(grid_tokens) {
  const ModelConfig& c = config_;
  DM_CHECK(grid_tokens > 0 && grid_tokens % kKdaCudaChunk == 0, "GPU prefix cache: the grid (",
           grid_tokens, " tokens) must be a positive multiple of ", kKdaCudaChunk,
           " (the KDA operator's chunk: checkpoints are chunk-start states)");
  const int64_t HK = int64_t(c.kda.num_heads) * c.kda.head_dim;
  state_elems_ = HK * c.kda.head_dim;
  tail_elems_ = std::max(c.kda.conv_kernel - 1, 0) * HK;
  page_elems_ = size_t(decoder.mla_layers()) * size_t(grid_) * size_t(decoder.latent_width());
  // One page per entry: page_tokens = the grid.
  index_ = std::make_unique<PrefixCache>(c, pool_, grid_, page_elems_ * sizeof(uint16_t),
                                         budget_bytes, grid_);
  const int64_t pages = std::max<int64_t>(index_->capacity(), 1);
  pool_arena_.reserve(LatentPagePool::bookkeeping_bytes(pages) + 256, "GPU prefix cache pages");
  pool_.init(pages, pool_arena_);
  store_ = std::make_unique<DeviceArena>(
      size_t(pages) * std::max<size_t>(page_elems_, 1) * sizeof(uint16_t) + 256);
  pages_ = store_->alloc<uint16_t>(size_t(pages) * std::max<size_t>(page_elems_, 1));
  // Pageable memory made the checkpoint copies of an 8192-token prompt cost 37 ms on gpu_1b (an
  // H200, 2026-11-30), 70% of the pass itself.
  pinned_ = host_register(index_->kda_storage(), index_->kda_storage_bytes());
}

GpuPrefixCache::~GpuPrefixCache() {
  if (pinned_) host_unregister(index_->kda_storage());
}

uint16_t* GpuPrefixCache::staging(size_t elements) {
  const size_t bytes = std::max<size_t>(elements, 1) * sizeof(uint16_t);
  if (!staging_ || staging_->bytes() < bytes) {
    staging_.reset();
    staging_ = std::make_unique<PinnedBuffer>(bytes);
  }
  return staging_->as<uint16_t>();
}

int64_t GpuPrefixCache::prefill(GpuDecoder& decoder, int64_t slot, const int32_t* ids, int64_t n,
                                float* last_logits) {
  const ModelConfig& c = config_;
  PrefixCache& cache = *index_;
  const PrefixCache::Match hit = cache.match(ids, n);
  // Tokens restored from the cache: the match, unless the rest is too long for extend() (then
  // the whole prompt is computed; the match still parents the new checkpoints).
  const int64_t restored = n - hit.tokens <= kMaxExtendTokens ? hit.tokens : 0;
  // The match is the parent of this prompt's new entries: keep it while we work.
  const PrefixCache::LockGuard lock(cache, hit.entry);

  decoder.release(slot);
  const int L = c.num_layers;
  if (restored > 0) {
    std::vector<int32_t> pages(static_cast<size_t>(hit.tokens / grid_));
    cache.prefix_pages(hit.entry, pages.data());
    for (size_t j = 0; j < pages.size(); ++j)
      decoder.write_latents(slot, int64_t(j) * grid_, grid_,
                            pages_ + size_t(pages[j]) * page_elems_);
    // The index keeps conv tails in fp32 (the CPU's layout); the decoder's are bf16, and every
    // value came from bf16, so the round trip is exact.
    uint16_t* restore_tails = staging(size_t(L) * 3 * size_t(tail_elems_));
    for (int i = 0; i < L; ++i) {
      if (c.mixers[i] != MixerKind::KDA) continue;
      const KdaPrefillCache from = cache.checkpoint(hit.entry, i);
      const float* tails[3] = {from.conv_tail_q, from.conv_tail_k, from.conv_tail_v};
      for (int b = 0; b < 3; ++b)
        for (int64_t e = 0; e < tail_elems_; ++e)
          restore_tails[(size_t(i) * 3 + size_t(b)) * size_t(tail_elems_) + size_t(e)] =
              float_to_bf16(tails[b][e]);
    }
    decoder.restore(
        slot, hit.tokens, [&](int layer) { return cache.checkpoint(hit.entry, layer).state; },
        [&](int layer, int b) {
          return restore_tails + (size_t(layer) * 3 + size_t(b)) * size_t(tail_elems_);
        });
  }

  // Checkpoints at the grid points after the match, up to and including n (unless all n tokens
  // are a cached prefix already).
  const int64_t new_checkpoints = hit.whole_entry >= 0 ? 0 : n / grid_ - hit.tokens / grid_;
  std::vector<int32_t> pending(static_cast<size_t>(std::max<int64_t>(new_checkpoints, 0)));
  const int64_t got = cache.reserve_entries(int64_t(pending.size()), pending.data());
  std::vector<int64_t> tokens(static_cast<size_t>(got));
  for (int64_t j = 0; j < got; ++j) tokens[size_t(j)] = hit.tokens + (j + 1) * grid_;
  uint16_t* pass_tails = staging(size_t(got) * size_t(L) * 3 * size_t(tail_elems_));
  auto tail_at = [&](int64_t j, int layer, int b) {
    return pass_tails +
           ((size_t(j) * size_t(L) + size_t(layer)) * 3 + size_t(b)) * size_t(tail_elems_);
  };
  KdaCheckpointTargets targets;
  targets.count = int(got);
  targets.tokens = tokens.data();
  targets.state = [&](int j, int layer) {
    return cache.checkpoint(pending[size_t(j)], layer).state;
  };
  targets.tail = [&](int j, int layer, int b) { return tail_at(j, layer, b); };
  try {
    if (restored > 0)
      decoder.extend(slot, ids + restored, n - restored, last_logits, &targets);
    else
      decoder.prefill(slot, ids, n, last_logits, false, &targets);
  } catch (...) {
    for (int64_t j = 0; j < got; ++j) cache.abandon(pending[size_t(j)]);
    decoder.release(slot);
    throw;
  }

  // Publish: the tails into the index's fp32 checkpoints, each segment's latent rows into a page
  // of its own, then the entry (commit retains the page; our reference from take() is dropped).
  std::vector<int32_t> page_of(size_t(n / grid_ + 1), -1);
  int32_t parent = hit.entry;
  for (int64_t j = 0; j < got; ++j) {
    for (int i = 0; i < L; ++i) {
      if (c.mixers[i] != MixerKind::KDA) continue;
      const KdaPrefillCache to = cache.checkpoint(pending[size_t(j)], i);
      float* tails[3] = {to.conv_tail_q, to.conv_tail_k, to.conv_tail_v};
      for (int b = 0; b < 3; ++b) {
        const uint16_t* from = tail_at(j, i, b);
        for (int64_t e = 0; e < tail_elems_; ++e) tails[b][e] = bf16_to_float(from[e]);
      }
    }
    const int32_t page = pool_.take();
    DM_CHECK(page >= 0, "GPU prefix cache: no free page (", pool_.num_pages(), " pages for ",
             cache.capacity(), " entries)");
    const int64_t end = tokens[size_t(j)];
    decoder.read_latents(slot, end - grid_, grid_, pages_ + size_t(page) * page_elems_);
    page_of[size_t(end / grid_ - 1)] = page;
    cache.commit(pending[size_t(j)], parent, ids, end, page_of.data());
    pool_.drop(page);
    parent = pending[size_t(j)];
  }
  return restored;
}

}  // namespace dm::cuda
