// The row tiling shared by the grouped expert kernels over each expert's rows
// (moe_grouped_gemm.cu, moe_grouped_gemm_wgmma.cu): experts own ceil(n_e / 128) consecutive
// 128-row tiles in expert order, and the grid's y index walks them.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace dm::cuda::moe_detail {

constexpr int kGroupedTileRows = 128;

// One CTA's row tile: its expert, first row and rows (≤ 128; one register instead of the end's
// two, which matters to kernels that run at the 128-register cap).
struct GroupedRowTile {
  int expert = 0;
  int64_t row0 = 0;
  int rows = 0;
};

// Row tile `tile` of the grouped problem (false: past the last tile). E is small (≤ 8192), so
// every CTA walks the offsets (L2 hits) instead of reading a host-built table.
__device__ __forceinline__ bool find_row_tile(const int64_t* offsets, int E, int64_t tile,
                                              GroupedRowTile* out) {
  int64_t before = 0;
  for (int e = 0; e < E; ++e) {
    const int64_t begin = offsets[e], end = offsets[e + 1];
    const int64_t tiles = (end - begin + kGroupedTileRows - 1) / kGroupedTileRows;
    if (tile < before + tiles) {
      out->expert = e;
      out->row0 = begin + (tile - before) * kGroupedTileRows;
      const int64_t left = end - out->row0;
      out->rows = int(left < kGroupedTileRows ? left : kGroupedTileRows);
      return true;
    }
    before += tiles;
  }
  return false;
}

// Σ_e ceil(n_e / 128) ≤ R / 128 + E row tiles (x: 128-column tiles of N); CTAs past the last
// row tile return at once.
inline dim3 grouped_rows_grid(int64_t R, int E, int64_t N) {
  const int64_t row_tiles = (R + kGroupedTileRows - 1) / kGroupedTileRows + E;
  return dim3(unsigned((N + 127) / 128), unsigned(row_tiles));
}

}  // namespace dm::cuda::moe_detail
