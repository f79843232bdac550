// The backward state stage of the chunked KDA on tensor cores (tf32 mma.sync, fp32 state), chunks
// in reverse: dV' = Ke·dS' + Pᵀ·dO;  dS = Diag(e^γ)·dS' + Qdᵀ·dO − Wᵀ·dV' (the design, the grid and
// the padding are the forward's: kda_chunk_state_tf32.cu). Two kernels: the staged one (Qd, W in
// shared memory, one block per SM) and the registers one (Qd, W fragments in registers, two
// blocks per SM); the host picks by grid size (state_backward_staged).
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
namespace {
using namespace state_tf32;

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

// Tensor maps of the backward state kernels' per-chunk operands (kTma), as the forward's: boxes
// as wide as the padded shared rows. The registers kernel uses the first three.
struct BackwardStateMaps {
  CUtensorMap key_to_end;   // [chunk-heads·C, KP], boxes [C, KP + 4]
  CUtensorMap lower;        // [chunk-heads·C, C], boxes [C, C + 8]
  CUtensorMap d_out;        // dO [B][T][H][V] bf16, boxes of C tokens × (kCols + 8) of a head
  CUtensorMap query_decay;  // [chunk-heads·C, KP], boxes [C, KP + 8]
  CUtensorMap w;            // [chunk-heads·C, KP], boxes [C, KP + 8]
  CUtensorMap decay;        // [chunk-heads, KP], boxes [1, KP]
};

// load_backward_value_side by TMA: the three boxes of chunk n on `full` (thread 0 only).
template <int kCols>
__device__ __forceinline__ void load_backward_value_side_tma(const BackwardStateMaps& maps,
                                                             uint64_t* full, int KP, int64_t b,
                                                             int64_t h, int64_t first_chunk, int e0,
                                                             int64_t n, float* key_to_end_s,
                                                             float* lower_s, uint16_t* d_out_tile) {
  const int64_t ch = first_chunk + n;
  const uint32_t bytes =
      uint32_t(kChunk * (KP + kPadRowRead) * 4 + kChunk * (kChunk + kPadColRead) * 4 +
               kChunk * (kCols + kPadColRead) * 2);
  tma::barrier_arrive_expect_bytes(full, bytes);
  tma::load_2d(key_to_end_s, &maps.key_to_end, full, 0, int32_t(ch * kChunk));
  tma::load_2d(lower_s, &maps.lower, full, 0, int32_t(ch * kChunk));
  tma::load_4d(d_out_tile, &maps.d_out, full, e0, int32_t(h), int32_t(n * kChunk), int32_t(b));
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

template <int kCols, int kStaticDims, bool kTma>
__global__ void __launch_bounds__(kThreads)
    kda_chunk_state_backward_tf32_kernel(const uint16_t* d_o, const float* dsT, float* ds0,
                                         KdaDims dims, KdaForwardWorkspace ws, float* d_states,
                                         const __grid_constant__ BackwardStateMaps maps) {
  const KdaDims d = static_dims(dims, kStaticDims);
  extern __shared__ __align__(128) unsigned char shared_bytes[];
  const BackwardStateLayout l = backward_state_layout<kCols>(d);
  float* key_to_end_s = reinterpret_cast<float*>(shared_bytes + l.key_to_end);   // [C, KP+4] Ke
  float* lower_s = reinterpret_cast<float*>(shared_bytes + l.lower_query_key);   // [C, C+8]  P
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
      load_backward_value_side_tma<kCols>(maps, &side_full[0], d.KP, b, h, first_chunk, e0, n,
                                          key_to_end_s, lower_s, d_out_s[n & 1]);
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
      wait_side<false>(&side_full[0], parity);  // value side of chunk n landed
    } else {
      cp_async_wait<1>();
      __syncthreads();  // value side of chunk n landed; dS' is the gradient after chunk n
    }
    copy_tile_f4<kCols, true>(d_states + ch * d.KP * d.VP + e0, d.VP, d_state_s, ldt, d.KP);
    backward_value_product<kCols>(d, key_to_end_s, lower_s, d_state_s, d_out, d_value_new_s);
    __syncthreads();  // Ke, P free (this dO buffer stays: phase 2 reads it)
    if constexpr (kTma) {
      if (tid == 0 && n > 0) load_value_side(n - 1);
      wait_side<false>(&side_full[1], parity);  // state side of chunk n landed
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

template <int kCols, int kStaticDims, bool kTma>
__global__ void __launch_bounds__(kThreads, 2)
    kda_chunk_state_backward_regs_kernel(const uint16_t* d_o, const float* dsT, float* ds0,
                                         KdaDims dims, KdaForwardWorkspace ws, float* d_states,
                                         const __grid_constant__ BackwardStateMaps maps) {
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

  __shared__ __align__(8) uint64_t value_full;  // kTma: the value side landed, a phase a chunk
  auto load_value_side = [&](int64_t n) {       // Ke, P and the dO tile of chunk n
    if constexpr (kTma) {
      if (tid == 0)
        load_backward_value_side_tma<kCols>(maps, &value_full, d.KP, b, h, first_chunk, e0, n,
                                            key_to_end_s, lower_s, d_out_s[n & 1]);
    } else {
      load_backward_value_side<kCols>(d, ws, d_o, b, h, first_chunk, e0, n, key_to_end_s, lower_s,
                                      d_out_s[n & 1]);
    }
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
  if constexpr (kTma) {
    if (tid == 0) {
      tma::barrier_init(&value_full, 1);
      tma::barrier_init_fence();
    }
    __syncthreads();  // the barrier initialised
  }
  if (last >= 0) {
    load_value_side(last);
    load_query_side(last);
  }
  if constexpr (!kTma) cp_async_commit();

  for (int64_t n = last; n >= 0; --n) {
    const int64_t ch = first_chunk + n;
    const uint16_t* d_out = d_out_s[n & 1];
    auto d_out_at = [&](int i, int col) {
      return __uint_as_float(uint32_t(d_out[i * ldt + col]) << 16);
    };
    // kTma: thread 0 alone polls (two blocks share an SM here; wait_side).
    if constexpr (kTma) {
      wait_side<true>(&value_full, uint32_t((last - n) & 1));
    } else {
      cp_async_wait<0>();
      __syncthreads();
    }  // value side of chunk n landed; dS' is the gradient after chunk n
    copy_tile_f4<kCols, true>(d_states + ch * d.KP * d.VP + e0, d.VP, d_state_s, ldt, d.KP);
    backward_value_product<kCols>(d, key_to_end_s, lower_s, d_state_s, d_out, d_value_new_s);
    __syncthreads();  // dV' complete; Ke, P free (this dO buffer stays: phase 2 reads it)
    if (n > 0) load_value_side(n - 1);
    if constexpr (!kTma) cp_async_commit();

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
  if constexpr (!kTma) cp_async_wait<0>();
  __syncthreads();  // the last phase 2's rows of dS, from every warp
  if (ds0 != nullptr)
    for (int idx = tid; idx < d.K * kCols; idx += kThreads) {
      const int row = idx / kCols, col = idx % kCols, e = e0 + col;
      if (e < d.V) ds0[(bh * d.K + row) * d.V + e] += d_state_s[row * ldt + col];
    }
}

template <int kCols>
void launch_backward_state(const uint16_t* d_o, const float* dsT, float* ds0, const KdaDims& d,
                           const KdaForwardWorkspace& ws, float* d_states, cudaStream_t stream) {
  const bool by_tma = state_operands_by_tma(d) && d.V % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(d_o) % 16 == 0 && d.B * d.T < (int64_t(1) << 31);
  const bool staged = state_backward_staged(d.VP / kCols * d.B * d.H);
  BackwardStateMaps maps{};
  if (by_tma) {  // the value side's maps for both kernels, the state side's for the staged one
    const uint64_t rows = uint64_t(d.B * d.H * d.num_chunks * kChunk);
    maps.key_to_end = tma_map_f32_rows(ws.key_to_end, rows, d.KP, d.KP, kChunk, d.KP + kPadRowRead);
    maps.lower =
        tma_map_f32_rows(ws.lower_query_key, rows, kChunk, kChunk, kChunk, kChunk + kPadColRead);
    maps.d_out = tma_map_bf16_head_rows(d_o, uint64_t(d.B), uint64_t(d.T), uint64_t(d.H),
                                        uint64_t(d.V), kChunk, kCols + kPadColRead);
    if (staged) {
      maps.query_decay =
          tma_map_f32_rows(ws.query_decay, rows, d.KP, d.KP, kChunk, d.KP + kPadColRead);
      maps.w = tma_map_f32_rows(ws.w, rows, d.KP, d.KP, kChunk, d.KP + kPadColRead);
      maps.decay = tma_map_f32_rows(ws.decay_whole, rows / kChunk, d.KP, d.KP, 1, d.KP);
    }
  }
  const int shared = staged ? backward_state_layout<kCols>(d).total
                            : backward_state_regs_layout<kCols>(d).total;
  auto launch = [&](auto kernel) {
    DM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
    kernel<<<dim3(unsigned(d.VP / kCols), unsigned(d.B * d.H)), kThreads, size_t(shared), stream>>>(
        d_o, dsT, ds0, d, ws, d_states, maps);
  };
  const bool fixed = kda_static_dims(d) == kKdaStaticDims;
  if (staged) {
    if (by_tma && fixed)
      launch(kda_chunk_state_backward_tf32_kernel<kCols, kKdaStaticDims, true>);
    else if (by_tma)
      launch(kda_chunk_state_backward_tf32_kernel<kCols, 0, true>);
    else if (fixed)
      launch(kda_chunk_state_backward_tf32_kernel<kCols, kKdaStaticDims, false>);
    else
      launch(kda_chunk_state_backward_tf32_kernel<kCols, 0, false>);
  } else {
    if (by_tma && fixed)
      launch(kda_chunk_state_backward_regs_kernel<kCols, kKdaStaticDims, true>);
    else if (by_tma)
      launch(kda_chunk_state_backward_regs_kernel<kCols, 0, true>);
    else if (fixed)
      launch(kda_chunk_state_backward_regs_kernel<kCols, kKdaStaticDims, false>);
    else
      launch(kda_chunk_state_backward_regs_kernel<kCols, 0, false>);
  }
  check_last_error("cuda kda_chunk_backward (state gradient, tf32 tensor cores)");
}

}  // namespace

bool kda_chunk_state_backward_tf32_supported(const KdaDims& d, const uint16_t* d_o) {
  return d.V % 8 == 0 && reinterpret_cast<uintptr_t>(d_o) % 16 == 0;
}

void kda_chunk_state_backward_tf32(const uint16_t* d_o, const float* dsT, float* ds0,
                                   const KdaDims& d, const KdaForwardWorkspace& ws, float* d_states,
                                   cudaStream_t stream) {
  DM_CHECK(kda_chunk_state_backward_tf32_supported(d, d_o),
           "cuda kda_chunk_backward: the tf32 state stage needs V % 8 == 0 and a 16-byte aligned "
           "dO, got V=",
           d.V);
  if (d.B * d.H == 0) return;
  if (state_tile_columns(d) == 32)
    launch_backward_state<32>(d_o, dsT, ds0, d, ws, d_states, stream);
  else
    launch_backward_state<16>(d_o, dsT, ds0, d, ws, d_states, stream);
}

}  // namespace kda_detail
}  // namespace dm::cuda
