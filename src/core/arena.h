// Arena: one aligned allocation per category (weights, grads, optimizer state, activations,
// caches). Everything else is a view into it. alloc() bumps a pointer; mark()/release() give
// stack-like scratch reuse inside a layer so the hot loop never touches the heap.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace dm {

class Arena {
 public:
  Arena() = default;
  explicit Arena(size_t bytes, std::string name = "arena") { reserve(bytes, std::move(name)); }
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  Arena(Arena&& o) noexcept;
  Arena& operator=(Arena&& o) noexcept;

  // Allocates the backing store (once). Existing views become invalid.
  void reserve(size_t bytes, std::string name = "arena");

  // 64-byte aligned, zero-initialised on reserve only (scratch reuse keeps old contents).
  void* alloc_bytes(size_t bytes);
  template <typename T>
  T* alloc(size_t n) { return static_cast<T*>(alloc_bytes(n * sizeof(T))); }

  size_t mark() const { return used_; }
  void release(size_t mark) { used_ = mark; }
  void reset() { used_ = 0; }

  size_t capacity() const { return cap_; }
  size_t used() const { return used_; }
  size_t peak() const { return peak_; }
  const std::string& name() const { return name_; }

  static constexpr size_t kAlign = 64;
  static size_t round_up(size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

 private:
  uint8_t* base_ = nullptr;
  size_t cap_ = 0, used_ = 0, peak_ = 0;
  std::string name_;
};

// Scope guard: releases everything allocated from `a` during its lifetime.
class ArenaScope {
 public:
  explicit ArenaScope(Arena& a) : a_(a), m_(a.mark()) {}
  ~ArenaScope() { a_.release(m_); }
  ArenaScope(const ArenaScope&) = delete;
  ArenaScope& operator=(const ArenaScope&) = delete;

 private:
  Arena& a_;
  size_t m_;
};

// Counts bytes without allocating: run the same allocation sequence against a SizeCounter to
// size an Arena exactly.
struct SizeCounter {
  size_t bytes = 0;
  template <typename T>
  void add(size_t n) { bytes += Arena::round_up(n * sizeof(T)); }
};

}  // namespace dm
