// The staged epilogue of the wgmma row products (moe_grouped_gemm_wgmma.cu,
// moe_grouped_gemm_tma.cu): a 128 × kWidth fp32 accumulator tile held by two warpgroups (m64nNk16
// fragments, wgmma.cuh) goes to shared memory as bf16 pairs, rows kWidth·2 + 16 bytes apart (the 8
// rows a store instruction touches fall in distinct banks), then each warp writes whole tile rows
// to global memory, 16 bytes a lane. Stored straight from the fragments, each instruction wrote
// 16-byte pieces of 8 rows (92.8 → 73.4 µs for the gpu_1b gate product on an H200, moe.h).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace dm::cuda::moe_detail {

template <int kWidth>
constexpr int staged_row_bytes() {
  return kWidth * 2 + 16;
}

// Threads 0 … 255 (two warpgroups, warpgroup g owning tile rows 64g … 64g + 63) with `acc` their
// fragments; `staging` ≥ 128 · staged_row_bytes<kWidth>() bytes nobody else uses; sync() a
// barrier over those 256 threads. Writes tile rows r < tile_rows, columns n0 + c < N (N a
// multiple of 8, Y 16-byte aligned) of Y [rows][N] from row0.
template <int kWidth, class Sync>
__device__ __forceinline__ void store_rows_tile_staged(const float (&acc)[kWidth / 2],
                                                       uint8_t* staging, __nv_bfloat16* Y,
                                                       int64_t row0, int tile_rows, int64_t n0,
                                                       int64_t N, Sync&& sync) {
  constexpr int kRowBytes = staged_row_bytes<kWidth>();
  const int group = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  // acc[j]: row 64·group + 16·warp + lane/4 + 8·((j/2) mod 2), column 8·(j/4) + 2·(lane mod 4)
  // + (j mod 2); adjacent columns go in as one bf16 pair.
#pragma unroll
  for (int j = 0; j < kWidth / 2; j += 2) {
    const int r = 64 * group + 16 * warp + lane / 4 + 8 * ((j / 2) % 2);
    const int c = 8 * (j / 4) + 2 * (lane % 4);
    *reinterpret_cast<__nv_bfloat162*>(staging + r * kRowBytes + c * 2) =
        __floats2bfloat162_rn(acc[j], acc[j + 1]);
  }
  sync();
  // kPieces pieces of 16 bytes a row: thread t takes piece t % kPieces of rows t / kPieces +
  // (256 / kPieces)·i (a warp writes 512 contiguous bytes per instruction).
  constexpr int kPieces = kWidth / 8, kRowsApart = 256 / kPieces;
  const int piece = threadIdx.x % kPieces;
  const int64_t col = n0 + 8 * piece;
  if (col >= N) return;
#pragma unroll
  for (int i = 0; i < 128 / kRowsApart; ++i) {
    const int r = threadIdx.x / kPieces + kRowsApart * i;
    if (r >= tile_rows) break;
    *reinterpret_cast<uint4*>(Y + (row0 + r) * N + col) =
        *reinterpret_cast<const uint4*>(staging + r * kRowBytes + piece * 16);
  }
}

}  // namespace dm::cuda::moe_detail
