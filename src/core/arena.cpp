#include "core/arena.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/error.h"

namespace dm {

Arena::~Arena() { std::free(base_); }

Arena::Arena(Arena&& o) noexcept { *this = std::move(o); }

Arena& Arena::operator=(Arena&& o) noexcept {
  if (this != &o) {
    std::free(base_);
    base_ = std::exchange(o.base_, nullptr);
    cap_ = std::exchange(o.cap_, 0);
    used_ = std::exchange(o.used_, 0);
    peak_ = std::exchange(o.peak_, 0);
    name_ = std::move(o.name_);
  }
  return *this;
}

void Arena::reserve(size_t bytes, std::string name) {
  std::free(base_);
  name_ = std::move(name);
  cap_ = round_up(bytes == 0 ? kAlign : bytes);
  base_ = static_cast<uint8_t*>(std::aligned_alloc(kAlign, cap_));
  DM_CHECK(base_ != nullptr, "out of memory reserving ", cap_, " bytes for ", name_);
  std::memset(base_, 0, cap_);
  used_ = peak_ = 0;
}

void* Arena::alloc_bytes(size_t bytes) {
  const size_t b = round_up(bytes);
  DM_CHECK(used_ + b <= cap_, "arena '", name_, "' exhausted: need ", used_ + b, " bytes, have ",
           cap_);
  void* p = base_ + used_;
  used_ += b;
  if (used_ > peak_) peak_ = used_;
  return p;
}

}  // namespace dm
