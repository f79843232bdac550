// The forward's grouped expert products as a persistent, warp-specialized "pingpong" kernel
// (moe_kernels.h launch_grouped_rows_nk_bf16_pingpong, launch_grouped_gate_up_glu_pingpong):
// the problems and output bits of the TMA-fed kernel (moe_grouped_gemm_tma.cu),
//   Y[r, :] = A[r, :]·W_eᵀ  for r in [offsets[e], offsets[e+1]),  W_e [N, K] (k contiguous),
// and of the gate/up products with the GLU in their epilogue (moe_grouped_gemm_wgmma.cu), but
// scheduled so that no SM waits for a pipeline to fill or an epilogue to drain.
//
// Why: the TMA-fed kernel runs one 128 × 128 tile per CTA through a K loop of only 8 or 16 steps
// (Din 512, F 1024 at the gpu_1b shape), so every CTA pays the first loads' latency and its own
// epilogue with its tensor cores idle, hidden only by the other CTA on the SM: ncu had the tensor
// pipe active 57% of the time, and the products ran at 400 TFLOP/s against cuBLASLt's 505.
//
// Here one CTA per SM (grid = min(tiles, SMs)) walks the tiles L = blockIdx.x, + gridDim.x, …
// (row tile L / nx, column tile L mod nx: the CTAs working at one time share row tiles and
// experts in L2). 384 threads: warpgroup 0 is the producer (one lane issues the TMA loads, its
// registers given back with setmaxnreg), warpgroups 1 and 2 the consumers, which take the CTA's
// tiles alternately, each a whole 128 × 128 tile (two m64n128 accumulators, 128 registers). The
// producer streams every tile's k steps through one ring of pingpong::kStages stages in tile
// order, running ahead into the next tile while a consumer is still multiplying or storing, and
// each consumer has its own staging buffer for the epilogue: while one stores its tile, the other
// multiplies. The consumers' K loops take turns in tile order (pingpong.cuh's done barriers), so
// that the ring's barriers are always waited for in position order.
//
// Measured on an H200 (bench_cuda_moe_gemm, 24576 rows over 32 experts, Din 512, F 1024; µs,
// TMA-fed kernel → this one): gate 66.0 → 65.5, down 64.1 → 60.6; gate + up + GLU 169.8 (two
// products and the GLU pass) → 146.2 (one kernel, g and u kept); cuBLASLt, one dense GEMM of the
// gate's size: 54.7. The plain products gain little: at this size the K loop itself (one
// warpgroup's m64n128 MMAs at a time, and the ~110 MB each product moves) is most of the time;
// the long GLU epilogue is what the other consumer now hides.
//
// Rows past the expert's end are loaded but never stored, W rows past N (or past F for the GLU
// tiles) read the next expert's rows or zeros into columns that are never stored, k past K reads
// as zeros in both operands. The k steps and k16 slices accumulate in the order of the other
// kernels: the same bits.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/glu.cuh"
#include "ops/cuda/moe_grouped_tiles.cuh"
#include "ops/cuda/moe_kernels.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/pingpong.cuh"
#include "ops/cuda/tma.cuh"
#include "ops/cuda/tma_map.h"
#include "ops/cuda/wgmma.cuh"

namespace dm::cuda::moe_detail {
namespace {

constexpr int kTileM = kGroupedTileRows, kTileN = 128, kTileK = 64;
constexpr int kRowBytes = kTileK * 2;             // one swizzled line: 64 bf16
constexpr int kABytes = kTileM * kRowBytes;       // 16 KB
constexpr int kStagedRowBytes = pingpong::kStagedBf16RowBytes;
constexpr int kGluCols = 64;  // GLU tiles: 64 columns of F, g and u side by side
static_assert(kABytes + kTileN * kRowBytes == pingpong::kStageBytes, "A and W rows fill a stage");
static_assert(kTileM * kStagedRowBytes == pingpong::kStagingBytes, "the staged tile fits");

struct PingpongArgs {
  const int64_t* offsets;  // DEVICE [E + 1]
  int E;
  int64_t K;
  int64_t N;                // columns of Y (plain) or F (GLU)
  int nx;                   // column tiles
  int64_t tiles;            // row-tile bound × nx
  __nv_bfloat16* Y;         // plain: Y [R, N]; GLU: h [R, F]
  __nv_bfloat16* gate_out;  // GLU: g and u where kept (nullptr: not stored)
  __nv_bfloat16* up_out;
  GluKernelParams act;
};

// kGlu: B rows are 64 of W_gate_e over 64 of W_up_e (w_map and w2_map, 64-row boxes); else
// 128 rows of W_e (w_map, 128-row boxes). The skeleton is pingpong.cuh's.
template <bool kGlu>
__global__ void __launch_bounds__(pingpong::kThreads, 1)
    grouped_rows_pingpong_kernel(const __grid_constant__ CUtensorMap a_map,
                                 const __grid_constant__ CUtensorMap w_map,
                                 const __grid_constant__ CUtensorMap w2_map, const PingpongArgs p) {
  __shared__ pingpong::Barriers barriers;
  extern __shared__ __align__(1024) uint8_t pingpong_smem_raw[];
  const pingpong::Smem smem = pingpong::carve(pingpong_smem_raw);
  const int warpgroup = threadIdx.x / 128;
  if constexpr (kGlu)
    pingpong::start(barriers, &a_map, &w_map, &w2_map);
  else
    pingpong::start(barriers, &a_map, &w_map);
  const int k_steps = int((p.K + kTileK - 1) / kTileK);
  const int64_t cols = kGlu ? kGluCols : kTileN;

  if (warpgroup == 0) {  // the producer: warp 0 walks the tiles, its lane 0 issues
    pingpong::producer_registers();
    if (threadIdx.x >= 32) return;
    pingpong::Cursor at;
    for_each_cta_row_tile(
        p.offsets, p.E, p.nx, p.tiles, 0, 1,
        [&](int64_t, const GroupedRowTile& tile, int64_t column_tile) {
          const int64_t n0 = column_tile * cols;
          if (threadIdx.x == 0) {
            const int32_t a_row = int32_t(tile.row0),
                          w_row = int32_t(int64_t(tile.expert) * p.N + n0);
            for (int t = 0; t < k_steps; ++t)
              pingpong::produce(barriers, smem.ring, at, [&](uint8_t* stage, uint64_t* full) {
                tma::load_2d(stage, &a_map, full, t * kTileK, a_row);
                tma::load_2d(stage + kABytes, &w_map, full, t * kTileK, w_row);
                if constexpr (kGlu)
                  tma::load_2d(stage + kABytes + kGluCols * kRowBytes, &w2_map, full, t * kTileK,
                               w_row);
              });
          }
          __syncwarp();
        });
    return;
  }

  pingpong::consumer_registers();
  const int consumer = warpgroup - 1;  // takes the CTA's tiles j ≡ consumer (mod 2)
  const int wg_thread = threadIdx.x % 128;
  uint8_t* staged = smem.staging(consumer);
  for_each_cta_row_tile(
      p.offsets, p.E, p.nx, p.tiles, consumer, 2,
      [&](int64_t j, const GroupedRowTile& tile, int64_t column_tile) {
        const int64_t n0 = column_tile * cols;
        float acc[2][64];
        pingpong::zero_tile(acc);
        // This tile's steps are ring positions j·k_steps … (the producer's order).
        pingpong::consume_tile(
            barriers, smem.ring, consumer, j, j * k_steps, k_steps, [](int, uint8_t*) {},
            [&](const uint8_t* stage) {
              const uint64_t desc_a = wgmma::smem_desc_sw128(stage);
              const uint64_t desc_w = wgmma::smem_desc_sw128(stage + kABytes);
#pragma unroll
              for (int kk = 0; kk < kTileK / 16; ++kk)  // 16-deep slices: 32 bytes further along k
#pragma unroll
                for (int h = 0; h < 2; ++h)  // rows 64h … 64h + 63: 8 KB further
                  wgmma::mma_m64n128k16_bf16(
                      acc[h], wgmma::desc_advance(desc_a, 64 * kRowBytes * h + 32 * kk),
                      wgmma::desc_advance(desc_w, 32 * kk), true);
            });

        // Epilogue: the tile as bf16 into this consumer's staging (after every thread of it has
        // read the previous tile's), then whole rows out, 16 bytes a lane.
        pingpong::stage_tile_bf16(acc, staged, consumer);
        if constexpr (kGlu) {
          // 8 pieces of 8 columns a row (g at byte 16·piece, u 128 bytes further): thread t takes
          // piece t % 8 of rows t / 8 + 16i.
          const GluInverseBetas inv = glu_inverse_betas(p.act);
          const int piece = wg_thread % 8;
          const int64_t col = n0 + 8 * piece;
          if (col < p.N) {
#pragma unroll 4
            for (int i = 0; i < kTileM / 16; ++i) {
              const int r = wg_thread / 8 + 16 * i;
              if (r >= tile.rows) break;
              const uint8_t* at_staged = staged + r * kStagedRowBytes + piece * 16;
              const uint4 g = *reinterpret_cast<const uint4*>(at_staged);
              const uint4 u = *reinterpret_cast<const uint4*>(at_staged + kGluCols * 2);
              const int64_t at = (tile.row0 + r) * p.N + col;
              if (p.gate_out != nullptr) *reinterpret_cast<uint4*>(p.gate_out + at) = g;
              if (p.up_out != nullptr) *reinterpret_cast<uint4*>(p.up_out + at) = u;
              *reinterpret_cast<uint4*>(p.Y + at) = glu_forward_bf16x8(g, u, p.act, inv);
            }
          }
        } else {
          pingpong::store_staged_rows_bf16(staged, p.Y, tile.row0, tile.rows, n0, p.N);
        }
      });
}

template <bool kGlu>
void launch(const CUtensorMap& a_map, const CUtensorMap& w_map, const CUtensorMap& w2_map,
            PingpongArgs p, int64_t R, cudaStream_t stream) {
  p.tiles = int64_t(grouped_rows_grid(R, p.E, 1).y) * p.nx;
  const int64_t ctas = std::min<int64_t>(p.tiles, device_multiprocessors());
  auto kernel = grouped_rows_pingpong_kernel<kGlu>;
  DM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     pingpong::kSmemBytes));
  launch_pdl(kernel, dim3(unsigned(ctas)), pingpong::kThreads, pingpong::kSmemBytes, stream, a_map,
             w_map, w2_map, p);
  DM_CUDA_CHECK(cudaGetLastError());
}

void check_sizes(const char* who, int E, int64_t R, int64_t weight_rows) {
  DM_CHECK(R < (int64_t(1) << 31) && int64_t(E) * weight_rows < (int64_t(1) << 31), who, ": ", R,
           " rows, ", E, " x ", weight_rows, " weight rows (TMA coordinates are 32-bit)");
}

// The arguments both launchers share: N columns of Y (or F) in tiles of `cols`.
PingpongArgs rows_args(const int64_t* offsets, int E, int64_t K, int64_t N, int64_t cols,
                       uint16_t* Y) {
  PingpongArgs p{};
  p.offsets = offsets;
  p.E = E;
  p.K = K;
  p.N = N;
  p.nx = int((N + cols - 1) / cols);
  p.Y = reinterpret_cast<__nv_bfloat16*>(Y);
  return p;
}

CUtensorMap a_rows_map(const uint16_t* A, int64_t R, int64_t K) {
  return tma_map_bf16_rows(A, uint64_t(R), uint64_t(K), uint64_t(K), kTileM, kTileK);
}

}  // namespace

void launch_grouped_rows_nk_bf16_pingpong(const uint16_t* A, const uint16_t* W,
                                          const int64_t* offsets, int E, int64_t R, int64_t K,
                                          int64_t N, uint16_t* Y, CUstream_st* stream) {
  if (E <= 0 || R <= 0 || N <= 0) return;
  DM_CHECK(grouped_rows_tma_applies(A, W, K, N, Y), "launch_grouped_rows_nk_bf16_pingpong: K = ", K,
           ", N = ", N, " (both multiples of 8) and 16-byte aligned A, W, Y");
  check_sizes("launch_grouped_rows_nk_bf16_pingpong", E, R, N);
  const CUtensorMap w_map =
      tma_map_bf16_rows(W, uint64_t(E) * uint64_t(N), uint64_t(K), uint64_t(K), kTileN, kTileK);
  launch<false>(a_rows_map(A, R, K), w_map, w_map, rows_args(offsets, E, K, N, kTileN, Y), R,
                reinterpret_cast<cudaStream_t>(stream));
}

bool grouped_gate_up_glu_pingpong_applies(const void* A, const void* W_gate, const void* W_up,
                                          int64_t K, int64_t F, const void* gate_out,
                                          const void* up_out, const void* h) {
  return grouped_rows_tma_applies(A, W_gate, K, F, h) && tma_map_bf16_applies(W_up, uint64_t(K)) &&
         grouped_gate_up_glu_applies(F, gate_out, up_out, h);
}

void launch_grouped_gate_up_glu_pingpong(const uint16_t* A, const uint16_t* W_gate,
                                         const uint16_t* W_up, const int64_t* offsets, int E,
                                         int64_t R, int64_t K, int64_t F, uint16_t* gate_out,
                                         uint16_t* up_out, uint16_t* h, const GluKernelParams& act,
                                         CUstream_st* stream) {
  if (E <= 0 || R <= 0 || F <= 0) return;
  DM_CHECK(grouped_gate_up_glu_pingpong_applies(A, W_gate, W_up, K, F, gate_out, up_out, h) &&
               h != nullptr,
           "launch_grouped_gate_up_glu_pingpong: K = ", K, ", F = ", F,
           " (multiples of 8) and 16-byte aligned operands and outputs");
  check_sizes("launch_grouped_gate_up_glu_pingpong", E, R, F);
  const uint64_t weight_rows = uint64_t(E) * uint64_t(F);
  const CUtensorMap gate_map =
      tma_map_bf16_rows(W_gate, weight_rows, uint64_t(K), uint64_t(K), kGluCols, kTileK);
  const CUtensorMap up_map =
      tma_map_bf16_rows(W_up, weight_rows, uint64_t(K), uint64_t(K), kGluCols, kTileK);
  PingpongArgs p = rows_args(offsets, E, K, F, kGluCols, h);
  p.gate_out = reinterpret_cast<__nv_bfloat16*>(gate_out);
  p.up_out = reinterpret_cast<__nv_bfloat16*>(up_out);
  p.act = act;
  launch<true>(a_rows_map(A, R, K), gate_map, up_map, p, R, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace dm::cuda::moe_detail
