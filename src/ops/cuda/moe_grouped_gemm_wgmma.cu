// The forward's grouped expert products on Hopper's warpgroup MMA (moe_kernels.h
// launch_grouped_rows_nk_bf16_wgmma): the same problem, grid and output as
// launch_grouped_rows_nk_bf16 (moe_grouped_gemm.cu),
//   Y[r, :] = A[r, :]·W_eᵀ  for r in [offsets[e], offsets[e+1]),  W_e [N, K] (k contiguous),
// bf16 out, fp32 accumulation, but multiplied by wgmma from shared memory instead of mma.sync
// from registers: there the mma.sync loop itself capped the kernel near 270 TFLOP/s (its
// measurements), while wgmma issues a 64 × 128 × 16 product per instruction per warpgroup.
//
// CTA: a 128 × 128 output tile, 256 threads = two warpgroups, warpgroup g owning rows 64g … 64g
// + 63 (64 fp32 accumulators a thread). K steps of 64 through a ring of 3 cp.async stages of
// 32 KB (A rows then W rows, each [128][64] bf16 in the 128-byte-swizzled K-major layout of
// wgmma.cuh): 97 KB a CTA with the alignment slack, 2 CTAs per SM. Per step: wait for its
// copies, make them visible to the async proxy, wait for the previous step's wgmma batch (its
// stage is refilled next), barrier, refill, then four m64n128k16 wgmmas (one per 16-deep slice)
// as one batch left in flight while the next step's copies land.
//
// The default since its first H200 run (2026-11-30, fourteenth session): it passes the tile and
// grouped tests, and takes the gpu_1b training step (B 1, T 4096, recompute off) from
// 119.1/119.5 ms on the mma.sync kernel to 117.9/117.9 (DM_MOE_WGMMA=0 selects mma.sync).
//
// Rows past the expert's end, rows past N and k past K are zero-filled in shared memory; each
// output element has one writer and a fixed summation order: deterministic, no atomics.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/glu.cuh"
#include "ops/cuda/moe.h"
#include "ops/cuda/moe_grouped_tiles.cuh"
#include "ops/cuda/moe_kernels.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/wgmma.cuh"
#include "ops/cuda/wgmma_pipeline.cuh"
#include "ops/cuda/wgmma_rows_epilogue.cuh"

namespace dm::cuda::moe_detail {
namespace {

using attention_detail::cp_async_16;

constexpr int kTileM = kGroupedTileRows, kTileN = 128, kTileK = 64, kStages = 3;
constexpr int kThreads = 256;                     // two warpgroups
constexpr int kRowBytes = kTileK * 2;             // 128: one swizzled row
constexpr int kTileBytes = kTileM * kRowBytes;    // 16 KB: [128][64] bf16
constexpr int kStageBytes = 2 * kTileBytes;       // A rows, then W rows
constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + slack to align the ring to 1 KB
static_assert(kTileN * kRowBytes == kTileBytes, "A and W tiles have the same shape");

// Rows [row0, row_end) (≤ 32·kGroups) of a row-major bf16 matrix with row length K, 64 k a step,
// into a swizzled [32·kGroups][64] tile: the thread owns 16-byte chunk c = tid % 8 of tile rows
// tid / 8 + 32i, i < kGroups. Rows at or past row_end and k at or past K are zero-filled.
// (r + 32i) mod 8 = r mod 8, so the swizzled chunk is the same for all of the thread's rows.
template <int kGroups = 4>
struct SwizzledRowsCopy {
  static constexpr int kRows = 32 * kGroups;
  int64_t offset;     // elements from the matrix to this thread's first chunk of the next step
  int rows_left;      // rows from this thread's first row to row_end
  int k_left;         // K − this thread's first k of the next step
  uint32_t smem_off;  // bytes within the tile of its first chunk

  __device__ __forceinline__ SwizzledRowsCopy(int64_t K, int64_t row0, int64_t row_end) {
    const int r = threadIdx.x / 8, c = threadIdx.x % 8;
    offset = (row0 + r) * K + c * 8;
    const int64_t rows = row_end - row0 - r;
    rows_left = int(rows < kRows ? rows : kRows);
    k_left = int(K < (int64_t(1) << 30) ? K : (int64_t(1) << 30)) - c * 8;
    smem_off = uint32_t(r * kRowBytes + ((c ^ (r & 7)) << 4));
  }
  __device__ __forceinline__ void issue(uint8_t* tile, const __nv_bfloat16* M, int64_t K) {
    const __nv_bfloat16* src = M + offset;
    const bool k_ok = k_left > 0;
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
      const bool valid = k_ok && i * 32 < rows_left;
      cp_async_16(tile + smem_off + i * 32 * kRowBytes, valid ? src : M, valid);
      src += 32 * K;
    }
    offset += kTileK;
    k_left -= kTileK;
  }
};

// The output tile through shared memory (the ring, free once the K loop returns;
// wgmma_rows_epilogue.cuh).
constexpr int kStagedRowBytes = staged_row_bytes<kTileN>();
static_assert(kTileM * kStagedRowBytes <= kStages * kStageBytes, "the tile fits the ring");

// The wide tiles (moe_wgmma_wide, moe.h; kWidth = 256): each warpgroup 64 rows × 256 columns
// (m64n256k16, 128 fp32 accumulators a thread), 4 stages of 48 KB (A [128][64], then W
// [256][64]), one CTA per SM, always staged. Why tried: the 128 × 128 tile loads 512 bytes of
// operands per k for 32 K flops (64 flop/byte), 128 × 256 loads 768 for 64 K (85); measured it
// barely helped (moe.h), so the operand bytes are not the limit.
template <int kWidth>
struct RowsTile {
  static_assert(kWidth == kTileN || kWidth == 2 * kTileN, "128 or 256 columns");
  static constexpr int kStages = kWidth == kTileN ? 3 : 4;
  static constexpr int kStageBytes = kTileBytes + kWidth * kRowBytes;  // A rows, then W rows
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;      // + slack: 1 KB alignment
  static constexpr int kCtasPerSm = kWidth == kTileN ? 2 : 1;
  static_assert(kTileM * staged_row_bytes<kWidth>() <= kStages * kStageBytes,
                "the tile fits the ring");
};

// kOverlap (moe_wgmma_overlap(), moe.h): issue step t's wgmma batch before waiting for step
// t − 1's, then refill t − 1's stage (two barriers a step instead of one). kStaged: the output
// through shared memory (needs N % 8 == 0: 16-byte row pieces), else straight from the fragments.
// kWidth: the tile's columns (RowsTile).
template <bool kOverlap, bool kStaged, int kWidth = kTileN>
__global__ void __launch_bounds__(kThreads, RowsTile<kWidth>::kCtasPerSm)
    grouped_rows_nk_bf16_wgmma_kernel(const __nv_bfloat16* __restrict__ A,
                                      const __nv_bfloat16* __restrict__ W,
                                      const int64_t* __restrict__ offsets, int E, int64_t K,
                                      int64_t N, __nv_bfloat16* __restrict__ Y) {
  using Tile = RowsTile<kWidth>;
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  GroupedRowTile tile;
  if (!find_row_tile(offsets, E, blockIdx.y, &tile)) return;
  const int e = tile.expert, tile_rows = tile.rows;
  const int64_t row0 = tile.row0, n0 = int64_t(blockIdx.x) * kWidth;
  extern __shared__ __align__(1024) uint8_t wgmma_smem_raw[];
  // The ring starts at the first 1024-byte boundary of the shared window (swizzle atoms).
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(wgmma_smem_raw));
  uint8_t* ring = wgmma_smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const __nv_bfloat16* W_e = W + int64_t(e) * N * K;
  SwizzledRowsCopy<> a_copy(K, row0, row0 + tile_rows);
  SwizzledRowsCopy<kWidth / 32> w_copy(K, n0, N);  // rows n0 … n0 + kWidth − 1; past N zero
  const int group = threadIdx.x / 128;
  float acc[kWidth / 2];
#pragma unroll
  for (int j = 0; j < kWidth / 2; ++j) acc[j] = 0.0f;

  const int k_steps = int((K + kTileK - 1) / kTileK);
  // The copies are stateful (each issue advances k): they go out in step order, as the ring asks.
  auto load = [&](int, int slot) {
    uint8_t* stage = ring + slot * Tile::kStageBytes;
    a_copy.issue(stage, A, K);
    w_copy.issue(stage + kTileBytes, W_e, K);
  };
  auto multiply = [&](int slot) {
    const uint8_t* stage = ring + slot * Tile::kStageBytes;
    const uint8_t* a_rows = stage + group * 64 * kRowBytes;
    const uint8_t* w_rows = stage + kTileBytes;
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      const uint64_t desc_a = wgmma::smem_desc_sw128(a_rows + kk * 32);
      const uint64_t desc_w = wgmma::smem_desc_sw128(w_rows + kk * 32);
      if constexpr (kWidth == kTileN)
        wgmma::mma_m64n128k16_bf16(acc, desc_a, desc_w, true);
      else
        wgmma::mma_m64n256k16_bf16(acc, desc_a, desc_w, true);
    }
  };
  wgmma::ring_pipeline<Tile::kStages, kOverlap>(k_steps, load, multiply);

  if constexpr (kStaged) {
    __syncthreads();  // both warpgroups are done with the ring
    store_rows_tile_staged<kWidth>(acc, ring, Y, row0, tile_rows, n0, N, [] { __syncthreads(); });
  } else {
    // acc[j]: row 64·group + 16·warp + lane/4 + 8·((j/2) mod 2), column 8·(j/4) + 2·(lane mod 4)
    // + (j mod 2) of the tile; adjacent columns go out as one bf16 pair.
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < kWidth / 2; j += 2) {
      const int r = 64 * group + 16 * warp + lane / 4 + 8 * ((j / 2) % 2);
      const int64_t col = n0 + 8 * (j / 4) + 2 * (lane % 4);
      if (r >= tile_rows || col >= N) continue;
      *reinterpret_cast<__nv_bfloat162*>(Y + (row0 + r) * N + col) =
          __floats2bfloat162_rn(acc[j], acc[j + 1]);
    }
  }
}

// The gate and up products with the GLU in their epilogue (launch_grouped_gate_up_glu_wgmma):
// a CTA's B tile is 64 rows of W_gate_e (columns n0 … n0 + 63 of F) over 64 rows of W_up_e (the
// same columns), so its 128 × 128 accumulator holds g (tile columns 0–63) and u (64–127) of the
// same 64 columns. The tile goes through shared memory as bf16 (the rounding the separate
// products store), and the store phase reads g and u of one 16-byte piece each, writes
// h = act(g, u) (glu.cuh, the element-wise kernel's function) and, where the backward keeps
// them, g and u. The separate GLU pass read g and u back from HBM and wrote h: 3 × R·F·2 bytes
// and a launch per layer.
constexpr int kGluCols = 64;  // columns of F a CTA covers (g and u: the 128 B rows)

template <bool kOverlap>
__global__ void __launch_bounds__(kThreads, 2)
    grouped_gate_up_glu_wgmma_kernel(const __nv_bfloat16* __restrict__ A,
                                     const __nv_bfloat16* __restrict__ W_gate,
                                     const __nv_bfloat16* __restrict__ W_up,
                                     const int64_t* __restrict__ offsets, int E, int64_t K,
                                     int64_t F, __nv_bfloat16* gate_out, __nv_bfloat16* up_out,
                                     __nv_bfloat16* h, GluKernelParams act) {
  pdl_wait_then_launch_dependents();  // PDL (pdl.h): before any input is read
  GroupedRowTile tile;
  if (!find_row_tile(offsets, E, blockIdx.y, &tile)) return;
  const int e = tile.expert, tile_rows = tile.rows;
  const int64_t row0 = tile.row0, n0 = int64_t(blockIdx.x) * kGluCols;
  extern __shared__ __align__(1024) uint8_t wgmma_smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(wgmma_smem_raw));
  uint8_t* ring = wgmma_smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const int64_t expert_offset = int64_t(e) * F * K;
  SwizzledRowsCopy<> a_copy(K, row0, row0 + tile_rows);
  SwizzledRowsCopy<2> gate_copy(K, n0, F), up_copy(K, n0, F);  // 64 rows each, past F zero
  const int group = threadIdx.x / 128;
  float acc[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) acc[j] = 0.0f;

  const int k_steps = int((K + kTileK - 1) / kTileK);
  auto load = [&](int, int slot) {
    uint8_t* stage = ring + slot * kStageBytes;
    a_copy.issue(stage, A, K);
    gate_copy.issue(stage + kTileBytes, W_gate + expert_offset, K);
    up_copy.issue(stage + kTileBytes + kGluCols * kRowBytes, W_up + expert_offset, K);
  };
  auto multiply = [&](int slot) {
    const uint8_t* stage = ring + slot * kStageBytes;
    const uint8_t* a_rows = stage + group * 64 * kRowBytes;
    const uint8_t* w_rows = stage + kTileBytes;
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk)
      wgmma::mma_m64n128k16_bf16(acc, wgmma::smem_desc_sw128(a_rows + kk * 32),
                                 wgmma::smem_desc_sw128(w_rows + kk * 32), true);
  };
  wgmma::ring_pipeline<kStages, kOverlap>(k_steps, load, multiply);

  // The tile as bf16 into the ring (rows kStagedRowBytes apart, as grouped_rows_nk's epilogue).
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  __syncthreads();  // both warpgroups are done with the ring
#pragma unroll
  for (int j = 0; j < 64; j += 2) {
    const int r = 64 * group + 16 * warp + lane / 4 + 8 * ((j / 2) % 2);
    const int c = 8 * (j / 4) + 2 * (lane % 4);
    *reinterpret_cast<__nv_bfloat162*>(ring + r * kStagedRowBytes + c * 2) =
        __floats2bfloat162_rn(acc[j], acc[j + 1]);
  }
  __syncthreads();
  // 8 pieces of 8 columns a row: thread t takes piece t % 8 of rows t / 8 + 32i; g at byte
  // 16·piece of the staged row, u 128 bytes further.
  const GluInverseBetas inv = glu_inverse_betas(act);
  const int piece = threadIdx.x % 8;
  const int64_t col = n0 + 8 * piece;
  if (col >= F) return;
#pragma unroll
  for (int i = 0; i < kTileM / 32; ++i) {
    const int r = threadIdx.x / 8 + 32 * i;
    if (r >= tile_rows) break;
    const uint8_t* staged = ring + r * kStagedRowBytes + piece * 16;
    const uint4 g = *reinterpret_cast<const uint4*>(staged);
    const uint4 u = *reinterpret_cast<const uint4*>(staged + kGluCols * 2);
    const int64_t at = (row0 + r) * F + col;
    if (gate_out != nullptr) *reinterpret_cast<uint4*>(gate_out + at) = g;
    if (up_out != nullptr) *reinterpret_cast<uint4*>(up_out + at) = u;
    *reinterpret_cast<uint4*>(h + at) = glu_forward_bf16x8(g, u, act, inv);
  }
}

// One warpgroup, one 64 × 128 tile over K = 64, fp32 out: the descriptor, swizzle, fence and
// fragment conventions alone, without the ring or the expert tiling (moe_wgmma_tile_check). A
// and B go to shared memory K-major, or MN-major where kTransA / kTransB (wgmma.cuh's layouts;
// A's 64 rows are one MN atom, B's 128 two), element by element.
template <int kTransA, int kTransB>
__global__ void __launch_bounds__(128)
    wgmma_tile_check_kernel(const __nv_bfloat16* __restrict__ A,
                            const __nv_bfloat16* __restrict__ B, float* __restrict__ C) {
  __shared__ __align__(1024) uint8_t tiles[2 * kTileBytes];  // A (8 KB used), then B
  const int t = threadIdx.x;
  // Byte offset of element (row i, k) of an operand: K-major line i, or MN-major atom i / 64,
  // line k of it.
  auto offset = [](bool mn_major, int i, int k) {
    if (!mn_major) return i * kRowBytes + (((k / 8) ^ (i & 7)) << 4) + (k % 8) * 2;
    const int line = (i / 64) * 64 + k;
    return line * kRowBytes + ((((i % 64) / 8) ^ (k & 7)) << 4) + (i % 8) * 2;
  };
  for (int idx = t; idx < (64 + 128) * 64; idx += 128) {
    const int i = idx / 64, k = idx % 64;  // row of A (i < 64) or of B (i − 64), k
    if (i < 64)
      *reinterpret_cast<__nv_bfloat16*>(tiles + offset(kTransA, i, k)) = A[i * 64 + k];
    else
      *reinterpret_cast<__nv_bfloat16*>(tiles + kTileBytes + offset(kTransB, i - 64, k)) =
          B[(i - 64) * 64 + k];
  }
  wgmma::fence_proxy_async();
  __syncthreads();
  float acc[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) acc[j] = 0.0f;
  wgmma::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint64_t da = kTransA ? wgmma::smem_desc_sw128_mn(tiles + kk * 16 * kRowBytes, 8192)
                                : wgmma::smem_desc_sw128(tiles + kk * 32);
    const uint64_t db =
        kTransB ? wgmma::smem_desc_sw128_mn(tiles + kTileBytes + kk * 16 * kRowBytes, 8192)
                : wgmma::smem_desc_sw128(tiles + kTileBytes + kk * 32);
    wgmma::mma_m64n128k16_bf16<kTransA, kTransB>(acc, da, db, true);
  }
  wgmma::wgmma_commit();
  wgmma::wgmma_wait<0>();
  const int warp = t / 32, lane = t % 32;
#pragma unroll
  for (int j = 0; j < 64; ++j) {
    const int r = 16 * warp + lane / 4 + 8 * ((j / 2) % 2);
    const int col = 8 * (j / 4) + 2 * (lane % 4) + (j % 2);
    C[r * 128 + col] = acc[j];
  }
}

}  // namespace

void launch_grouped_rows_nk_bf16_wgmma(const uint16_t* A, const uint16_t* W,
                                       const int64_t* offsets, int E, int64_t R, int64_t K,
                                       int64_t N, uint16_t* Y, CUstream_st* stream) {
  if (E <= 0 || R <= 0 || N <= 0) return;
  const bool staged =
      moe_wgmma_staged_output() && N % 8 == 0 && reinterpret_cast<uintptr_t>(Y) % 16 == 0;
  auto kernel = moe_wgmma_overlap() ? (staged ? grouped_rows_nk_bf16_wgmma_kernel<true, true>
                                              : grouped_rows_nk_bf16_wgmma_kernel<true, false>)
                                    : (staged ? grouped_rows_nk_bf16_wgmma_kernel<false, true>
                                              : grouped_rows_nk_bf16_wgmma_kernel<false, false>);
  DM_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  DM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     int(cudaSharedmemCarveoutMaxShared)));
  launch_pdl(kernel, grouped_rows_grid(R, E, N), kThreads, kSmemBytes,
             reinterpret_cast<cudaStream_t>(stream), reinterpret_cast<const __nv_bfloat16*>(A),
             reinterpret_cast<const __nv_bfloat16*>(W), offsets, E, K, N,
             reinterpret_cast<__nv_bfloat16*>(Y));
  DM_CUDA_CHECK(cudaGetLastError());
}

bool grouped_rows_wide_applies(int64_t N, const void* Y) {
  return N % 8 == 0 && reinterpret_cast<uintptr_t>(Y) % 16 == 0;
}

void launch_grouped_rows_nk_bf16_wgmma_wide(const uint16_t* A, const uint16_t* W,
                                            const int64_t* offsets, int E, int64_t R, int64_t K,
                                            int64_t N, uint16_t* Y, CUstream_st* stream) {
  if (E <= 0 || R <= 0 || N <= 0) return;
  DM_CHECK(grouped_rows_wide_applies(N, Y), "launch_grouped_rows_nk_bf16_wgmma_wide: N = ", N,
           " (needs N % 8 == 0 and a 16-byte aligned Y)");
  constexpr int kWide = 2 * kTileN;
  using Tile = RowsTile<kWide>;
  auto kernel = moe_wgmma_overlap() ? grouped_rows_nk_bf16_wgmma_kernel<true, true, kWide>
                                    : grouped_rows_nk_bf16_wgmma_kernel<false, true, kWide>;
  DM_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes));
  const dim3 grid(unsigned((N + kWide - 1) / kWide), grouped_rows_grid(R, E, N).y);
  launch_pdl(kernel, grid, kThreads, Tile::kSmemBytes, reinterpret_cast<cudaStream_t>(stream),
             reinterpret_cast<const __nv_bfloat16*>(A), reinterpret_cast<const __nv_bfloat16*>(W),
             offsets, E, K, N, reinterpret_cast<__nv_bfloat16*>(Y));
  DM_CUDA_CHECK(cudaGetLastError());
}

bool grouped_gate_up_glu_applies(int64_t F, const void* gate_out, const void* up_out,
                                 const void* h) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return F % 8 == 0 && aligned(gate_out) && aligned(up_out) && aligned(h);
}

void launch_grouped_gate_up_glu_wgmma(const uint16_t* A, const uint16_t* W_gate,
                                      const uint16_t* W_up, const int64_t* offsets, int E,
                                      int64_t R, int64_t K, int64_t F, uint16_t* gate_out,
                                      uint16_t* up_out, uint16_t* h, const GluKernelParams& act,
                                      CUstream_st* stream) {
  DM_CHECK(grouped_gate_up_glu_applies(F, gate_out, up_out, h) && h != nullptr,
           "launch_grouped_gate_up_glu_wgmma: F = ", F,
           " (a multiple of 8) and 16-byte aligned outputs");
  if (E <= 0 || R <= 0 || F <= 0) return;
  auto kernel = moe_wgmma_overlap() ? grouped_gate_up_glu_wgmma_kernel<true>
                                    : grouped_gate_up_glu_wgmma_kernel<false>;
  DM_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  DM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     int(cudaSharedmemCarveoutMaxShared)));
  const dim3 rows_grid = grouped_rows_grid(R, E, F);
  const dim3 grid(unsigned((F + kGluCols - 1) / kGluCols), rows_grid.y);
  launch_pdl(kernel, grid, kThreads, kSmemBytes, reinterpret_cast<cudaStream_t>(stream),
             reinterpret_cast<const __nv_bfloat16*>(A),
             reinterpret_cast<const __nv_bfloat16*>(W_gate),
             reinterpret_cast<const __nv_bfloat16*>(W_up), offsets, E, K, F,
             reinterpret_cast<__nv_bfloat16*>(gate_out), reinterpret_cast<__nv_bfloat16*>(up_out),
             reinterpret_cast<__nv_bfloat16*>(h), act);
  DM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dm::cuda::moe_detail

namespace dm::cuda {

void moe_wgmma_tile_check(const uint16_t* A, const uint16_t* B, float* C, int transposed) {
  DM_CHECK(transposed >= 0 && transposed <= 2,
           "moe_wgmma_tile_check: transposed must be 0, 1 or 2");
  auto A16 = reinterpret_cast<const __nv_bfloat16*>(A);
  auto B16 = reinterpret_cast<const __nv_bfloat16*>(B);
  if (transposed == 0) moe_detail::wgmma_tile_check_kernel<0, 0><<<1, 128>>>(A16, B16, C);
  if (transposed == 1) moe_detail::wgmma_tile_check_kernel<0, 1><<<1, 128>>>(A16, B16, C);
  if (transposed == 2) moe_detail::wgmma_tile_check_kernel<1, 1><<<1, 128>>>(A16, B16, C);
  DM_CUDA_CHECK(cudaGetLastError());
  DM_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace dm::cuda
