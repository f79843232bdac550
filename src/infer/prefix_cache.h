// Prefix cache for a hybrid KDA/MLA model (SPEC §5).
//
// MLA keeps every token's latent row, so any cached prefix could be reused; KDA keeps one state
// that cannot be rewound. So a prompt is checkpointed on a token grid of G tokens while it is
// prefilled: the entry for the prefix of length g·G holds every KDA layer's state and conv tails
// after that prefix, and pins the latent pages of its last G tokens (G is a multiple of the page
// size, so these are full pages that no slot ever writes again: sharing needs no copy-on-write).
//
// Entries form a tree (a trie over G-token segments): the entry for g·G tokens has the entry for
// (g−1)·G tokens as parent, so a prefix's pages are its own segment's plus its ancestors'. An
// entry is found by the hash of its whole prefix and then verified token by token (segment by
// segment down the chain), so a hash collision can never serve another prompt's state.
//
// Memory: one arena sized once by the byte budget, holding `capacity` entries of
//   KDA checkpoint (Σ_KDA layers H·K·V + 3·(Kc−1)·H·K floats) + G tokens + G/P page ids,
// and the pinned pages (G/P pages of the decode state's pool) are charged to the budget too.
// Eviction: least recently used leaf first (an entry's children need it as their parent); an
// evicted entry drops its page references, and pages a slot still uses stay with the slot.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/arena.h"
#include "infer/page_pool.h"
#include "io/config.h"
#include "model/kda.h"

namespace dm {

class PrefixCache {
 public:
  // page_bytes: bytes of one latent page over all MLA layers (DecodeState::page_bytes).
  PrefixCache(const ModelConfig& cfg, LatentPagePool& pool, int64_t page_tokens,
              size_t page_bytes, size_t budget_bytes, int64_t grid_tokens);
  // What one entry costs (entry_bytes() of such a cache, the unit the budget is divided into):
  // the KDA checkpoint (kda_checkpoint_bytes), the segment's token ids and page references, its
  // pages, and the bookkeeping. `deltamoe plan` prints it for the CPU and GPU caches.
  static size_t entry_bytes_for(const ModelConfig& cfg, int64_t page_tokens, size_t page_bytes,
                                int64_t grid_tokens);
  // fp32 state and conv tails of every KDA layer: [H, K, V] + 3·[Kc−1, H·K] floats each.
  static size_t kda_checkpoint_bytes(const ModelConfig& cfg);
  ~PrefixCache();  // drops every page reference it holds
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  struct Match {
    int64_t tokens = 0;        // length of the longest cached grid prefix (0: none)
    int32_t entry = -1;        // its entry
    int32_t whole_entry = -1;  // the entry of all n tokens, when n is on the grid and cached
  };
  // The longest cached grid prefix of ids [n] that is shorter than n (at least one token must be
  // left to compute the last logits). Marks the entries on its chain as used now.
  Match match(const int32_t* ids, int64_t n);

  // The KDA checkpoint of `entry` for model layer `layer` (a KDA layer): state [H, K, V], tails
  // [Kc−1, H·K]. Valid for live and reserved entries.
  KdaPrefillCache checkpoint(int32_t entry, int layer) const;
  // pages [tokens / P] = the latent pages of the entry's whole prefix, in position order.
  void prefix_pages(int32_t entry, int32_t* pages) const;

  // A locked entry (and so its ancestors) is never evicted; prefill locks its match while it
  // computes the rest of the prompt, whose checkpoints become the match's children.
  void lock(int32_t entry);
  void unlock(int32_t entry);
  // lock(entry) for the guard's lifetime (entry −1: nothing).
  class LockGuard {
   public:
    LockGuard(PrefixCache& cache, int32_t entry) : cache_(cache), entry_(entry) {
      cache_.lock(entry_);
    }
    ~LockGuard() { cache_.unlock(entry_); }
    LockGuard(const LockGuard&) = delete;
    LockGuard& operator=(const LockGuard&) = delete;

   private:
    PrefixCache& cache_;
    int32_t entry_;
  };

  // Reserves up to `count` entries for new checkpoints (evicting unlocked LRU leaves when the
  // budget is full) and writes their ids to entries_out; returns how many it got. Their KDA
  // buffers (checkpoint()) are then filled by the extend, and each is either committed or
  // abandoned.
  int64_t reserve_entries(int64_t count, int32_t* entries_out);
  // Makes a reserved entry live: the prefix ids [tokens] (tokens = a multiple of G, the parent
  // being the entry of tokens − G, or −1 when tokens == G), with the slot page table
  // slot_pages (its pages of positions [tokens − G, tokens) are retained).
  void commit(int32_t entry, int32_t parent, const int32_t* ids, int64_t tokens,
              const int32_t* slot_pages);
  void abandon(int32_t entry);

  // Evicts the least recently used unlocked leaf; false when there is none.
  bool evict_one();
  // Drops every entry (and its page references).
  void clear();

  int64_t grid_tokens() const { return grid_; }
  int64_t capacity() const { return capacity_; }
  int64_t size() const { return live_; }
  size_t entry_bytes() const { return entry_bytes_; }
  size_t bytes_used() const { return size_t(live_) * entry_bytes_; }
  size_t budget_bytes() const { return budget_; }

  // The entries' KDA checkpoints: one block [capacity, KDA floats per entry] of host memory
  // (the GPU cache pins it so its copies run at DMA speed, infer/cuda/prefix_cache_gpu.h).
  float* kda_storage() const { return kda_; }
  size_t kda_storage_bytes() const { return size_t(capacity_ * kda_floats_) * sizeof(float); }

  struct Stats {
    int64_t lookups = 0, hits = 0, hit_tokens = 0, inserted = 0, evicted = 0;
  };
  const Stats& stats() const { return stats_; }

 private:
  enum class EntryState : int32_t { Free, Reserved, Live };
  struct Entry {
    EntryState state = EntryState::Free;
    int32_t parent = -1, first_child = -1, next_sibling = -1, children = 0;
    int32_t locks = 0;
    int64_t tokens = 0;        // prefix length g·G
    uint64_t prefix_hash = 0;  // prefix_cache_hash of ids [tokens]
    uint64_t last_use = 0;
  };
  int32_t* entry_tokens(int32_t e) const { return tokens_ + int64_t(e) * grid_; }  // [G]
  int32_t* entry_pages(int32_t e) const { return pages_ + int64_t(e) * pages_per_entry_; }
  float* entry_kda(int32_t e) const { return kda_ + int64_t(e) * kda_floats_; }
  void unlink(int32_t e);

  LatentPagePool& pool_;
  int64_t page_tokens_ = 0, grid_ = 0, pages_per_entry_ = 0;
  size_t budget_ = 0, entry_bytes_ = 0;
  int64_t capacity_ = 0, live_ = 0;
  // Per model layer: offset of its checkpoint inside an entry's KDA block (−1: not KDA).
  int64_t num_layers_ = 0, kda_floats_ = 0, state_floats_ = 0, tail_floats_ = 0;
  int64_t* layer_offset_ = nullptr;  // [num_layers]
  Entry* entries_ = nullptr;         // [capacity]
  int32_t* free_ = nullptr;          // [capacity] stack of free entry ids
  int64_t free_count_ = 0;
  int32_t* tokens_ = nullptr;        // [capacity, G]
  int32_t* pages_ = nullptr;         // [capacity, G/P]
  float* kda_ = nullptr;             // [capacity, kda_floats]
  int32_t root_first_child_ = -1;
  uint64_t clock_ = 0;
  Stats stats_;
  Arena arena_;
};

// The GPU prefix cache's grid (infer/cuda/prefix_cache_gpu.h): checkpoints are the chunked
// operator's chunk-start states, and fewer, larger entries keep the copies per prompt few.
inline constexpr int64_t kGpuPrefixGridTokens = 512;

// FNV-1a over token ids, continued from `h` (start: kPrefixCacheHashSeed).
constexpr uint64_t kPrefixCacheHashSeed = 1469598103934665603ull;
uint64_t prefix_cache_hash(uint64_t h, const int32_t* ids, int64_t n);

}  // namespace dm
