// Zeroing many disjoint element ranges of one fp32 array in one launch.
//
// The gradient arena's step start (DeviceParamArena::zero_deferred) zeroes every element except
// the store-first ranges: ~250 gaps at gpu_1b, one cudaMemsetAsync each (~1.5 µs of GPU time
// apiece, most of the step's idle start). A ZeroRangesPlan cuts the gaps once into tiles of at
// most kZeroTileElements (the embedding's gradient alone is one 65M-element gap) and keeps the
// tile table in device memory; zero_ranges() is then one kernel, a block per tile.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

struct CUstream_st;

namespace dm::cuda {

class DeviceArena;

struct ZeroRange {
  int64_t begin = 0, end = 0;  // element offsets, begin ≤ end
};

class ZeroRangesPlan {
 public:
  static constexpr int64_t kZeroTileElements = 1 << 16;
  explicit ZeroRangesPlan(const std::vector<ZeroRange>& ranges);
  ~ZeroRangesPlan();
  int64_t tiles() const { return tiles_; }
  int64_t elements() const { return elements_; }
  const void* device_tiles() const { return device_tiles_; }

 private:
  std::unique_ptr<DeviceArena> table_;
  const void* device_tiles_ = nullptr;
  int64_t tiles_ = 0, elements_ = 0;
};

// data[i] = 0 for every i in the plan's ranges; nothing else is touched.
void zero_ranges(const ZeroRangesPlan& plan, float* data, CUstream_st* stream = nullptr);

}  // namespace dm::cuda
