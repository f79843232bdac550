// Reference-counted pool of fixed-size latent-cache pages (SPEC §5 "paged latent cache").
//
// A page is an index 0..num_pages−1; the float rows behind it live in the DecodeState's per-layer
// page buffers, so the pool only does the bookkeeping: a reference count per page and a stack of
// free pages. Holders are sequence slots (through their page tables) and prefix-cache entries;
// a page goes back on the free stack when its last holder drops it. Nothing is ever copied:
// pages a slot shares with the prefix cache are full, and a slot only writes pages it appends.
#pragma once
#include <cstdint>

#include "core/arena.h"

namespace dm {

class LatentPagePool {
 public:
  LatentPagePool() = default;
  // Takes refs [num_pages] and the free stack [num_pages] from `arena` (one allocation per
  // category: the decode cache's). Every page starts free.
  void init(int64_t num_pages, Arena& arena);

  // A free page with one reference, or −1 when none is free.
  int32_t take();
  void retain(int32_t page);
  // Drops one reference; at zero the page is free again.
  void drop(int32_t page);

  int64_t num_pages() const { return num_pages_; }
  int64_t free_pages() const { return free_count_; }
  int32_t refs(int32_t page) const { return refs_[page]; }
  // Bytes `init` takes from its arena.
  static size_t bookkeeping_bytes(int64_t num_pages);

 private:
  int64_t num_pages_ = 0, free_count_ = 0;
  int32_t* refs_ = nullptr;        // [num_pages]
  int32_t* free_stack_ = nullptr;  // [num_pages], the first free_count_ entries are free pages
};

}  // namespace dm
