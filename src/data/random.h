// Small deterministic random numbers for the data pipeline. Everything here is fully specified
// (unlike std::uniform_int_distribution / std::shuffle, whose algorithms vary between standard
// libraries), so a seed means the same data stream on every platform and build.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace dm {

// SplitMix64 step: advances `state` and returns the next 64 random bits.
inline uint64_t splitmix64_next(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Mixes several values into one seed (order matters).
inline uint64_t seed_mix(uint64_t a, uint64_t b, uint64_t c = 0) {
  uint64_t s = a;
  uint64_t out = splitmix64_next(s);
  s = out ^ b;
  out = splitmix64_next(s);
  s = out ^ c;
  return splitmix64_next(s);
}

class DataRng {
 public:
  explicit DataRng(uint64_t seed = 0) : state_(seed) {}
  uint64_t next_u64() { return splitmix64_next(state_); }
  // Uniform in [0, bound) by multiply-shift (bias ≤ bound / 2^64, negligible here).
  uint64_t uniform(uint64_t bound) {
    return uint64_t((static_cast<unsigned __int128>(next_u64()) * bound) >> 64);
  }
  int64_t uniform_range(int64_t lo, int64_t hi_inclusive) {
    return lo + int64_t(uniform(uint64_t(hi_inclusive - lo + 1)));
  }
  double uniform_double() { return double(next_u64() >> 11) * 0x1.0p-53; }  // [0, 1)
  bool coin(double p) { return uniform_double() < p; }
  template <typename T>
  const T& pick(const std::vector<T>& v) { return v[size_t(uniform(v.size()))]; }
  template <typename T>
  void shuffle(std::vector<T>& v) {  // Fisher–Yates
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[size_t(uniform(i))]);
  }
  uint64_t state() const { return state_; }
  void set_state(uint64_t s) { state_ = s; }

 private:
  uint64_t state_;
};

}  // namespace dm
