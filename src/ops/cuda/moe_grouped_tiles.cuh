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

// Row tile `tile` of the grouped problem (false: past the last tile). Called by every thread of
// whole warps (all 32 lanes active, the same arguments): each warp walks the offsets 32 experts at
// a time, a lane per expert, with a scan of the tile counts across the lanes and a ballot for the
// one whose tiles hold `tile`. A thread walking all E experts alone took one dependent load and
// compare per expert (~1 µs at E = 32) before its CTA could issue its first copy.
__device__ __forceinline__ bool find_row_tile(const int64_t* offsets, int E, int64_t tile,
                                              GroupedRowTile* out) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x % 32;
  int64_t before = 0;  // tiles of the experts before this group of 32
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    const int64_t begin = e < E ? offsets[e] : 0, end = e < E ? offsets[e + 1] : 0;
    const int64_t tiles = (end - begin + kGroupedTileRows - 1) / kGroupedTileRows;
    int64_t inclusive = tiles;  // Σ tiles of lanes 0 … lane
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t lower = __shfl_up_sync(kAll, inclusive, o);
      if (lane >= o) inclusive += lower;
    }
    const int64_t first = before + inclusive - tiles;
    const unsigned hit = __ballot_sync(kAll, tile >= first && tile < first + tiles);
    if (hit != 0) {
      const int src = __ffs(hit) - 1;
      const int64_t row0 =
          __shfl_sync(kAll, begin, src) + (tile - __shfl_sync(kAll, first, src)) * kGroupedTileRows;
      const int64_t left = __shfl_sync(kAll, end, src) - row0;
      out->expert = e0 + src;
      out->row0 = row0;
      out->rows = int(left < kGroupedTileRows ? left : kGroupedTileRows);
      return true;
    }
    before += __shfl_sync(kAll, inclusive, 31);
  }
  return false;
}

// The persistent kernels' walk (pingpong.cuh): this CTA's tiles j = first, first + step, …, i.e.
// L = blockIdx.x + j·gridDim.x below `tiles` (the row-tile bound × nx), each as its row tile
// (L / nx) and column tile (L mod nx): body(j, tile, column_tile). Stops at the first L past the
// last row tile (later ones lie further). Called by whole warps (find_row_tile).
template <class Body>
__device__ __forceinline__ void for_each_cta_row_tile(const int64_t* offsets, int E, int nx,
                                                      int64_t tiles, int first, int step,
                                                      Body&& body) {
  for (int64_t j = first, L = blockIdx.x + j * gridDim.x; L < tiles;
       j += step, L += step * int64_t(gridDim.x)) {
    GroupedRowTile tile;
    if (!find_row_tile(offsets, E, L / nx, &tile)) break;
    body(j, tile, L % nx);
  }
}

// Σ_e ceil(n_e / 128) ≤ R / 128 + E row tiles (x: 128-column tiles of N); CTAs past the last
// row tile return at once.
inline dim3 grouped_rows_grid(int64_t R, int E, int64_t N) {
  const int64_t row_tiles = (R + kGroupedTileRows - 1) / kGroupedTileRows + E;
  return dim3(unsigned((N + 127) / 128), unsigned(row_tiles));
}

}  // namespace dm::cuda::moe_detail
