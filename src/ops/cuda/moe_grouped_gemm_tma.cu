// The forward's grouped expert products, warp-specialized on the TMA (moe_kernels.h
// launch_grouped_rows_nk_bf16_tma): the problem, grid, row tiling and output bits of
// launch_grouped_rows_nk_bf16_wgmma (moe_grouped_gemm_wgmma.cu),
//   Y[r, :] = A[r, :]·W_eᵀ  for r in [offsets[e], offsets[e+1]),  W_e [N, K] (k contiguous),
// but fed differently. There every thread issues its share of cp.async copies, waits for them,
// fences and meets the other warpgroup at a CTA barrier every 64-deep k step; the MMAs reached
// 310–400 TFLOP/s against cuBLASLt's 470–630 on the same sizes (docs/benchmarks.md). Here one
// producer thread asks the TMA for each stage's two boxes (A's 128 rows, W_e's kWidth rows; 64 k
// each, 128-byte swizzled as wgmma.cuh's K-major tiles) and the two consumer warpgroups only wait
// on the stage's full barrier, multiply and release it (tma.cuh): no copy instructions, no
// address arithmetic and no CTA-wide barrier in their loop.
//
// CTA: 288 threads = consumer warpgroups 0 and 1 (tile rows 64g … 64g + 63, all kWidth columns)
// + one producer warp (lane 0 issues). kWidth 128: 3 stages of 32 KB, 2 CTAs per SM (≤ 96
// registers a thread: 18 warps over the SM's 4 schedulers), so one CTA's epilogue overlaps the
// other's main loop; kWidth 256: 4 stages of 48 KB, one CTA per SM.
//
// Measured on an H200 (bench_cuda_moe_gemm, 24576 rows over 32 experts, Din 512, F 1024; µs,
// cp.async kernel → this one): gate 73.9 → 72.3 (128 × 256: 74.2), down 65.7 → 66.4 (66.1);
// 64.4 and 62.0 once the tiles were found by a warp scan (moe_grouped_tiles.cuh); cuBLASLt, one
// dense GEMM of the same size: 51.4 and 47.7. The TMA took the copy work off the
// consumers but not the rest of the gap: each CTA still fills its pipeline and drains its
// epilogue unoverlapped except by the other CTA on the SM (K is 8 or 16 steps here).
//
// Rows past the expert's end are loaded (they belong to the next expert, or read as zeros past
// R) but never stored; W rows past N read the next expert's rows (or zeros past E·N) into tile
// columns that are never stored; k past K reads as zeros in both operands. Each output element
// has one writer and the summation order of the cp.async kernel: the same bits.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/moe_grouped_tiles.cuh"
#include "ops/cuda/moe_kernels.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/tma.cuh"
#include "ops/cuda/tma_map.h"
#include "ops/cuda/tma_pipeline.cuh"
#include "ops/cuda/wgmma.cuh"
#include "ops/cuda/wgmma_rows_epilogue.cuh"

namespace dm::cuda::moe_detail {
namespace {

constexpr int kTileM = kGroupedTileRows, kTileK = 64;
constexpr int kConsumerThreads = 256, kThreads = kConsumerThreads + 32;
constexpr int kConsumerWarps = kConsumerThreads / 32;
constexpr int kRowBytes = kTileK * 2;  // 128: one swizzled row

template <int kWidth>
struct TmaRowsTile {
  static_assert(kWidth == 128 || kWidth == 256, "128 or 256 columns");
  static constexpr int kStages = kWidth == 128 ? 3 : 4;
  static constexpr int kABytes = kTileM * kRowBytes;
  static constexpr int kStageBytes = kABytes + kWidth * kRowBytes;  // A rows, then W rows
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;   // + slack: 1 KB alignment
  static constexpr int kCtasPerSm = kWidth == 128 ? 2 : 1;
  static_assert(kTileM * staged_row_bytes<kWidth>() <= kStages * kStageBytes,
                "the staged output tile fits the ring");
};

template <int kWidth>
__global__ void __launch_bounds__(kThreads, TmaRowsTile<kWidth>::kCtasPerSm)
    grouped_rows_nk_bf16_tma_kernel(const __grid_constant__ CUtensorMap a_map,
                                    const __grid_constant__ CUtensorMap w_map,
                                    const int64_t* __restrict__ offsets, int E, int64_t K,
                                    int64_t N, __nv_bfloat16* __restrict__ Y) {
  using Tile = TmaRowsTile<kWidth>;
  constexpr int kStages = Tile::kStages;
  __shared__ tma::RingBarriers<kStages> barriers;
  extern __shared__ __align__(1024) uint8_t tma_smem_raw[];
  const uint32_t raw = tma::shared_address(tma_smem_raw);
  uint8_t* ring = tma_smem_raw + (((raw + 1023u) & ~1023u) - raw);  // swizzle atoms: 1 KB
  if (threadIdx.x == kConsumerThreads) {
    tma::prefetch_map(&a_map);
    tma::prefetch_map(&w_map);
    barriers.init(kConsumerWarps);
  }
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  GroupedRowTile tile;
  const bool has_tile = find_row_tile(offsets, E, blockIdx.y, &tile);
  __syncthreads();  // the barriers are initialised (and every thread may leave now)
  if (!has_tile) return;
  const int64_t n0 = int64_t(blockIdx.x) * kWidth;
  const int k_steps = int((K + kTileK - 1) / kTileK);

  if (threadIdx.x >= kConsumerThreads) {  // the producer warp: its lane 0 issues
    if (threadIdx.x != kConsumerThreads) return;
    const int32_t a_row = int32_t(tile.row0), w_row = int32_t(int64_t(tile.expert) * N + n0);
    tma::produce_ring(barriers, k_steps, Tile::kStageBytes, [&](int t, int slot, uint64_t* full) {
      uint8_t* stage = ring + slot * Tile::kStageBytes;
      tma::load_2d(stage, &a_map, full, t * kTileK, a_row);
      tma::load_2d(stage + Tile::kABytes, &w_map, full, t * kTileK, w_row);
    });
    return;
  }

  const int group = threadIdx.x / 128;
  float acc[kWidth / 2];
#pragma unroll
  for (int j = 0; j < kWidth / 2; ++j) acc[j] = 0.0f;
  tma::consume_ring(
      barriers, k_steps, [](int, int) {},
      [&](int slot) {
        const uint8_t* stage = ring + slot * Tile::kStageBytes;
        const uint64_t desc_a = wgmma::smem_desc_sw128(stage + group * 64 * kRowBytes);
        const uint64_t desc_w = wgmma::smem_desc_sw128(stage + Tile::kABytes);
#pragma unroll
        for (int kk = 0; kk < kTileK / 16; ++kk) {  // 16-deep slices: 32 bytes further along k
          if constexpr (kWidth == 128)
            wgmma::mma_m64n128k16_bf16(acc, wgmma::desc_advance(desc_a, 32 * kk),
                                       wgmma::desc_advance(desc_w, 32 * kk), true);
          else
            wgmma::mma_m64n256k16_bf16(acc, wgmma::desc_advance(desc_a, 32 * kk),
                                       wgmma::desc_advance(desc_w, 32 * kk), true);
        }
      });
  // Every stage has landed (each full barrier was waited) and been read: the ring is the staging.
  auto consumers_sync = [] { tma::named_barrier_sync(1, kConsumerThreads); };
  consumers_sync();
  store_rows_tile_staged<kWidth>(acc, ring, Y, tile.row0, tile.rows, n0, N, consumers_sync);
}

template <int kWidth>
void launch_tma(const uint16_t* A, const uint16_t* W, const int64_t* offsets, int E, int64_t R,
                int64_t K, int64_t N, uint16_t* Y, cudaStream_t stream) {
  using Tile = TmaRowsTile<kWidth>;
  const CUtensorMap a_map =
      tma_map_bf16_rows(A, uint64_t(R), uint64_t(K), uint64_t(K), kTileM, kTileK);
  const CUtensorMap w_map =
      tma_map_bf16_rows(W, uint64_t(E) * uint64_t(N), uint64_t(K), uint64_t(K), kWidth, kTileK);
  auto kernel = grouped_rows_nk_bf16_tma_kernel<kWidth>;
  DM_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes));
  DM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     int(cudaSharedmemCarveoutMaxShared)));
  const dim3 grid(unsigned((N + kWidth - 1) / kWidth), grouped_rows_grid(R, E, N).y);
  launch_pdl(kernel, grid, kThreads, Tile::kSmemBytes, stream, a_map, w_map, offsets, E, K, N,
             reinterpret_cast<__nv_bfloat16*>(Y));
  DM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool grouped_rows_tma_applies(const void* A, const void* W, int64_t K, int64_t N, const void* Y) {
  return tma_map_bf16_applies(A, uint64_t(K)) && tma_map_bf16_applies(W, uint64_t(K)) &&
         N % 8 == 0 && reinterpret_cast<uintptr_t>(Y) % 16 == 0;
}

void launch_grouped_rows_nk_bf16_tma(const uint16_t* A, const uint16_t* W, const int64_t* offsets,
                                     int E, int64_t R, int64_t K, int64_t N, uint16_t* Y, bool wide,
                                     CUstream_st* stream) {
  if (E <= 0 || R <= 0 || N <= 0) return;
  DM_CHECK(grouped_rows_tma_applies(A, W, K, N, Y), "launch_grouped_rows_nk_bf16_tma: K = ", K,
           ", N = ", N, " (both multiples of 8) and 16-byte aligned A, W, Y");
  DM_CHECK(R < (int64_t(1) << 31) && int64_t(E) * N < (int64_t(1) << 31),
           "launch_grouped_rows_nk_bf16_tma: ", R, " rows, ", E, " x ", N,
           " weight rows (TMA coordinates are 32-bit)");
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (wide)
    launch_tma<256>(A, W, offsets, E, R, K, N, Y, s);
  else
    launch_tma<128>(A, W, offsets, E, R, K, N, Y, s);
}

}  // namespace dm::cuda::moe_detail
