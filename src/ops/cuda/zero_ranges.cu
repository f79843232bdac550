// ZeroRangesPlan / zero_ranges (zero_ranges.h): a block per tile of ≤ 64K elements, 16-byte
// stores over the tile's aligned middle, single stores at its ends.
#include <algorithm>

#include "core/error.h"
#include "ops/cuda/device.h"
#include "ops/cuda/zero_ranges.h"

namespace dm::cuda {
namespace {

constexpr int kZeroThreads = 256;

struct ZeroTile {
  int64_t begin;
  int64_t count;
};

__global__ void zero_tiles_kernel(const ZeroTile* tiles, float* data) {
  const ZeroTile t = tiles[blockIdx.x];
  float* p = data + t.begin;
  // Elements before the first 16-byte boundary, then float4s, then the tail.
  const int64_t head =
      std::min<int64_t>(t.count, (16 - (reinterpret_cast<uintptr_t>(p) & 15)) / 4 % 4);
  const int64_t quads = (t.count - head) / 4;
  if (threadIdx.x < head) p[threadIdx.x] = 0.0f;
  float4* q = reinterpret_cast<float4*>(p + head);
  for (int64_t i = threadIdx.x; i < quads; i += kZeroThreads) q[i] = make_float4(0, 0, 0, 0);
  const int64_t tail_at = head + 4 * quads;
  if (tail_at + threadIdx.x < t.count) p[tail_at + threadIdx.x] = 0.0f;
}

}  // namespace

ZeroRangesPlan::ZeroRangesPlan(const std::vector<ZeroRange>& ranges) {
  std::vector<ZeroTile> tiles;
  for (const ZeroRange& r : ranges) {
    DM_CHECK(r.begin >= 0 && r.end >= r.begin, "ZeroRangesPlan: bad range [", r.begin, ", ", r.end,
             ")");
    elements_ += r.end - r.begin;
    for (int64_t at = r.begin; at < r.end; at += kZeroTileElements)
      tiles.push_back({at, std::min<int64_t>(kZeroTileElements, r.end - at)});
  }
  tiles_ = int64_t(tiles.size());
  DM_CHECK(tiles_ < (int64_t(1) << 31), "ZeroRangesPlan: too many tiles (", tiles_, ")");
  table_ = std::make_unique<DeviceArena>(std::max<size_t>(256, tiles.size() * sizeof(ZeroTile)));
  void* device_tiles = table_->alloc_bytes(tiles.size() * sizeof(ZeroTile));
  if (!tiles.empty()) copy_to_device(device_tiles, tiles.data(), tiles.size() * sizeof(ZeroTile));
  device_tiles_ = device_tiles;
}

ZeroRangesPlan::~ZeroRangesPlan() = default;

void zero_ranges(const ZeroRangesPlan& plan, float* data, CUstream_st* stream) {
  if (plan.tiles() == 0) return;
  zero_tiles_kernel<<<unsigned(plan.tiles()), kZeroThreads, 0,
                      reinterpret_cast<cudaStream_t>(stream)>>>(
      static_cast<const ZeroTile*>(plan.device_tiles()), data);
  check_last_error("cuda zero_ranges");
}

}  // namespace dm::cuda
