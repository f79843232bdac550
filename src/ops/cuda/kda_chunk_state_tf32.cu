// The two sequential stages of the chunked KDA on tensor cores (tf32 mma.sync, fp32 state),
// with the next chunk's operands copied in (cp.async) while the current chunk computes:
//   forward state (kda_chunk_state_tf32):    V' = U − W·S;  S ← Diag(e^γ)·S + Keᵀ·V'
//   backward state (kda_chunk_state_backward_tf32), chunks in reverse:
//     dV' = Ke·dS' + Pᵀ·dO;  dS = Diag(e^γ)·dS' + Qdᵀ·dO − Wᵀ·dV'
// Same algebra, workspace and outputs as the fp32 CUDA-core kernels (kda_chunk_state_kernel in
// kda_chunk.cu, kda_chunk_state_backward_kernel in kda_chunk_backward.cu), which stay the fp32
// path and the reference.
//
// Why this shape: both stages walk 128+ chunks one after another per (head, column tile), so a
// step's time is its latency. The old kernels loaded each chunk's [64, 128] operands from global
// memory at the top of the step (several dependent round trips). Here every step has two phases
// that read disjoint operand sets (value side, state side); while one phase computes, the other
// phase's operands of the next chunk are in flight, so the loads leave the critical path. The
// products run as tf32 m16n8k8 with fp32 accumulation: tf32's 10-bit mantissa beats the bf16
// operands of the earlier wmma state kernel, and the state itself never leaves fp32.
//
// Grid: VP / kCols column tiles × B·H, 256 threads, sequential over chunks inside a block.
// kCols = 32, or 16 when 32-column tiles would leave a quarter of the SMs idle (4·B·H·VP/32 <
// 3·SM count) or do not divide VP. Shared rows are padded so the fragment reads hit distinct banks:
// row-read A operands by 4 floats, column-read (transposed) A and all B operands by 8.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "core/env.h"
#include "core/error.h"
#include "ops/cuda/attention_mma.cuh"  // cp_async_16 / cp_async_commit / cp_async_wait
#include "ops/cuda/device.h"
#include "ops/cuda/kda.h"
#include "ops/cuda/kda_backward_detail.cuh"
#include "ops/cuda/kda_common.cuh"
#include "ops/cuda/kda_mma.cuh"
#include "ops/cuda/tma.cuh"
#include "ops/cuda/tma_map.h"

namespace dm::cuda {
namespace kda_detail {
namespace {

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
    if constexpr (kToGlobal) *g = *s;
    else *s = *g;
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

// ---------------------------------------------------------------------------------------------
// Forward state.
struct ForwardStateLayout {
  int w, u, key_to_end, decay, state, value_new, total;  // byte offsets
};
template <int kCols>
__host__ __device__ inline ForwardStateLayout forward_state_layout(const KdaDims& d) {
  ForwardStateLayout l;
  int at = 0;
  l.w = carve_floats(at, kChunk * (d.KP + kPadRowRead));
  l.u = carve_floats(at, kChunk * (kCols + kPadColRead));
  l.key_to_end = carve_floats(at, kChunk * (d.KP + kPadColRead));
  l.decay = carve_floats(at, d.KP);
  l.state = carve_floats(at, d.KP * (kCols + kPadColRead));
  l.value_new = carve_floats(at, kChunk * (kCols + kPadColRead));
  l.total = at;
  return l;
}

// Tensor maps of the forward state kernel's per-chunk operands (kTma): boxes as wide as the
// padded shared rows (tma_map_f32_rows), so each operand arrives in one copy, padding included.
struct ForwardStateMaps {
  CUtensorMap w;           // [chunk-heads·C, KP], boxes [C, KP + 4]
  CUtensorMap u;           // [chunk-heads·C, VP], boxes [C, kCols + 8] at column e0
  CUtensorMap key_to_end;  // [chunk-heads·C, KP], boxes [C, KP + 8]
  CUtensorMap decay;       // [chunk-heads, KP], boxes [1, KP]
};

// kTma: each side's operands come by TMA, issued by thread 0 and completing on one mbarrier per
// side (a phase per chunk), instead of 16-byte cp.async by every thread (~8 copies a thread and
// side, with their address arithmetic, in a step that is issue-bound).
template <int kCols, int kStaticDims, bool kTma>
__global__ void __launch_bounds__(kThreads)
    kda_chunk_state_tf32_kernel(const float* s0, float* sT, KdaDims dims, KdaForwardWorkspace ws,
                                const __grid_constant__ ForwardStateMaps maps) {
  const KdaDims d = static_dims(dims, kStaticDims);
  extern __shared__ __align__(128) unsigned char shared_bytes[];
  const ForwardStateLayout l = forward_state_layout<kCols>(d);
  float* w_s = reinterpret_cast<float*>(shared_bytes + l.w);  // [C, KP+4]   W
  float* u_s = reinterpret_cast<float*>(shared_bytes + l.u);  // [C, ldt]    U tile
  float* key_to_end_s = reinterpret_cast<float*>(shared_bytes + l.key_to_end);  // [C, KP+8] Ke
  float* decay_s = reinterpret_cast<float*>(shared_bytes + l.decay);            // [KP]        e^γ
  float* state_s = reinterpret_cast<float*>(shared_bytes + l.state);          // [KP, ldt]   S tile
  float* value_new_s = reinterpret_cast<float*>(shared_bytes + l.value_new);  // [C, ldt]  V'
  constexpr int ldt = kCols + kPadColRead;
  constexpr int kHalfTiles = kCols / 16;  // phase 1: a warp's 8-column tiles (half the width)
  constexpr int kRowTiles = kCols / 8;    // phase 2: a warp's 8-column tiles (the whole width)
  const int ldw = d.KP + kPadRowRead, ldke = d.KP + kPadColRead;
  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t bh = blockIdx.y, first_chunk = bh * d.num_chunks;
  const int e0 = blockIdx.x * kCols;

  __shared__ __align__(8) uint64_t side_full[2];  // kTma: value side, state side landed
  auto load_value_side = [&](int64_t n) {  // W and the U tile of chunk n
    const int64_t ch = first_chunk + n;
    if constexpr (kTma) {  // thread 0 only
      tma::barrier_arrive_expect_bytes(&side_full[0], uint32_t(kChunk * (ldw + ldt) * 4));
      tma::load_2d(w_s, &maps.w, &side_full[0], 0, int32_t(ch * kChunk));
      tma::load_2d(u_s, &maps.u, &side_full[0], e0, int32_t(ch * kChunk));
    } else {
      copy_rows_async(w_s, ldw, ws.w + ch * kChunk * d.KP, d.KP, kChunk, d.KP);
      copy_rows_async(u_s, ldt, ws.u + ch * kChunk * d.VP + e0, d.VP, kChunk, kCols);
    }
  };
  auto load_state_side = [&](int64_t n) {  // Ke and e^γ of chunk n
    const int64_t ch = first_chunk + n;
    if constexpr (kTma) {  // thread 0 only
      tma::barrier_arrive_expect_bytes(&side_full[1], uint32_t((kChunk * ldke + d.KP) * 4));
      tma::load_2d(key_to_end_s, &maps.key_to_end, &side_full[1], 0, int32_t(ch * kChunk));
      tma::load_2d(decay_s, &maps.decay, &side_full[1], 0, int32_t(ch));
    } else {
      copy_rows_async(key_to_end_s, ldke, ws.key_to_end + ch * kChunk * d.KP, d.KP, kChunk, d.KP);
      copy_rows_async(decay_s, 0, ws.decay_whole + ch * d.KP, 0, 1, d.KP);
    }
  };

  for (int idx = tid; idx < d.KP * kCols; idx += kThreads) {
    const int row = idx / kCols, col = idx % kCols, e = e0 + col;
    state_s[row * ldt + col] =
        (s0 != nullptr && row < d.K && e < d.V) ? s0[(bh * d.K + row) * d.V + e] : 0.0f;
  }
  if constexpr (kTma) {
    // One phase of each side's barrier per chunk: chunk n waits for parity n & 1.
    if (tid == 0) {
      tma::barrier_init(&side_full[0], 1);
      tma::barrier_init(&side_full[1], 1);
      tma::barrier_init_fence();
      if (d.num_chunks > 0) {
        load_value_side(0);
        load_state_side(0);
      }
    }
    __syncthreads();  // the barriers initialised, the initial S in place
  } else {
    // Commit groups alternate value side / state side, one pair per chunk (empty past the
    // end), so "all but the newest group done" is always the side about to be used.
    if (d.num_chunks > 0) load_value_side(0);
    cp_async_commit();
    if (d.num_chunks > 0) load_state_side(0);
    cp_async_commit();
  }

  const int r0_value = 16 * (warp >> 1), col0_value = (warp & 1) * (kCols / 2);
  for (int64_t n = 0; n < d.num_chunks; ++n) {
    const int64_t ch = first_chunk + n;
    if constexpr (kTma) {
      tma::barrier_wait(&side_full[0], uint32_t(n & 1));  // value side of chunk n landed
    } else {
      cp_async_wait<1>();
      __syncthreads();  // value side of chunk n landed; S is the chunk-start state
    }
    copy_tile_f4<kCols, true>(ws.states + ch * d.KP * d.VP + e0, d.VP, state_s, ldt, d.KP);

    // Phase 1: V' = U − W·S (warp: rows r0_value.., half the columns).
    {
      float acc[kHalfTiles][4];
      zero_tiles(acc);
      warp_mma_tf32_two_chains_rows(
          acc, kHalfTiles, 0, d.KP, w_s + r0_value * ldw, ldw,
          [&](int c, int nn) { return state_s[c * ldt + col0_value + nn]; });
      float* value_new = ws.value_new + ch * kChunk * d.VP + e0;
      for_each_element<kHalfTiles>(kHalfTiles, r0_value, col0_value,
                                   [&](int j, int e4, int i, int col) {
                                     const float value = u_s[i * ldt + col] - acc[j][e4];
                                     value_new_s[i * ldt + col] = value;
                                     value_new[i * d.VP + col] = value;
                                   });
    }
    __syncthreads();  // W, U free; V' complete
    if constexpr (kTma) {
      if (tid == 0 && n + 1 < d.num_chunks) load_value_side(n + 1);
      tma::barrier_wait(&side_full[1], uint32_t(n & 1));  // state side of chunk n landed
    } else {
      if (n + 1 < d.num_chunks) load_value_side(n + 1);
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();  // state side of chunk n landed
    }

    // Phase 2: S ← Diag(e^γ)·S + Keᵀ·V' (warp: a 16-row block of S, every column).
    for (int mt = warp; mt < d.KP / 16; mt += kWarpCount) {
      const int r0 = 16 * mt;
      float acc[kRowTiles][4];
      for_each_element<kRowTiles>(kRowTiles, r0, 0, [&](int j, int e4, int row, int col) {
        acc[j][e4] = decay_s[row] * state_s[row * ldt + col];
      });
      warp_mma_tf32_two_chains(
          acc, kRowTiles, 0, kChunk, [&](int r, int i) { return key_to_end_s[i * ldke + r0 + r]; },
          [&](int i, int nn) { return value_new_s[i * ldt + nn]; });
      for_each_element<kRowTiles>(kRowTiles, r0, 0, [&](int j, int e4, int row, int col) {
        state_s[row * ldt + col] = acc[j][e4];
      });
    }
    __syncthreads();  // Ke, e^γ free; S is the next chunk's start state
    if constexpr (kTma) {
      if (tid == 0 && n + 1 < d.num_chunks) load_state_side(n + 1);
    } else {
      if (n + 1 < d.num_chunks) load_state_side(n + 1);
      cp_async_commit();
    }
  }
  if constexpr (!kTma) cp_async_wait<0>();
  if (sT != nullptr)
    for (int idx = tid; idx < d.K * kCols; idx += kThreads) {
      const int row = idx / kCols, col = idx % kCols, e = e0 + col;
      if (e < d.V) sT[(bh * d.K + row) * d.V + e] = state_s[row * ldt + col];
    }
}

// ---------------------------------------------------------------------------------------------
// The two backward state kernels below share their value side: per chunk n, Ke [C, KP+4] and P
// [C, C+8] in shared memory and the dO tile [C, kCols+8] (bf16, zero past the chunk end and V),
// and phase 1, dV' = Ke·dS' + Pᵀ·dO.

// Copies chunk n's Ke, P and dO tile in by 16-byte cp.async, by the whole block; not committed.
template <int kCols>
__device__ __forceinline__ void load_backward_value_side(const KdaDims& d,
                                                         const KdaForwardWorkspace& ws,
                                                         const uint16_t* d_o, int64_t b, int64_t h,
                                                         int64_t first_chunk, int e0, int64_t n,
                                                         float* key_to_end_s, float* lower_s,
                                                         uint16_t* d_out_tile) {
  constexpr int ldt = kCols + kPadColRead, ldp = kChunk + kPadColRead;
  const int64_t ch = first_chunk + n;
  copy_rows_async(key_to_end_s, d.KP + kPadRowRead, ws.key_to_end + ch * kChunk * d.KP, d.KP,
                  kChunk, d.KP);
  copy_rows_async(lower_s, ldp, ws.lower_query_key + ch * kChunk * kChunk, kChunk, kChunk, kChunk);
  const int c = kda_chunk_length(d, n);
  constexpr int kPieces = kCols / 8;  // 16-byte pieces per row
  for (int idx = threadIdx.x; idx < kChunk * kPieces; idx += kThreads) {
    const int i = idx / kPieces, e = e0 + 8 * (idx % kPieces);
    const bool valid = i < c && e < d.V;
    const uint16_t* src = valid ? d_o + kda_token_row(d, b, h, n * kChunk + i) * d.V + e : d_o;
    cp_async_16(d_out_tile + i * ldt + (e - e0), src, valid);
  }
}

// Phase 1: dV' = Ke·dS' + Pᵀ·dO into d_value_new_s [C, kCols+8] (warp: rows 16·(warp/2), half
// the columns; Pᵀ is upper triangular: k from the warp's first row).
template <int kCols>
__device__ __forceinline__ void backward_value_product(const KdaDims& d, const float* key_to_end_s,
                                                       const float* lower_s, const float* d_state_s,
                                                       const uint16_t* d_out,
                                                       float* d_value_new_s) {
  constexpr int ldt = kCols + kPadColRead, ldp = kChunk + kPadColRead, kHalfTiles = kCols / 16;
  const int ldke = d.KP + kPadRowRead, warp = threadIdx.x >> 5;
  const int r0_value = 16 * (warp >> 1), col0_value = (warp & 1) * (kCols / 2);
  float acc[kHalfTiles][4];
  zero_tiles(acc);
  warp_mma_tf32_two_chains_rows(
      acc, kHalfTiles, 0, d.KP, key_to_end_s + r0_value * ldke, ldke,
      [&](int c, int nn) { return d_state_s[c * ldt + col0_value + nn]; });
  warp_mma_tf32_two_chains(
      acc, kHalfTiles, r0_value, kChunk,
      [&](int r, int j) { return lower_s[j * ldp + r0_value + r]; },
      [&](int j, int nn) {
        return __uint_as_float(uint32_t(d_out[j * ldt + col0_value + nn]) << 16);
      });
  for_each_element<kHalfTiles>(
      kHalfTiles, r0_value, col0_value,
      [&](int j, int e4, int i, int col) { d_value_new_s[i * ldt + col] = acc[j][e4]; });
}

// ---------------------------------------------------------------------------------------------
// Backward state (bf16 dO, V % 8 == 0 so its rows copy in 16-byte pieces).
struct BackwardStateLayout {
  int key_to_end, lower_query_key, d_out0, d_out1, query_decay, w, decay, d_state, d_value_new,
      total;  // byte offsets
};
template <int kCols>
__host__ __device__ inline BackwardStateLayout backward_state_layout(const KdaDims& d) {
  BackwardStateLayout l;
  int at = 0;
  l.key_to_end = carve_floats(at, kChunk * (d.KP + kPadRowRead));
  l.lower_query_key = carve_floats(at, kChunk * (kChunk + kPadColRead));
  l.d_out0 = carve_floats(at, kChunk * (kCols + kPadColRead) / 2);  // bf16
  l.d_out1 = carve_floats(at, kChunk * (kCols + kPadColRead) / 2);
  l.query_decay = carve_floats(at, kChunk * (d.KP + kPadColRead));
  l.w = carve_floats(at, kChunk * (d.KP + kPadColRead));
  l.decay = carve_floats(at, d.KP);
  l.d_state = carve_floats(at, d.KP * (kCols + kPadColRead));
  l.d_value_new = carve_floats(at, kChunk * (kCols + kPadColRead));
  l.total = at;
  return l;
}

// Tensor maps of the staged backward state kernel's per-chunk operands (kTma), as the
// forward's: boxes as wide as the padded shared rows.
struct BackwardStateMaps {
  CUtensorMap key_to_end;   // [chunk-heads·C, KP], boxes [C, KP + 4]
  CUtensorMap lower;        // [chunk-heads·C, C], boxes [C, C + 8]
  CUtensorMap d_out;        // dO [B][T][H][V] bf16, boxes of C tokens × (kCols + 8) of a head
  CUtensorMap query_decay;  // [chunk-heads·C, KP], boxes [C, KP + 8]
  CUtensorMap w;            // [chunk-heads·C, KP], boxes [C, KP + 8]
  CUtensorMap decay;        // [chunk-heads, KP], boxes [1, KP]
};

template <int kCols, int kStaticDims, bool kTma>
__global__ void __launch_bounds__(kThreads)
    kda_chunk_state_backward_tf32_kernel(const uint16_t* d_o, const float* dsT, float* ds0,
                                         KdaDims dims, KdaForwardWorkspace ws, float* d_states,
                                         const __grid_constant__ BackwardStateMaps maps) {
  const KdaDims d = static_dims(dims, kStaticDims);
  extern __shared__ __align__(128) unsigned char shared_bytes[];
  const BackwardStateLayout l = backward_state_layout<kCols>(d);
  float* key_to_end_s = reinterpret_cast<float*>(shared_bytes + l.key_to_end);  // [C, KP+4] Ke
  float* lower_s = reinterpret_cast<float*>(shared_bytes + l.lower_query_key);  // [C, C+8]  P
  uint16_t* d_out_s[2] = {reinterpret_cast<uint16_t*>(shared_bytes + l.d_out0),  // [C, ldt] dO
                          reinterpret_cast<uint16_t*>(shared_bytes + l.d_out1)};
  float* query_decay_s = reinterpret_cast<float*>(shared_bytes + l.query_decay);  // [C, KP+8] Qd
  float* w_s = reinterpret_cast<float*>(shared_bytes + l.w);                      // [C, KP+8] W
  float* decay_s = reinterpret_cast<float*>(shared_bytes + l.decay);              // [KP]
  float* d_state_s = reinterpret_cast<float*>(shared_bytes + l.d_state);          // [KP, ldt] dS'
  float* d_value_new_s = reinterpret_cast<float*>(shared_bytes + l.d_value_new);  // [C, ldt]  dV'
  constexpr int ldt = kCols + kPadColRead, kRowTiles = kCols / 8;
  const int ldkc = d.KP + kPadColRead;
  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t bh = blockIdx.y, b = bh / d.H, h = bh % d.H, first_chunk = bh * d.num_chunks;
  const int e0 = blockIdx.x * kCols;

  __shared__ __align__(8) uint64_t side_full[2];  // kTma: value side, state side landed
  auto load_value_side = [&](int64_t n) {         // Ke, P and the dO tile of chunk n
    if constexpr (kTma) {                         // thread 0 only
      const int64_t ch = first_chunk + n;
      constexpr int kValueBytes = kChunk * (kChunk + kPadColRead) * 4 + kChunk * ldt * 2;
      tma::barrier_arrive_expect_bytes(&side_full[0],
                                       uint32_t(kValueBytes + kChunk * (d.KP + kPadRowRead) * 4));
      tma::load_2d(key_to_end_s, &maps.key_to_end, &side_full[0], 0, int32_t(ch * kChunk));
      tma::load_2d(lower_s, &maps.lower, &side_full[0], 0, int32_t(ch * kChunk));
      tma::load_4d(d_out_s[n & 1], &maps.d_out, &side_full[0], e0, int32_t(h), int32_t(n * kChunk),
                   int32_t(b));
    } else {
      load_backward_value_side<kCols>(d, ws, d_o, b, h, first_chunk, e0, n, key_to_end_s, lower_s,
                                      d_out_s[n & 1]);
    }
  };
  auto load_state_side = [&](int64_t n) {  // Qd, W and e^γ of chunk n
    const int64_t ch = first_chunk + n;
    if constexpr (kTma) {  // thread 0 only
      tma::barrier_arrive_expect_bytes(&side_full[1], uint32_t((2 * kChunk * ldkc + d.KP) * 4));
      tma::load_2d(query_decay_s, &maps.query_decay, &side_full[1], 0, int32_t(ch * kChunk));
      tma::load_2d(w_s, &maps.w, &side_full[1], 0, int32_t(ch * kChunk));
      tma::load_2d(decay_s, &maps.decay, &side_full[1], 0, int32_t(ch));
    } else {
      copy_rows_async(query_decay_s, ldkc, ws.query_decay + ch * kChunk * d.KP, d.KP, kChunk, d.KP);
      copy_rows_async(w_s, ldkc, ws.w + ch * kChunk * d.KP, d.KP, kChunk, d.KP);
      copy_rows_async(decay_s, 0, ws.decay_whole + ch * d.KP, 0, 1, d.KP);
    }
  };

  for (int idx = tid; idx < d.KP * kCols; idx += kThreads) {
    const int row = idx / kCols, col = idx % kCols, e = e0 + col;
    d_state_s[row * ldt + col] =
        (dsT != nullptr && row < d.K && e < d.V) ? dsT[(bh * d.K + row) * d.V + e] : 0.0f;
  }
  const int64_t last = d.num_chunks - 1;
  if constexpr (kTma) {
    // One phase of each side's barrier per chunk, chunks in reverse: chunk n waits for parity
    // (last − n) & 1.
    if (tid == 0) {
      tma::barrier_init(&side_full[0], 1);
      tma::barrier_init(&side_full[1], 1);
      tma::barrier_init_fence();
      if (last >= 0) {
        load_value_side(last);
        load_state_side(last);
      }
    }
    __syncthreads();  // the barriers initialised, dS' in place
  } else {
    if (last >= 0) load_value_side(last);
    cp_async_commit();
    if (last >= 0) load_state_side(last);
    cp_async_commit();
  }

  for (int64_t n = last; n >= 0; --n) {
    const int64_t ch = first_chunk + n;
    const uint32_t parity = uint32_t((last - n) & 1);
    const uint16_t* d_out = d_out_s[n & 1];
    auto d_out_at = [&](int i, int col) {
      return __uint_as_float(uint32_t(d_out[i * ldt + col]) << 16);
    };
    if constexpr (kTma) {
      tma::barrier_wait(&side_full[0], parity);  // value side of chunk n landed
    } else {
      cp_async_wait<1>();
      __syncthreads();  // value side of chunk n landed; dS' is the gradient after chunk n
    }
    copy_tile_f4<kCols, true>(d_states + ch * d.KP * d.VP + e0, d.VP, d_state_s, ldt, d.KP);
    backward_value_product<kCols>(d, key_to_end_s, lower_s, d_state_s, d_out, d_value_new_s);
    __syncthreads();  // Ke, P free (this dO buffer stays: phase 2 reads it)
    if constexpr (kTma) {
      if (tid == 0 && n > 0) load_value_side(n - 1);
      tma::barrier_wait(&side_full[1], parity);  // state side of chunk n landed
    } else {
      if (n > 0) load_value_side(n - 1);
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();  // state side of chunk n landed
    }

    // Phase 2: dS = Diag(e^γ)·dS' + Qdᵀ·dO − Wᵀ·dV' (warp: a 16-row block, every column).
    for (int mt = warp; mt < d.KP / 16; mt += kWarpCount) {
      const int r0 = 16 * mt;
      float acc[kRowTiles][4];
      for_each_element<kRowTiles>(kRowTiles, r0, 0, [&](int j, int e4, int row, int col) {
        acc[j][e4] = decay_s[row] * d_state_s[row * ldt + col];
      });
      warp_mma_tf32_two_chains(
          acc, kRowTiles, 0, kChunk, [&](int r, int i) { return query_decay_s[i * ldkc + r0 + r]; },
          [&](int i, int nn) { return d_out_at(i, nn); });
      warp_mma_tf32_two_chains(
          acc, kRowTiles, 0, kChunk, [&](int r, int i) { return -w_s[i * ldkc + r0 + r]; },
          [&](int i, int nn) { return d_value_new_s[i * ldt + nn]; });
      for_each_element<kRowTiles>(kRowTiles, r0, 0, [&](int j, int e4, int row, int col) {
        d_state_s[row * ldt + col] = acc[j][e4];
      });
    }
    __syncthreads();  // Qd, W, e^γ free
    if constexpr (kTma) {
      if (tid == 0 && n > 0) load_state_side(n - 1);
    } else {
      if (n > 0) load_state_side(n - 1);
      cp_async_commit();
    }
  }
  if constexpr (!kTma) cp_async_wait<0>();
  if (ds0 != nullptr)
    for (int idx = tid; idx < d.K * kCols; idx += kThreads) {
      const int row = idx / kCols, col = idx % kCols, e = e0 + col;
      if (e < d.V) ds0[(bh * d.K + row) * d.V + e] += d_state_s[row * ldt + col];
    }
}

// ---------------------------------------------------------------------------------------------
// Backward state with phase 2's A operands in registers (picked by state_backward_staged below
// when the staged kernel above would need more than one round). The staged kernel holds Ke, P, Qd
// and W in shared memory (163 KB at 32 columns, 147 KB at 16): one block per SM, so the 384 (head,
// column tile) sequences of (1,8192,96,128) run in three rounds of 132, the 256 of (2,16384,16,128)
// in two. But each warp of phase 2 owns 16 rows of dS, and reads exactly the matching 16 columns of
// Qd and W (its A operands Qdᵀ, Wᵀ): no other warp needs them. Here each warp loads those fragments
// straight into registers: Qd's (32 floats and two decays per lane) right after its phase 2, so
// that they land during the next step's wait and phase 1; W's (32) after phase 1, landing while the
// Qd product runs (all 64 live through phase 1 spilled at the 128-register bound). Shared memory
// keeps Ke, P, dO ×2, dS', dV' (91 KB at 32 columns, 77 KB at 16): two blocks per SM.
struct BackwardStateRegsLayout {
  int key_to_end, lower_query_key, d_out0, d_out1, d_state, d_value_new, total;  // byte offsets
};
template <int kCols>
__host__ __device__ inline BackwardStateRegsLayout backward_state_regs_layout(const KdaDims& d) {
  BackwardStateRegsLayout l;
  int at = 0;
  l.key_to_end = carve_floats(at, kChunk * (d.KP + kPadRowRead));
  l.lower_query_key = carve_floats(at, kChunk * (kChunk + kPadColRead));
  l.d_out0 = carve_floats(at, kChunk * (kCols + kPadColRead) / 2);  // bf16
  l.d_out1 = carve_floats(at, kChunk * (kCols + kPadColRead) / 2);
  l.d_state = carve_floats(at, d.KP * (kCols + kPadColRead));
  l.d_value_new = carve_floats(at, kChunk * (kCols + kPadColRead));
  l.total = at;
  return l;
}

template <int kCols, int kStaticDims>
__global__ void __launch_bounds__(kThreads, 2)
    kda_chunk_state_backward_regs_kernel(const uint16_t* d_o, const float* dsT, float* ds0,
                                         KdaDims dims, KdaForwardWorkspace ws, float* d_states) {
  const KdaDims d = static_dims(dims, kStaticDims);
  extern __shared__ __align__(128) unsigned char shared_bytes[];
  const BackwardStateRegsLayout l = backward_state_regs_layout<kCols>(d);
  float* key_to_end_s = reinterpret_cast<float*>(shared_bytes + l.key_to_end);   // [C, KP+4] Ke
  float* lower_s = reinterpret_cast<float*>(shared_bytes + l.lower_query_key);   // [C, C+8]  P
  uint16_t* d_out_s[2] = {reinterpret_cast<uint16_t*>(shared_bytes + l.d_out0),  // [C, ldt] dO
                          reinterpret_cast<uint16_t*>(shared_bytes + l.d_out1)};
  float* d_state_s = reinterpret_cast<float*>(shared_bytes + l.d_state);          // [KP, ldt] dS'
  float* d_value_new_s = reinterpret_cast<float*>(shared_bytes + l.d_value_new);  // [C, ldt]  dV'
  constexpr int ldt = kCols + kPadColRead, kRowTiles = kCols / 8, kSteps = kChunk / 8;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int64_t bh = blockIdx.y, b = bh / d.H, h = bh % d.H, first_chunk = bh * d.num_chunks;
  const int e0 = blockIdx.x * kCols;
  const int r0 = 16 * warp;  // phase 2: this warp's rows of dS (KP ≤ 128: one block per warp)
  const bool has_rows = r0 < d.KP;

  auto load_value_side = [&](int64_t n) {  // Ke, P and the dO tile of chunk n
    load_backward_value_side<kCols>(d, ws, d_o, b, h, first_chunk, e0, n, key_to_end_s, lower_s,
                                    d_out_s[n & 1]);
  };
  // Phase 2's A fragments of chunk n (tf32 m16n8k8 layout, kda_mma.cuh): step ks holds
  // (row r0 + g, token 8ks + tq), (r0 + g + 8, 8ks + tq), (r0 + g, 8ks + tq + 4),
  // (r0 + g + 8, 8ks + tq + 4) of Qdᵀ and Wᵀ, i.e. Qd[token][row], W[token][row]; and e^γ of
  // rows r0 + g, r0 + g + 8.
  float query_frag[kSteps][4], w_frag[kSteps][4], decay[2];
  auto load_fragments = [&](float(&frag)[kSteps][4], const float* matrix, int64_t n) {
    const float* rows = matrix + (first_chunk + n) * kChunk * d.KP + r0 + g;
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      const int i0 = (8 * ks + tq) * d.KP, i1 = i0 + 4 * d.KP;
      frag[ks][0] = rows[i0], frag[ks][1] = rows[i0 + 8];
      frag[ks][2] = rows[i1], frag[ks][3] = rows[i1 + 8];
    }
  };
  auto load_query_side = [&](int64_t n) {  // Qd's fragments and e^γ of chunk n
    if (!has_rows) return;
    load_fragments(query_frag, ws.query_decay, n);
    decay[0] = ws.decay_whole[(first_chunk + n) * d.KP + r0 + g];
    decay[1] = ws.decay_whole[(first_chunk + n) * d.KP + r0 + g + 8];
  };

  for (int idx = tid; idx < d.KP * kCols; idx += kThreads) {
    const int row = idx / kCols, col = idx % kCols, e = e0 + col;
    d_state_s[row * ldt + col] =
        (dsT != nullptr && row < d.K && e < d.V) ? dsT[(bh * d.K + row) * d.V + e] : 0.0f;
  }
  const int64_t last = d.num_chunks - 1;
  if (last >= 0) {
    load_value_side(last);
    load_query_side(last);
  }
  cp_async_commit();

  for (int64_t n = last; n >= 0; --n) {
    const int64_t ch = first_chunk + n;
    const uint16_t* d_out = d_out_s[n & 1];
    auto d_out_at = [&](int i, int col) {
      return __uint_as_float(uint32_t(d_out[i * ldt + col]) << 16);
    };
    cp_async_wait<0>();
    __syncthreads();  // value side of chunk n landed; dS' is the gradient after chunk n
    copy_tile_f4<kCols, true>(d_states + ch * d.KP * d.VP + e0, d.VP, d_state_s, ldt, d.KP);
    backward_value_product<kCols>(d, key_to_end_s, lower_s, d_state_s, d_out, d_value_new_s);
    __syncthreads();  // dV' complete; Ke, P free (this dO buffer stays: phase 2 reads it)
    if (n > 0) load_value_side(n - 1);
    cp_async_commit();

    // Phase 2: dS = Diag(e^γ)·dS' + Qdᵀ·dO − Wᵀ·dV' over the warp's 16 rows, every column; its
    // rows of dS' are its own, so no barrier separates it from the next step's fragment loads.
    if (has_rows) {
      load_fragments(w_frag, ws.w, n);
      float acc[kRowTiles][4];
      for_each_element<kRowTiles>(kRowTiles, r0, 0, [&](int j, int e4, int row, int col) {
        acc[j][e4] = decay[e4 >> 1] * d_state_s[row * ldt + col];
      });
#pragma unroll
      for (int ks = 0; ks < kSteps; ++ks) {
        const int k0 = 8 * ks + tq;
        const uint32_t a[4] = {to_tf32(query_frag[ks][0]), to_tf32(query_frag[ks][1]),
                               to_tf32(query_frag[ks][2]), to_tf32(query_frag[ks][3])};
#pragma unroll
        for (int j = 0; j < kRowTiles; ++j)
          mma_tf32_16x8x8(acc[j], a, to_tf32(d_out_at(k0, 8 * j + g)),
                          to_tf32(d_out_at(k0 + 4, 8 * j + g)));
      }
      if (n > 0) load_query_side(n - 1);  // Qd's registers are free
#pragma unroll
      for (int ks = 0; ks < kSteps; ++ks) {
        const int k0 = 8 * ks + tq;
        const uint32_t a[4] = {to_tf32(-w_frag[ks][0]), to_tf32(-w_frag[ks][1]),
                               to_tf32(-w_frag[ks][2]), to_tf32(-w_frag[ks][3])};
#pragma unroll
        for (int j = 0; j < kRowTiles; ++j)
          mma_tf32_16x8x8(acc[j], a, to_tf32(d_value_new_s[k0 * ldt + 8 * j + g]),
                          to_tf32(d_value_new_s[(k0 + 4) * ldt + 8 * j + g]));
      }
      for_each_element<kRowTiles>(kRowTiles, r0, 0, [&](int j, int e4, int row, int col) {
        d_state_s[row * ldt + col] = acc[j][e4];
      });
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the last phase 2's rows of dS, from every warp
  if (ds0 != nullptr)
    for (int idx = tid; idx < d.K * kCols; idx += kThreads) {
      const int row = idx / kCols, col = idx % kCols, e = e0 + col;
      if (e < d.V) ds0[(bh * d.K + row) * d.V + e] += d_state_s[row * ldt + col];
    }
}

// 32-column tiles when they divide VP and still give most SMs a block; else 16. Env
// DM_KDA_STATE_COLUMNS=16|32 forces one (tests cover both widths on small shapes; 32 needs
// VP % 32 == 0 and falls back to 16 otherwise).
int state_tile_columns(const KdaDims& d) {
  switch (env_choice("DM_KDA_STATE_COLUMNS", {"auto", "16", "32"})) {
    case 1:
      return 16;
    case 2:
      return d.VP % 32 == 0 ? 32 : 16;
    default:
      break;
  }
  int device = 0, sms = 0;
  DM_CUDA_CHECK(cudaGetDevice(&device));
  DM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // 32-column tiles when they still fill three quarters of the SMs: each block reads the whole
  // chunk's W and Ke (or Ke, P, Qd, W backward) whatever its width, so wider tiles move less.
  // Measured (H200, 132 SMs): (2,16384,16,128), 128 blocks of 32 columns against 256 of 16:
  // fwd 2.14 against 2.37 ms, fwd+bwd 10.26 against 10.75; (1,8192,16,128), 64 blocks of 32
  // against 128 of 16: 0.80 against 0.67, 3.27 against 2.89.
  return (d.VP % 32 == 0 && 4 * d.B * d.H * (d.VP / 32) >= 3 * sms) ? 32 : 16;
}

// Which backward state kernel: the staged one (Qd, W in shared memory, one block per SM) when
// the whole grid fits one round at one block per SM, else the one holding them in registers (two
// per SM). Measured on the H200, fwd+bwd: (1,8192,16,128), 128 blocks, staged 2.89 ms against
// 3.01 with registers (each step is shorter when Qd and W come from shared memory);
// (2,16384,16,128), 256 blocks, 10.95 against 10.77; (1,8192,96,128), 384 blocks, 15.25 against
// 14.93. DM_KDA_STATE_BACKWARD=staged|regs (read at each call: the tests run both) forces one.
bool state_grid_fits_one_round(int blocks) {
  int device = 0, sms = 0;
  DM_CUDA_CHECK(cudaGetDevice(&device));
  DM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return blocks <= sms;
}
bool state_backward_staged(int blocks) {
  switch (env_choice("DM_KDA_STATE_BACKWARD", {"auto", "staged", "regs"})) {
    case 1:
      return true;
    case 2:
      return false;
    default:
      break;
  }
  return state_grid_fits_one_round(blocks);
}

// Whether the state kernels' operands come by TMA (DM_KDA_STATE_TMA=0, read at each call, turns
// it off): the padded rows must fit one box (KP + 8 ≤ 256 floats) and the workspace's rows the
// TMA's coordinate range.
bool state_operands_by_tma(const KdaDims& d) {
  const bool enabled = env_flag("DM_KDA_STATE_TMA", true);
  const int64_t rows = d.B * d.H * d.num_chunks * kChunk;
  return enabled && d.KP + kPadColRead <= 256 && d.KP % 4 == 0 && d.VP % 4 == 0 &&
         rows < (int64_t(1) << 31);
}

template <int kCols>
void launch_forward_state(const float* s0, float* sT, const KdaDims& d,
                          const KdaForwardWorkspace& ws, cudaStream_t stream) {
  const int shared = forward_state_layout<kCols>(d).total;
  // By TMA where the grid is one round at one block per SM, as in training: (1,4096,16,128)
  // fwd+bwd 1.35 -> 1.27 ms with both state kernels on it, (2,16384,16,128) forward 2.11 -> 2.05;
  // but the 384 blocks of (1,8192,96,128), two per SM, forward 3.00 -> 3.08 ms (H200).
  const bool by_tma =
      state_operands_by_tma(d) && state_grid_fits_one_round(int(d.VP / kCols * d.B * d.H));
  ForwardStateMaps maps{};
  if (by_tma) {
    const uint64_t rows = uint64_t(d.B * d.H * d.num_chunks * kChunk);
    maps.w = tma_map_f32_rows(ws.w, rows, d.KP, d.KP, kChunk, d.KP + kPadRowRead);
    maps.u = tma_map_f32_rows(ws.u, rows, d.VP, d.VP, kChunk, kCols + kPadColRead);
    maps.key_to_end = tma_map_f32_rows(ws.key_to_end, rows, d.KP, d.KP, kChunk, d.KP + kPadColRead);
    maps.decay = tma_map_f32_rows(ws.decay_whole, rows / kChunk, d.KP, d.KP, 1, d.KP);
  }
  auto launch = [&](auto kernel) {
    DM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
    kernel<<<dim3(unsigned(d.VP / kCols), unsigned(d.B * d.H)), kThreads, size_t(shared), stream>>>(
        s0, sT, d, ws, maps);
  };
  const bool fixed = kda_static_dims(d) == kKdaStaticDims;
  if (by_tma && fixed)
    launch(kda_chunk_state_tf32_kernel<kCols, kKdaStaticDims, true>);
  else if (by_tma)
    launch(kda_chunk_state_tf32_kernel<kCols, 0, true>);
  else if (fixed)
    launch(kda_chunk_state_tf32_kernel<kCols, kKdaStaticDims, false>);
  else
    launch(kda_chunk_state_tf32_kernel<kCols, 0, false>);
  check_last_error("cuda kda_chunk_forward (state, tf32 tensor cores)");
}

template <int kCols>
void launch_backward_state(const uint16_t* d_o, const float* dsT, float* ds0, const KdaDims& d,
                           const KdaForwardWorkspace& ws, float* d_states, cudaStream_t stream) {
  const int shared = backward_state_layout<kCols>(d).total;
  const bool by_tma = state_operands_by_tma(d) && d.V % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(d_o) % 16 == 0 && d.B * d.T < (int64_t(1) << 31);
  BackwardStateMaps maps{};
  if (by_tma) {
    const uint64_t rows = uint64_t(d.B * d.H * d.num_chunks * kChunk);
    maps.key_to_end = tma_map_f32_rows(ws.key_to_end, rows, d.KP, d.KP, kChunk, d.KP + kPadRowRead);
    maps.lower =
        tma_map_f32_rows(ws.lower_query_key, rows, kChunk, kChunk, kChunk, kChunk + kPadColRead);
    maps.d_out = tma_map_bf16_head_rows(d_o, uint64_t(d.B), uint64_t(d.T), uint64_t(d.H),
                                        uint64_t(d.V), kChunk, kCols + kPadColRead);
    maps.query_decay =
        tma_map_f32_rows(ws.query_decay, rows, d.KP, d.KP, kChunk, d.KP + kPadColRead);
    maps.w = tma_map_f32_rows(ws.w, rows, d.KP, d.KP, kChunk, d.KP + kPadColRead);
    maps.decay = tma_map_f32_rows(ws.decay_whole, rows / kChunk, d.KP, d.KP, 1, d.KP);
  }
  auto launch = [&](auto kernel) {
    DM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
    kernel<<<dim3(unsigned(d.VP / kCols), unsigned(d.B * d.H)), kThreads, size_t(shared), stream>>>(
        d_o, dsT, ds0, d, ws, d_states, maps);
  };
  const bool fixed = kda_static_dims(d) == kKdaStaticDims;
  if (state_backward_staged(d.VP / kCols * d.B * d.H)) {
    if (by_tma && fixed)
      launch(kda_chunk_state_backward_tf32_kernel<kCols, kKdaStaticDims, true>);
    else if (by_tma)
      launch(kda_chunk_state_backward_tf32_kernel<kCols, 0, true>);
    else if (fixed)
      launch(kda_chunk_state_backward_tf32_kernel<kCols, kKdaStaticDims, false>);
    else
      launch(kda_chunk_state_backward_tf32_kernel<kCols, 0, false>);
  } else {
    const int regs_shared = backward_state_regs_layout<kCols>(d).total;
    auto launch_regs = [&](auto kernel) {
      DM_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, regs_shared));
      kernel<<<dim3(unsigned(d.VP / kCols), unsigned(d.B * d.H)), kThreads, size_t(regs_shared),
               stream>>>(d_o, dsT, ds0, d, ws, d_states);
    };
    if (fixed)
      launch_regs(kda_chunk_state_backward_regs_kernel<kCols, kKdaStaticDims>);
    else
      launch_regs(kda_chunk_state_backward_regs_kernel<kCols, 0>);
  }
  check_last_error("cuda kda_chunk_backward (state gradient, tf32 tensor cores)");
}

}  // namespace

void kda_chunk_state_tf32(const float* s0, float* sT, const KdaDims& d,
                          const KdaForwardWorkspace& ws, cudaStream_t stream) {
  if (d.B * d.H == 0) return;
  if (state_tile_columns(d) == 32) launch_forward_state<32>(s0, sT, d, ws, stream);
  else launch_forward_state<16>(s0, sT, d, ws, stream);
}

bool kda_chunk_state_backward_tf32_supported(const KdaDims& d, const uint16_t* d_o) {
  return d.V % 8 == 0 && reinterpret_cast<uintptr_t>(d_o) % 16 == 0;
}

void kda_chunk_state_backward_tf32(const uint16_t* d_o, const float* dsT, float* ds0,
                                   const KdaDims& d, const KdaForwardWorkspace& ws,
                                   float* d_states, cudaStream_t stream) {
  DM_CHECK(kda_chunk_state_backward_tf32_supported(d, d_o),
           "cuda kda_chunk_backward: the tf32 state stage needs V % 8 == 0 and a 16-byte aligned "
           "dO, got V=", d.V);
  if (d.B * d.H == 0) return;
  if (state_tile_columns(d) == 32) launch_backward_state<32>(d_o, dsT, ds0, d, ws, d_states, stream);
  else launch_backward_state<16>(d_o, dsT, ds0, d, ws, d_states, stream);
}

}  // namespace kda_detail
}  // namespace dm::cuda
