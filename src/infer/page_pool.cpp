#include "infer/page_pool.h"

#include "core/error.h"

namespace dm {

size_t LatentPagePool::bookkeeping_bytes(int64_t num_pages) {
  SizeCounter counter;
  counter.add<int32_t>(size_t(num_pages));
  counter.add<int32_t>(size_t(num_pages));
  return counter.bytes;
}

void LatentPagePool::init(int64_t num_pages, Arena& arena) {
  DM_CHECK(num_pages >= 0 && num_pages < (int64_t(1) << 31), "page pool: bad page count ",
           num_pages);
  num_pages_ = num_pages;
  refs_ = arena.alloc<int32_t>(size_t(num_pages));
  free_stack_ = arena.alloc<int32_t>(size_t(num_pages));
  // Lowest page ids on top of the stack, so a fresh pool hands out 0, 1, 2, ...
  for (int64_t i = 0; i < num_pages; ++i) {
    refs_[i] = 0;
    free_stack_[i] = int32_t(num_pages - 1 - i);
  }
  free_count_ = num_pages;
}

int32_t LatentPagePool::take() {
  if (free_count_ == 0) return -1;
  const int32_t page = free_stack_[--free_count_];
  refs_[page] = 1;
  return page;
}

void LatentPagePool::retain(int32_t page) {
  DM_CHECK(page >= 0 && page < num_pages_ && refs_[page] > 0, "page pool: retain of page ", page,
           " which is not held");
  ++refs_[page];
}

void LatentPagePool::drop(int32_t page) {
  DM_CHECK(page >= 0 && page < num_pages_ && refs_[page] > 0, "page pool: drop of page ", page,
           " which is not held");
  if (--refs_[page] == 0) free_stack_[free_count_++] = page;
}

}  // namespace dm
