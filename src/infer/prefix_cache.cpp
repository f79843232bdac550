#include "infer/prefix_cache.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace dm {

uint64_t prefix_cache_hash(uint64_t h, const int32_t* ids, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t v = uint32_t(ids[i]);
    for (int b = 0; b < 4; ++b) {
      h ^= uint64_t(v & 0xffu);
      h *= 1099511628211ull;
      v >>= 8;
    }
  }
  return h;
}

PrefixCache::PrefixCache(const ModelConfig& cfg, LatentPagePool& pool, int64_t page_tokens,
                         size_t page_bytes, size_t budget_bytes, int64_t grid_tokens)
    : pool_(pool), page_tokens_(page_tokens), grid_(grid_tokens), budget_(budget_bytes) {
  DM_CHECK(page_tokens > 0 && grid_tokens > 0 && grid_tokens % page_tokens == 0,
           "prefix cache: the grid (", grid_tokens,
           " tokens) must be a positive multiple of the page size (", page_tokens,
           " tokens), so cached prefixes end on full pages");
  pages_per_entry_ = grid_ / page_tokens_;
  num_layers_ = cfg.num_layers;
  const int64_t HK = int64_t(cfg.kda.num_heads) * cfg.kda.head_dim;
  state_floats_ = HK * cfg.kda.head_dim;                                  // [H, K, V]
  tail_floats_ = std::max<int64_t>(cfg.kda.conv_kernel - 1, 0) * HK;     // [Kc−1, H·K]
  int64_t kda_layers = 0;
  for (int i = 0; i < cfg.num_layers; ++i) kda_layers += cfg.mixers[i] == MixerKind::KDA;
  kda_floats_ = kda_layers * (state_floats_ + 3 * tail_floats_);
  entry_bytes_ = entry_bytes_for(cfg, page_tokens, page_bytes, grid_tokens);
  capacity_ = std::min<int64_t>(int64_t(budget_ / entry_bytes_), int64_t(1) << 24);

  SizeCounter counter;
  counter.add<int64_t>(size_t(num_layers_));
  counter.add<Entry>(size_t(capacity_));
  counter.add<int32_t>(size_t(capacity_));
  counter.add<int32_t>(size_t(capacity_ * grid_));
  counter.add<int32_t>(size_t(capacity_ * pages_per_entry_));
  counter.add<float>(size_t(capacity_ * kda_floats_));
  arena_.reserve(counter.bytes + 4096, "prefix cache");
  layer_offset_ = arena_.alloc<int64_t>(size_t(num_layers_));
  entries_ = arena_.alloc<Entry>(size_t(capacity_));
  free_ = arena_.alloc<int32_t>(size_t(capacity_));
  tokens_ = arena_.alloc<int32_t>(size_t(capacity_ * grid_));
  pages_ = arena_.alloc<int32_t>(size_t(capacity_ * pages_per_entry_));
  kda_ = arena_.alloc<float>(size_t(capacity_ * kda_floats_));
  int64_t offset = 0;
  for (int i = 0; i < cfg.num_layers; ++i) {
    layer_offset_[i] = cfg.mixers[i] == MixerKind::KDA ? offset : -1;
    if (layer_offset_[i] >= 0) offset += state_floats_ + 3 * tail_floats_;
  }
  for (int64_t e = 0; e < capacity_; ++e) {
    entries_[e] = Entry{};
    free_[e] = int32_t(capacity_ - 1 - e);
  }
  free_count_ = capacity_;
}

size_t PrefixCache::kda_checkpoint_bytes(const ModelConfig& cfg) {
  const int64_t HK = int64_t(cfg.kda.num_heads) * cfg.kda.head_dim;
  const int64_t state = HK * cfg.kda.head_dim,
                tail = std::max<int64_t>(cfg.kda.conv_kernel - 1, 0) * HK;
  int64_t kda_layers = 0;
  for (int i = 0; i < cfg.num_layers; ++i) kda_layers += cfg.mixers[i] == MixerKind::KDA;
  return size_t(kda_layers * (state + 3 * tail)) * sizeof(float);
}

size_t PrefixCache::entry_bytes_for(const ModelConfig& cfg, int64_t page_tokens, size_t page_bytes,
                                    int64_t grid_tokens) {
  const int64_t pages = page_tokens > 0 ? grid_tokens / page_tokens : 0;
  return kda_checkpoint_bytes(cfg) + size_t(grid_tokens) * sizeof(int32_t) +
         size_t(pages) * (page_bytes + sizeof(int32_t)) + sizeof(Entry);
}

PrefixCache::~PrefixCache() { clear(); }

void PrefixCache::clear() {
  for (int64_t e = 0; e < capacity_; ++e) {
    Entry& entry = entries_[e];
    if (entry.state == EntryState::Live)
      for (int64_t j = 0; j < pages_per_entry_; ++j) pool_.drop(entry_pages(int32_t(e))[j]);
    if (entry.state != EntryState::Free) free_[free_count_++] = int32_t(e);
    entry = Entry{};
  }
  root_first_child_ = -1;
  live_ = 0;
}

PrefixCache::Match PrefixCache::match(const int32_t* ids, int64_t n) {
  ++stats_.lookups;
  ++clock_;
  Match best;
  uint64_t hash = kPrefixCacheHashSeed;
  int32_t child = root_first_child_;
  // Walk down the tree one G-token segment at a time (the prefix of all n tokens is only
  // noted: a prompt that is exactly a cached prefix need not be checkpointed again).
  for (int64_t tokens = grid_; tokens <= n; tokens += grid_) {
    const int32_t* segment = ids + tokens - grid_;
    hash = prefix_cache_hash(hash, segment, grid_);
    int32_t found = -1;
    for (int32_t e = child; e >= 0; e = entries_[e].next_sibling) {
      if (entries_[e].prefix_hash != hash) continue;
      // The parent chain is verified already; this segment's tokens must match too.
      if (std::memcmp(entry_tokens(e), segment, size_t(grid_) * sizeof(int32_t)) == 0) {
        found = e;
        break;
      }
    }
    if (found < 0) break;
    entries_[found].last_use = clock_;
    if (tokens == n) {
      best.whole_entry = found;
      break;
    }
    best.tokens = tokens;
    best.entry = found;
    child = entries_[found].first_child;
  }
  if (best.tokens > 0) {
    ++stats_.hits;
    stats_.hit_tokens += best.tokens;
  }
  return best;
}

KdaPrefillCache PrefixCache::checkpoint(int32_t entry, int layer) const {
  DM_CHECK(entry >= 0 && entry < capacity_ && entries_[entry].state != EntryState::Free,
           "prefix cache: entry ", entry, " is not held");
  DM_CHECK(layer >= 0 && layer < num_layers_ && layer_offset_[layer] >= 0,
           "prefix cache: layer ", layer, " has no KDA checkpoint");
  float* base = entry_kda(entry) + layer_offset_[layer];
  return KdaPrefillCache{base, base + state_floats_, base + state_floats_ + tail_floats_,
                         base + state_floats_ + 2 * tail_floats_};
}

void PrefixCache::prefix_pages(int32_t entry, int32_t* pages) const {
  for (int32_t e = entry; e >= 0; e = entries_[e].parent) {
    const int64_t first = entries_[e].tokens / page_tokens_ - pages_per_entry_;
    std::copy(entry_pages(e), entry_pages(e) + pages_per_entry_, pages + first);
  }
}

void PrefixCache::lock(int32_t entry) {
  if (entry >= 0) ++entries_[entry].locks;
}
void PrefixCache::unlock(int32_t entry) {
  if (entry >= 0) --entries_[entry].locks;
}

int64_t PrefixCache::reserve_entries(int64_t count, int32_t* entries_out) {
  int64_t got = 0;
  while (got < count) {
    if (free_count_ == 0 && !evict_one()) break;
    const int32_t e = free_[--free_count_];
    entries_[e] = Entry{};
    entries_[e].state = EntryState::Reserved;
    entries_out[got++] = e;
  }
  return got;
}

void PrefixCache::commit(int32_t entry, int32_t parent, const int32_t* ids, int64_t tokens,
                         const int32_t* slot_pages) {
  DM_CHECK(entry >= 0 && entry < capacity_ && entries_[entry].state == EntryState::Reserved,
           "prefix cache: commit of entry ", entry, " which was not reserved");
  DM_CHECK(tokens >= grid_ && tokens % grid_ == 0, "prefix cache: prefix of ", tokens,
           " tokens is not on the ", grid_, "-token grid");
  DM_CHECK((parent < 0) == (tokens == grid_) &&
               (parent < 0 || (entries_[parent].state == EntryState::Live &&
                               entries_[parent].tokens == tokens - grid_)),
           "prefix cache: entry of ", tokens, " tokens needs the entry of ", tokens - grid_,
           " tokens as parent");
  Entry& e = entries_[entry];
  e.state = EntryState::Live;
  e.tokens = tokens;
  // FNV is sequential: the parent's hash continued over this segment is the whole prefix's.
  const uint64_t parent_hash =
      parent < 0 ? kPrefixCacheHashSeed : entries_[parent].prefix_hash;
  e.prefix_hash = prefix_cache_hash(parent_hash, ids + tokens - grid_, grid_);
  e.last_use = ++clock_;
  std::copy(ids + tokens - grid_, ids + tokens, entry_tokens(entry));
  const int64_t first_page = tokens / page_tokens_ - pages_per_entry_;
  for (int64_t j = 0; j < pages_per_entry_; ++j) {
    const int32_t page = slot_pages[first_page + j];
    pool_.retain(page);
    entry_pages(entry)[j] = page;
  }
  e.parent = parent;
  int32_t& head = parent < 0 ? root_first_child_ : entries_[parent].first_child;
  e.next_sibling = head;
  head = entry;
  if (parent >= 0) ++entries_[parent].children;
  ++live_;
  ++stats_.inserted;
}

void PrefixCache::abandon(int32_t entry) {
  if (entry < 0 || entries_[entry].state != EntryState::Reserved) return;
  entries_[entry] = Entry{};
  free_[free_count_++] = entry;
}

void PrefixCache::unlink(int32_t e) {
  const int32_t parent = entries_[e].parent;
  int32_t* link = parent < 0 ? &root_first_child_ : &entries_[parent].first_child;
  while (*link != e) link = &entries_[*link].next_sibling;
  *link = entries_[e].next_sibling;
  if (parent >= 0) --entries_[parent].children;
}

bool PrefixCache::evict_one() {
  int32_t victim = -1;
  for (int64_t i = 0; i < capacity_; ++i) {
    const Entry& e = entries_[i];
    if (e.state != EntryState::Live || e.children > 0 || e.locks > 0) continue;
    if (victim < 0 || e.last_use < entries_[victim].last_use) victim = int32_t(i);
  }
  if (victim < 0) return false;
  unlink(victim);
  for (int64_t j = 0; j < pages_per_entry_; ++j) pool_.drop(entry_pages(victim)[j]);
  entries_[victim] = Entry{};
  free_[free_count_++] = victim;
  --live_;
  ++stats_.evicted;
  return true;
}

}  // namespace dm
