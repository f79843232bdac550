// The two sequential stages of the chunked KDA on tensor cores (tf32 mma.sync, fp32 state),
// with the next chunk's operands copied in (TMA boxes, or cp.async) while the current chunk
// computes:
//   forward state (kda_chunk_state_tf32, this file):    V' = U − W·S;  S ← Diag(e^γ)·S + Keᵀ·V'
//   backward state (kda_chunk_state_backward_tf32, kda_chunk_state_backward_tf32.cu), chunks in
//   reverse: dV' = Ke·dS' + Pᵀ·dO;  dS = Diag(e^γ)·dS' + Qdᵀ·dO − Wᵀ·dV'
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
#include "ops/cuda/device.h"
#include "ops/cuda/kda.h"
#include "ops/cuda/kda_state_tf32_common.cuh"
#include "ops/cuda/tma.cuh"
#include "ops/cuda/tma_map.h"

namespace dm::cuda {
namespace kda_detail {
namespace state_tf32 {

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

// DM_KDA_STATE_TMA (read at each call): 1 (default) the state kernels' operands by TMA where
// measured faster, 0 never, all wherever it applies (the forward on grids of several rounds too).
int state_tma_mode() { return env_choice("DM_KDA_STATE_TMA", {"1", "0", "all"}); }

// Whether the state kernels' operands may come by TMA: not turned off, the padded rows fit one
// box (KP + 8 ≤ 256 floats) and the workspace's rows the TMA's coordinate range.
bool state_operands_by_tma(const KdaDims& d) {
  const bool enabled = state_tma_mode() != 1;
  const int64_t rows = d.B * d.H * d.num_chunks * kChunk;
  return enabled && d.KP + kPadColRead <= 256 && d.KP % 4 == 0 && d.VP % 4 == 0 &&
         rows < (int64_t(1) << 31);
}

}  // namespace state_tf32

namespace {
using namespace state_tf32;

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
// kSoloWait (with kTma): thread 0 alone polls each barrier and a block barrier passes its acquire
// on, for grids of two blocks an SM, where 255 polling threads would take the other's issue slots.
template <int kCols, int kStaticDims, bool kTma, bool kSoloWait>
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
      wait_side<kSoloWait>(&side_full[0], uint32_t(n & 1));  // value side of chunk n landed
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
      wait_side<kSoloWait>(&side_full[1], uint32_t(n & 1));  // state side of chunk n landed
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

template <int kCols>
void launch_forward_state(const float* s0, float* sT, const KdaDims& d,
                          const KdaForwardWorkspace& ws, cudaStream_t stream) {
  const int shared = forward_state_layout<kCols>(d).total;
  // By TMA where the grid is one round at one block per SM, as in training: (1,4096,16,128)
  // fwd+bwd 1.35 -> 1.27 ms with both state kernels on it, (2,16384,16,128) forward 2.11 -> 2.05;
  // but the 384 blocks of (1,8192,96,128), two per SM, forward 3.00 -> 3.08 ms (H200).
  const bool one_round = state_grid_fits_one_round(int(d.VP / kCols * d.B * d.H));
  const bool by_tma = state_operands_by_tma(d) && (one_round || state_tma_mode() == 2);
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
  if (by_tma && one_round && fixed)
    launch(kda_chunk_state_tf32_kernel<kCols, kKdaStaticDims, true, false>);
  else if (by_tma && one_round)
    launch(kda_chunk_state_tf32_kernel<kCols, 0, true, false>);
  else if (by_tma && fixed)
    launch(kda_chunk_state_tf32_kernel<kCols, kKdaStaticDims, true, true>);
  else if (by_tma)
    launch(kda_chunk_state_tf32_kernel<kCols, 0, true, true>);
  else if (fixed)
    launch(kda_chunk_state_tf32_kernel<kCols, kKdaStaticDims, false, false>);
  else
    launch(kda_chunk_state_tf32_kernel<kCols, 0, false, false>);
  check_last_error("cuda kda_chunk_forward (state, tf32 tensor cores)");
}

}  // namespace

void kda_chunk_state_tf32(const float* s0, float* sT, const KdaDims& d,
                          const KdaForwardWorkspace& ws, cudaStream_t stream) {
  if (d.B * d.H == 0) return;
  if (state_tile_columns(d) == 32) launch_forward_state<32>(s0, sT, d, ws, stream);
  else launch_forward_state<16>(s0, sT, d, ws, stream);
}

}  // namespace kda_detail
}  // namespace dm::cuda
