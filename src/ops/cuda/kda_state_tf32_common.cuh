// Shared pieces of the tf32 state kernels of the chunked KDA (kda_chunk_state_tf32.cu, the
// forward; kda_chunk_state_backward_tf32.cu, the backward): the padded shared layouts' helpers,
// the operand copies and products, and the host-side choices of tile width, kernel and copy path.
// Internal to those two files.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/attention_mma.cuh"  // cp_async_16 / cp_async_commit / cp_async_wait
#include "ops/cuda/kda_backward_detail.cuh"
#include "ops/cuda/kda_common.cuh"
#include "ops/cuda/kda_mma.cuh"
#include "ops/cuda/tma.cuh"

namespace dm::cuda::kda_detail::state_tf32 {

using attention_detail::cp_async_16;
using attention_detail::cp_async_commit;
using attention_detail::cp_async_wait;

constexpr int kWarpCount = kThreads / 32;
constexpr int kPadRowRead = 4;  // A read along its rows: row stride ≡ 4 (mod 8) floats
constexpr int kPadColRead = 8;  // A read down its columns, and B: row stride ≡ 8 (mod 16)

// Next 128-byte boundary after `floats` floats starting at byte `at`; returns the start.
__host__ __device__ inline int carve_floats(int& at, int floats) {
  const int start = at;
  at += (floats * 4 + 127) / 128 * 128;
  return start;
}

// Copies rows × cols fp32 (cols % 4 == 0, 16-byte aligned rows) from global into a padded
// shared tile, 16 bytes per cp.async, by the whole block. Not waited for here.
__device__ __forceinline__ void copy_rows_async(float* dst, int dst_ld, const float* src,
                                                int64_t src_ld, int rows, int cols) {
  const int per_row = cols / 4;
  for (int idx = threadIdx.x; idx < rows * per_row; idx += kThreads) {
    const int r = idx / per_row, c4 = idx % per_row;
    cp_async_16(dst + r * dst_ld + 4 * c4, src + r * src_ld + 4 * c4, true);
  }
}

// Copies a [rows, kCols] fp32 tile between shared (row stride ld) and global (row stride VP),
// 16 bytes per thread and step.
template <int kCols, bool kToGlobal>
__device__ __forceinline__ void copy_tile_f4(float* global, int64_t global_ld, float* shared,
                                             int ld, int rows) {
  constexpr int kPerRow = kCols / 4;
  for (int idx = threadIdx.x; idx < rows * kPerRow; idx += kThreads) {
    const int r = idx / kPerRow, c4 = idx % kPerRow;
    float4* g = reinterpret_cast<float4*>(global + r * global_ld + 4 * c4);
    float4* s = reinterpret_cast<float4*>(shared + r * ld + 4 * c4);
    if constexpr (kToGlobal)
      *g = *s;
    else
      *s = *g;
  }
}

// warp_mma_tf32_two_chains with a row-major A (rows a_rows + r·lda, r < 16, 16-byte aligned; the
// k-step k0 at a_rows + k0) read by ldmatrix: each 8 × 4 fp32 block of A is an 8 × 8 b16
// matrix, so one x4 load gives a lane its four tf32 A fragments, where scalar loads took four
// (ncu: the state kernels issue an instruction every 2 cycles per scheduler with 2 warps each,
// so their steps are instruction-bound). Rows ≡ 4 floats (mod 32) apart keep the 8 rows of a
// matrix on distinct 16-byte bank groups.
template <int kTiles, typename LoadB>
__device__ __forceinline__ void warp_mma_tf32_two_chains_rows(float (&acc)[kTiles][4], int n_tiles,
                                                              int k_begin, int k_end,
                                                              const float* a_rows, int lda,
                                                              LoadB&& load_b) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  // Lanes 8m … 8m+7 address matrix m: rows 8·(m & 1) + (lane & 7), columns k0 + 4·(m >> 1).
  const float* lane_row = a_rows + ((lane & 7) + 8 * ((lane >> 3) & 1)) * lda + 4 * (lane >> 4);
  two_accumulator_chains(acc, k_begin, k_end, [&](float(&into)[kTiles][4], int k0) {
    uint32_t raw[4];
    attention_detail::ldmatrix_x4(raw, lane_row + k0);
    const uint32_t a[4] = {to_tf32(__uint_as_float(raw[0])), to_tf32(__uint_as_float(raw[1])),
                           to_tf32(__uint_as_float(raw[2])), to_tf32(__uint_as_float(raw[3]))};
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
      if (j < n_tiles)
        mma_tf32_16x8x8(into[j], a, to_tf32(load_b(k0 + tq, 8 * j + g)),
                        to_tf32(load_b(k0 + tq + 4, 8 * j + g)));
  });
}

// dims with KP = VP = kStaticDims when that is > 0 (kda_static_dims): every layout offset and
// stride below then folds to a constant.
__device__ __forceinline__ KdaDims static_dims(KdaDims dims, int static_head_dims) {
  if (static_head_dims > 0) dims.KP = dims.VP = static_head_dims;
  return dims;
}

// Waits for phase `parity` of a side's TMA mbarrier. kSolo: thread 0 alone polls and the block
// barrier passes its acquire on to the other threads (where two blocks share an SM, 255 polling
// threads would take issue slots from the other one); else every thread polls, and nothing else
// is implied (no block barrier).
template <bool kSolo>
__device__ __forceinline__ void wait_side(uint64_t* full, uint32_t parity) {
  if constexpr (kSolo) {
    if (threadIdx.x == 0) tma::barrier_wait(full, parity);
    __syncthreads();
  } else {
    tma::barrier_wait(full, parity);
  }
}

// ---- host side (kda_chunk_state_tf32.cu) -------------------------------------------------------
// The column tile (16 or 32; DM_KDA_STATE_COLUMNS forces one).
int state_tile_columns(const KdaDims& d);
// Whether `blocks` blocks fit one round at one block per SM of the current device.
bool state_grid_fits_one_round(int blocks);
// The backward's kernel: staged (true) or registers (DM_KDA_STATE_BACKWARD forces one).
bool state_backward_staged(int blocks);
// DM_KDA_STATE_TMA: 0 = "1" (where measured faster), 1 = "0" (never), 2 = "all".
int state_tma_mode();
// Whether the per-chunk operands may come by TMA (not turned off; the shapes fit the boxes).
bool state_operands_by_tma(const KdaDims& d);

}  // namespace dm::cuda::kda_detail::state_tf32
