// Backward of the causal attention on the GPU (SPEC §1.2, training), FlashAttention-2 style,
// deterministic (no atomics), plus a plain one-warp-per-row GPU reference.
//
// With S = scale·Q Kᵀ (masked), P = softmax(S) = exp(S − lse), O = P V and upstream dO:
//   Δ_t = Σ_d dO_td·O_td;  dP = dO Vᵀ;  dS = P ⊙ (dP − Δ)
//   dV += Pᵀ dO;  dK += scale · dSᵀ Q;  dQ += scale · dS K
// P is recomputed tile by tile from the forward's lse; nothing T×T is stored.
//
// Three kernels (as the CPU op's two-pass schedule, attention_backward.cpp):
//   1. preprocess: Δ [B,H,T] and, with documents, the smallest document start of every 32-row
//      query block (to skip query blocks that see none of a key block).
//   2. dK/dV: one CTA per (b, h, 64-key block), K and V resident in shared memory; walks the
//      16- or 32-row query blocks at and after the diagonal (Q, dO double-buffered by cp.async) and
//      computes Sᵀ = K Qᵀ and dPᵀ = V dOᵀ directly transposed, so Pᵀ and dSᵀ are already in the
//      A-operand registers for dV += Pᵀ dO and dK += dSᵀ Q. Each warp owns 16 keys.
//   3. dQ: one CTA per (b, h, 64-row query block), Q and dO resident; walks the key blocks up to
//      the diagonal (K, V double-buffered), recomputes S and dP, dQ += dS K. Each warp owns 16
//      query rows.
// Every gradient element has exactly one writer, which adds its fp32 sum into the bf16 output
// once (accumulate semantics, docs/backward.md). Cost: 7 tile GEMMs per (query, key) tile against
// 5 for an atomic dQ; the price of determinism.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"

namespace dm::cuda::attention_detail {

namespace {

constexpr float kLog2e = 1.4426950408889634f;

using bf16 = __nv_bfloat16;

struct BackwardArgs {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const bf16* o;
  const float* lse;
  const bf16* dout;
  bf16* dq;
  bf16* dk;
  bf16* dv;
  const int32_t* doc_start;  // [B, T] or nullptr
  float* delta;              // [B, H, T]
  int32_t* min_doc_blocks;   // [B, ceil(T / kMinDocRows)] (only with doc_start)
  int B, T, H, Dqk, Dv;
  float scale, scale_log2;
};

size_t round_up_256(size_t bytes) { return (bytes + 255) & ~size_t(255); }

// ---- 1. preprocess -----------------------------------------------------------------------

// Δ[b,h,t] = Σ_d dO·O, one warp per (b, t, h) row.
__global__ void attention_backward_delta_kernel(const BackwardArgs a) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= int64_t(a.B) * a.T * a.H) return;
  float sum = 0.0f;
  for (int d = lane; d < a.Dv; d += 32)
    sum += __bfloat162float(a.dout[row * a.Dv + d]) * __bfloat162float(a.o[row * a.Dv + d]);
  sum = warp_sum(sum);
  if (lane == 0) {
    const int h = int(row % a.H);
    const int64_t bt = row / a.H;  // b·T + t
    const int64_t b = bt / a.T, t = bt % a.T;
    a.delta[(b * a.H + h) * a.T + t] = sum;
  }
}

// min_doc_blocks[b, i] = min over rows t of block i (kMinDocRows rows) of doc_start[b, t].
__global__ void attention_backward_min_doc_kernel(const BackwardArgs a, int blocks_per_row) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(a.B) * blocks_per_row) return;
  const int64_t b = i / blocks_per_row;
  const int block = int(i % blocks_per_row);
  int m = INT_MAX;
  for (int t = block * kMinDocRows; t < min(a.T, (block + 1) * kMinDocRows); ++t)
    m = min(m, a.doc_start[b * a.T + t]);
  a.min_doc_blocks[i] = m;
}

// ---- 2. dK, dV -----------------------------------------------------------------------------

// kBlockM = query rows per pipeline stage: 32, or 16 for the widest heads, where 32 would spill
// registers (dK 16×192 and dV 16×128 fp32 accumulators already take 160 per thread).
template <int kDqk, int kDv, int kBlockMRows>
struct KeyValueGradConfig {
  static_assert(kDqk % 16 == 0 && kDv % 16 == 0, "head dims are padded to multiples of 16");
  static_assert(kBlockMRows % 16 == 0 && kMinDocRows % kBlockMRows == 0, "query stage rows");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = 16 * kWarps;  // keys per CTA
  static constexpr int kBlockM = kBlockMRows;
  static constexpr int kQkStride = kDqk + kSmemRowPad;
  static constexpr int kVStride = kDv + kSmemRowPad;
  static constexpr int kKElems = kBlockN * kQkStride;
  static constexpr int kVElems = kBlockN * kVStride;
  static constexpr int kQElems = kBlockM * kQkStride;
  static constexpr int kDoElems = kBlockM * kVStride;
  // bf16 tiles, then per stage lse·log2e, Δ (fp32) and document starts (int32) of the rows.
  static constexpr size_t kTileBytes = size_t(kKElems + kVElems + 2 * kQElems + 2 * kDoElems) * 2;
  static constexpr size_t kSmemBytes = kTileBytes + size_t(2 * 3 * kBlockM) * 4;
};

template <int kDqk, int kDv, int kBlockMRows>
__global__ void __launch_bounds__(KeyValueGradConfig<kDqk, kDv, kBlockMRows>::kThreads, 1)
    attention_backward_dkdv_kernel(const BackwardArgs a) {
  using Cfg = KeyValueGradConfig<kDqk, kDv, kBlockMRows>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kThreads = Cfg::kThreads;
  constexpr int kQkStride = Cfg::kQkStride, kVStride = Cfg::kVStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* const sK = reinterpret_cast<bf16*>(smem_raw);  // [kBlockN][kQkStride]
  bf16* const sV = sK + Cfg::kKElems;                   // [kBlockN][kVStride]
  bf16* const sQ = sV + Cfg::kVElems;                   // [2][kBlockM][kQkStride]
  bf16* const sDo = sQ + 2 * Cfg::kQElems;              // [2][kBlockM][kVStride]
  float* const sLse2 = reinterpret_cast<float*>(smem_raw + Cfg::kTileBytes);  // [2][kBlockM]
  float* const sDelta = sLse2 + 2 * kBlockM;                                   // [2][kBlockM]
  int* const sDoc = reinterpret_cast<int*>(sDelta + 2 * kBlockM);              // [2][kBlockM]

  const int T = a.T, H = a.H;
  const int batch_heads = a.B * H;
  const int key_block = int(blockIdx.x / batch_heads);  // block 0 (the most work) launches first
  const int batch_head = int(blockIdx.x % batch_heads);
  const int b = batch_head / H, h = batch_head % H;
  const int key_start = key_block * kBlockN;
  const int key_last = min(key_start + kBlockN, T) - 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;

  const int64_t qk_row_stride = int64_t(H) * a.Dqk, v_row_stride = int64_t(H) * a.Dv;
  const int64_t head_qk = (int64_t(b) * T * H + h) * a.Dqk;  // token 0 of (b, h)
  const int64_t head_v = (int64_t(b) * T * H + h) * a.Dv;
  const float* lse_row = a.lse + (int64_t(b) * H + h) * T;
  const float* delta_row = a.delta + (int64_t(b) * H + h) * T;
  const int32_t* doc = a.doc_start ? a.doc_start + int64_t(b) * T : nullptr;
  const int num_query_blocks = (T + kBlockM - 1) / kBlockM;
  const int blocks_per_row = (T + kMinDocRows - 1) / kMinDocRows;
  const int32_t* min_doc = doc ? a.min_doc_blocks + int64_t(b) * blocks_per_row : nullptr;

  // Next query block at or after i that some row of it may see a key of this block from.
  auto next_visible = [&](int i) {
    if (!min_doc) return i;
    while (i < num_query_blocks && min_doc[i * kBlockM / kMinDocRows] > key_last) ++i;
    return i;
  };
  auto load_query_block = [&](int i, int stage) {
    const int row_begin = i * kBlockM;
    load_rows_async<kBlockM, kDqk, kThreads>(sQ + stage * Cfg::kQElems, a.q + head_qk,
                                             qk_row_stride, row_begin, T, a.Dqk);
    load_rows_async<kBlockM, kDv, kThreads>(sDo + stage * Cfg::kDoElems, a.dout + head_v,
                                            v_row_stride, row_begin, T, a.Dv);
    for (int r = threadIdx.x; r < kBlockM; r += kThreads) {
      const int t = row_begin + r;
      const bool valid = t < T;
      sLse2[stage * kBlockM + r] = valid ? lse_row[t] * kLog2e : 0.0f;
      sDelta[stage * kBlockM + r] = valid ? delta_row[t] : 0.0f;
      sDoc[stage * kBlockM + r] = valid && doc ? doc[t] : 0;
    }
  };

  load_rows_async<kBlockN, kDqk, kThreads>(sK, a.k + head_qk, qk_row_stride, key_start, T, a.Dqk);
  load_rows_async<kBlockN, kDv, kThreads>(sV, a.v + head_v, v_row_stride, key_start, T, a.Dv);
  int query_block = next_visible(key_start / kBlockM);
  if (query_block < num_query_blocks) load_query_block(query_block, 0);
  cp_async_commit();

  const LaneOffsets lo(lane);
  float dk_acc[kDqk / 8][4], dv_acc[kDv / 8][4];
#pragma unroll
  for (int n = 0; n < kDqk / 8; ++n) dk_acc[n][0] = dk_acc[n][1] = dk_acc[n][2] = dk_acc[n][3] = 0.f;
#pragma unroll
  for (int n = 0; n < kDv / 8; ++n) dv_acc[n][0] = dv_acc[n][1] = dv_acc[n][2] = dv_acc[n][3] = 0.f;
  const int key_lo = key_start + warp * 16 + g;  // this thread's keys: key_lo, key_lo + 8

  for (int stage_count = 0; query_block < num_query_blocks; ++stage_count) {
    const int stage = stage_count & 1;
    const int next_block = next_visible(query_block + 1);
    if (next_block < num_query_blocks) {
      load_query_block(next_block, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* q_tile = sQ + stage * Cfg::kQElems;
    const bf16* do_tile = sDo + stage * Cfg::kDoElems;
    const float* lse2 = sLse2 + stage * kBlockM;
    const float* delta = sDelta + stage * kBlockM;
    const int* row_doc = sDoc + stage * kBlockM;
    const int query_start = query_block * kBlockM;

    // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: this warp's 16 keys × 32 queries.
    float st[kBlockM / 8][4], dpt[kBlockM / 8][4];
#pragma unroll
    for (int n = 0; n < kBlockM / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kDqk / 16; ++kk) {
      uint32_t ka[4];
      ldmatrix_x4(ka, sK + (warp * 16 + lo.a_row) * kQkStride + kk * 16 + lo.a_col);
#pragma unroll
      for (int np = 0; np < kBlockM / 16; ++np) {
        uint32_t qb[4];
        ldmatrix_x4(qb, q_tile + (np * 16 + lo.b_row) * kQkStride + kk * 16 + lo.b_col);
        mma_bf16_16x8x16(st[2 * np], ka, qb[0], qb[1]);
        mma_bf16_16x8x16(st[2 * np + 1], ka, qb[2], qb[3]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < kDv / 16; ++kk) {
      uint32_t va[4];
      ldmatrix_x4(va, sV + (warp * 16 + lo.a_row) * kVStride + kk * 16 + lo.a_col);
#pragma unroll
      for (int np = 0; np < kBlockM / 16; ++np) {
        uint32_t ob[4];
        ldmatrix_x4(ob, do_tile + (np * 16 + lo.b_row) * kVStride + kk * 16 + lo.b_col);
        mma_bf16_16x8x16(dpt[2 * np], va, ob[0], ob[1]);
        mma_bf16_16x8x16(dpt[2 * np + 1], va, ob[2], ob[3]);
      }
    }

    // Pᵀ = exp2(Sᵀ·scale·log2e − lse·log2e) on visible (key ≤ t, key ≥ doc_start[t]) entries;
    // dSᵀ = Pᵀ ⊙ (dPᵀ − Δ).
#pragma unroll
    for (int n = 0; n < kBlockM / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n * 8 + 2 * tq + (e & 1);
        const int t = query_start + col;
        const int key = key_lo + (e >= 2 ? 8 : 0);
        const bool visible = t < T && key <= t && key >= row_doc[col];
        const float p = visible ? fast_exp2(st[n][e] * a.scale_log2 - lse2[col]) : 0.0f;
        st[n][e] = p;
        dpt[n][e] = p * (dpt[n][e] - delta[col]);
      }
    }

    // dV += Pᵀ dO and dK += dSᵀ Q (k index = the 32 query rows).
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      uint32_t pa[4], dsa[4];
      c_tiles_to_a_fragment(st[2 * kk], st[2 * kk + 1], pa);
      c_tiles_to_a_fragment(dpt[2 * kk], dpt[2 * kk + 1], dsa);
#pragma unroll
      for (int dp = 0; dp < kDv / 16; ++dp) {
        uint32_t ob[4];
        ldmatrix_x4_trans(ob, do_tile + (kk * 16 + lo.bt_row) * kVStride + dp * 16 + lo.bt_col);
        mma_bf16_16x8x16(dv_acc[2 * dp], pa, ob[0], ob[1]);
        mma_bf16_16x8x16(dv_acc[2 * dp + 1], pa, ob[2], ob[3]);
      }
#pragma unroll
      for (int dp = 0; dp < kDqk / 16; ++dp) {
        uint32_t qb[4];
        ldmatrix_x4_trans(qb, q_tile + (kk * 16 + lo.bt_row) * kQkStride + dp * 16 + lo.bt_col);
        mma_bf16_16x8x16(dk_acc[2 * dp], dsa, qb[0], qb[1]);
        mma_bf16_16x8x16(dk_acc[2 * dp + 1], dsa, qb[2], qb[3]);
      }
    }
    __syncthreads();  // the stage is free for the prefetch of iteration +1
    query_block = next_block;
  }
  cp_async_wait<0>();  // (K/V copies are still pending when no query block was visible)

  const int row0 = key_start + warp * 16;
  accumulate_c_tiles_to_global(dk_acc, a.dk + head_qk, qk_row_stride, row0, T, a.Dqk, a.scale,
                               lane);
  accumulate_c_tiles_to_global(dv_acc, a.dv + head_v, v_row_stride, row0, T, a.Dv, 1.0f, lane);
}

// ---- 3. dQ ---------------------------------------------------------------------------------

template <int kDqk, int kDv>
struct QueryGradConfig {
  static_assert(kDqk % 16 == 0 && kDv % 16 == 0, "head dims are padded to multiples of 16");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = 16 * kWarps;  // query rows per CTA
  static constexpr int kBlockN = 32;           // keys per pipeline stage
  static constexpr int kQkStride = kDqk + kSmemRowPad;
  static constexpr int kVStride = kDv + kSmemRowPad;
  static constexpr int kQElems = kBlockM * kQkStride;
  static constexpr int kDoElems = kBlockM * kVStride;
  static constexpr int kKElems = kBlockN * kQkStride;
  static constexpr int kVElems = kBlockN * kVStride;
  static constexpr size_t kSmemBytes =
      size_t(kQElems + kDoElems + 2 * kKElems + 2 * kVElems) * sizeof(bf16);
};

template <int kDqk, int kDv>
__global__ void __launch_bounds__(QueryGradConfig<kDqk, kDv>::kThreads, 1)
    attention_backward_dq_kernel(const BackwardArgs a) {
  using Cfg = QueryGradConfig<kDqk, kDv>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kThreads = Cfg::kThreads;
  constexpr int kQkStride = Cfg::kQkStride, kVStride = Cfg::kVStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* const sQ = reinterpret_cast<bf16*>(smem_raw);  // [kBlockM][kQkStride]
  bf16* const sDo = sQ + Cfg::kQElems;                  // [kBlockM][kVStride]
  bf16* const sK = sDo + Cfg::kDoElems;                 // [2][kBlockN][kQkStride]
  bf16* const sV = sK + 2 * Cfg::kKElems;               // [2][kBlockN][kVStride]
  __shared__ int block_min_doc;

  const int T = a.T, H = a.H;
  const int num_query_blocks = (T + kBlockM - 1) / kBlockM;
  const int batch_heads = a.B * H;
  const int query_block = num_query_blocks - 1 - int(blockIdx.x / batch_heads);
  const int batch_head = int(blockIdx.x % batch_heads);
  const int b = batch_head / H, h = batch_head % H;
  const int query_start = query_block * kBlockM;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;

  const int64_t qk_row_stride = int64_t(H) * a.Dqk, v_row_stride = int64_t(H) * a.Dv;
  const int64_t head_qk = (int64_t(b) * T * H + h) * a.Dqk;
  const int64_t head_v = (int64_t(b) * T * H + h) * a.Dv;
  const int32_t* doc = a.doc_start ? a.doc_start + int64_t(b) * T : nullptr;

  if (threadIdx.x == 0) block_min_doc = INT_MAX;
  __syncthreads();
  for (int r = threadIdx.x; r < kBlockM; r += kThreads) {
    const int t = query_start + r;
    if (t < T) atomicMin(&block_min_doc, doc ? doc[t] : 0);
  }
  __syncthreads();
  const int first_key_block = block_min_doc / kBlockN;
  const int last_key_block = (min(query_start + kBlockM, T) - 1) / kBlockN;

  // This thread's rows and their statistics.
  const int t_lo = query_start + warp * 16 + g, t_hi = t_lo + 8;
  const float* lse_row = a.lse + (int64_t(b) * H + h) * T;
  const float* delta_row = a.delta + (int64_t(b) * H + h) * T;
  const float lse2_lo = t_lo < T ? lse_row[t_lo] * kLog2e : 0.0f;
  const float lse2_hi = t_hi < T ? lse_row[t_hi] * kLog2e : 0.0f;
  const float delta_lo = t_lo < T ? delta_row[t_lo] : 0.0f;
  const float delta_hi = t_hi < T ? delta_row[t_hi] : 0.0f;
  const int doc_lo = (doc && t_lo < T) ? doc[t_lo] : 0;
  const int doc_hi = (doc && t_hi < T) ? doc[t_hi] : 0;

  load_rows_async<kBlockM, kDqk, kThreads>(sQ, a.q + head_qk, qk_row_stride, query_start, T,
                                           a.Dqk);
  load_rows_async<kBlockM, kDv, kThreads>(sDo, a.dout + head_v, v_row_stride, query_start, T,
                                          a.Dv);
  load_rows_async<kBlockN, kDqk, kThreads>(sK, a.k + head_qk, qk_row_stride,
                                           first_key_block * kBlockN, T, a.Dqk);
  load_rows_async<kBlockN, kDv, kThreads>(sV, a.v + head_v, v_row_stride,
                                          first_key_block * kBlockN, T, a.Dv);
  cp_async_commit();

  const LaneOffsets lo(lane);
  float dq_acc[kDqk / 8][4];
#pragma unroll
  for (int n = 0; n < kDqk / 8; ++n) dq_acc[n][0] = dq_acc[n][1] = dq_acc[n][2] = dq_acc[n][3] = 0.f;

  for (int key_block = first_key_block; key_block <= last_key_block; ++key_block) {
    const int buf = (key_block - first_key_block) & 1;
    if (key_block < last_key_block) {
      const int next_start = (key_block + 1) * kBlockN;
      load_rows_async<kBlockN, kDqk, kThreads>(sK + (buf ^ 1) * Cfg::kKElems, a.k + head_qk,
                                               qk_row_stride, next_start, T, a.Dqk);
      load_rows_async<kBlockN, kDv, kThreads>(sV + (buf ^ 1) * Cfg::kVElems, a.v + head_v,
                                              v_row_stride, next_start, T, a.Dv);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* k_tile = sK + buf * Cfg::kKElems;
    const bf16* v_tile = sV + buf * Cfg::kVElems;

    // S = Q Kᵀ and dP = dO Vᵀ for this warp's 16 rows × kBlockN keys.
    float s[kBlockN / 8][4], dp[kBlockN / 8][4];
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kDqk / 16; ++kk) {
      uint32_t qa[4];
      ldmatrix_x4(qa, sQ + (warp * 16 + lo.a_row) * kQkStride + kk * 16 + lo.a_col);
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_tile + (np * 16 + lo.b_row) * kQkStride + kk * 16 + lo.b_col);
        mma_bf16_16x8x16(s[2 * np], qa, kb[0], kb[1]);
        mma_bf16_16x8x16(s[2 * np + 1], qa, kb[2], kb[3]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < kDv / 16; ++kk) {
      uint32_t oa[4];
      ldmatrix_x4(oa, sDo + (warp * 16 + lo.a_row) * kVStride + kk * 16 + lo.a_col);
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        uint32_t vb[4];
        ldmatrix_x4(vb, v_tile + (np * 16 + lo.b_row) * kVStride + kk * 16 + lo.b_col);
        mma_bf16_16x8x16(dp[2 * np], oa, vb[0], vb[1]);
        mma_bf16_16x8x16(dp[2 * np + 1], oa, vb[2], vb[3]);
      }
    }

    const int key_start = key_block * kBlockN;
#pragma unroll
    for (int n = 0; n < kBlockN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key_start + n * 8 + 2 * tq + (e & 1);
        const bool high = e >= 2;
        const int t = high ? t_hi : t_lo;
        const bool visible = t < T && key <= t && key >= (high ? doc_hi : doc_lo);
        const float p =
            visible ? fast_exp2(s[n][e] * a.scale_log2 - (high ? lse2_hi : lse2_lo)) : 0.0f;
        dp[n][e] = p * (dp[n][e] - (high ? delta_hi : delta_lo));  // dS
      }
    }

    // dQ += dS K (k index = the keys of the tile).
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t dsa[4];
      c_tiles_to_a_fragment(dp[2 * kk], dp[2 * kk + 1], dsa);
#pragma unroll
      for (int np = 0; np < kDqk / 16; ++np) {
        uint32_t kb[4];
        ldmatrix_x4_trans(kb, k_tile + (kk * 16 + lo.bt_row) * kQkStride + np * 16 + lo.bt_col);
        mma_bf16_16x8x16(dq_acc[2 * np], dsa, kb[0], kb[1]);
        mma_bf16_16x8x16(dq_acc[2 * np + 1], dsa, kb[2], kb[3]);
      }
    }
    __syncthreads();
  }

  accumulate_c_tiles_to_global(dq_acc, a.dq + head_qk, qk_row_stride, query_start + warp * 16, T,
                               a.Dqk, a.scale, lane);
}

template <typename Kernel>
void set_dynamic_smem(Kernel kernel, size_t bytes, bool* done) {
  if (*done) return;
  DM_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  *done = true;
}

template <int kDqk, int kDv>
void launch_backward_tiled_instance(const BackwardArgs& args, CUstream_st* stream) {
  constexpr int kKvBlockM = kDqk > 96 ? 16 : 32;
  using KvCfg = KeyValueGradConfig<kDqk, kDv, kKvBlockM>;
  using QCfg = QueryGradConfig<kDqk, kDv>;
  static bool kv_attribute = false, q_attribute = false;
  set_dynamic_smem(attention_backward_dkdv_kernel<kDqk, kDv, kKvBlockM>, KvCfg::kSmemBytes, &kv_attribute);
  set_dynamic_smem(attention_backward_dq_kernel<kDqk, kDv>, QCfg::kSmemBytes, &q_attribute);
  const int64_t batch_heads = int64_t(args.B) * args.H;
  const int64_t kv_blocks = int64_t(ceil_div(args.T, KvCfg::kBlockN)) * batch_heads;
  const int64_t q_blocks = int64_t(ceil_div(args.T, QCfg::kBlockM)) * batch_heads;
  DM_CHECK(kv_blocks < (int64_t(1) << 31) && q_blocks < (int64_t(1) << 31),
           "attention backward: grid too large");
  attention_backward_dkdv_kernel<kDqk, kDv, kKvBlockM>
      <<<unsigned(kv_blocks), KvCfg::kThreads, KvCfg::kSmemBytes, stream>>>(args);
  check_last_error("attention_backward_dkdv_kernel");
  attention_backward_dq_kernel<kDqk, kDv>
      <<<unsigned(q_blocks), QCfg::kThreads, QCfg::kSmemBytes, stream>>>(args);
  check_last_error("attention_backward_dq_kernel");
}

// ---- plain GPU reference -------------------------------------------------------------------

constexpr int kSimpleMaxDim = 256;
constexpr int kSimpleSlots = kSimpleMaxDim / 32;

// dQ for one (b, t, h) query row per warp: walks its visible keys one by one.
__global__ void attention_backward_simple_dq_kernel(const BackwardArgs a) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= int64_t(a.B) * a.T * a.H) return;
  const int h = int(row % a.H);
  const int t = int((row / a.H) % a.T);
  const int b = int(row / (int64_t(a.H) * a.T));
  const int first_key = a.doc_start ? a.doc_start[int64_t(b) * a.T + t] : 0;
  const float lse = a.lse[(int64_t(b) * a.H + h) * a.T + t];
  const float delta = a.delta[(int64_t(b) * a.H + h) * a.T + t];
  float qv[kSimpleSlots], gv[kSimpleSlots], acc[kSimpleSlots];
#pragma unroll
  for (int i = 0; i < kSimpleSlots; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < a.Dqk ? __bfloat162float(a.q[row * a.Dqk + d]) : 0.0f;
    gv[i] = d < a.Dv ? __bfloat162float(a.dout[row * a.Dv + d]) : 0.0f;
    acc[i] = 0.0f;
  }
  for (int j = first_key; j <= t; ++j) {
    const int64_t key_row = (int64_t(b) * a.T + j) * a.H + h;
    float dot = 0.0f, dpv = 0.0f;
#pragma unroll
    for (int i = 0; i < kSimpleSlots; ++i) {
      const int d = lane + 32 * i;
      if (d < a.Dqk) dot += qv[i] * __bfloat162float(a.k[key_row * a.Dqk + d]);
      if (d < a.Dv) dpv += gv[i] * __bfloat162float(a.v[key_row * a.Dv + d]);
    }
    const float p = expf(warp_sum(dot) * a.scale - lse);
    const float ds = p * (warp_sum(dpv) - delta);
#pragma unroll
    for (int i = 0; i < kSimpleSlots; ++i) {
      const int d = lane + 32 * i;
      if (d < a.Dqk) acc[i] += ds * __bfloat162float(a.k[key_row * a.Dqk + d]);
    }
  }
#pragma unroll
  for (int i = 0; i < kSimpleSlots; ++i) {
    const int d = lane + 32 * i;
    if (d < a.Dqk)
      a.dq[row * a.Dqk + d] =
          __float2bfloat16(__bfloat162float(a.dq[row * a.Dqk + d]) + a.scale * acc[i]);
  }
}

// dK, dV for one (b, j, h) key row per warp: walks the queries t ≥ j that see key j.
__global__ void attention_backward_simple_dkdv_kernel(const BackwardArgs a) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= int64_t(a.B) * a.T * a.H) return;
  const int h = int(row % a.H);
  const int j = int((row / a.H) % a.T);
  const int b = int(row / (int64_t(a.H) * a.T));
  float kv[kSimpleSlots], vv[kSimpleSlots], dk_acc[kSimpleSlots], dv_acc[kSimpleSlots];
#pragma unroll
  for (int i = 0; i < kSimpleSlots; ++i) {
    const int d = lane + 32 * i;
    kv[i] = d < a.Dqk ? __bfloat162float(a.k[row * a.Dqk + d]) : 0.0f;
    vv[i] = d < a.Dv ? __bfloat162float(a.v[row * a.Dv + d]) : 0.0f;
    dk_acc[i] = dv_acc[i] = 0.0f;
  }
  for (int t = j; t < a.T; ++t) {
    if (a.doc_start && a.doc_start[int64_t(b) * a.T + t] > j) continue;
    const int64_t query_row = (int64_t(b) * a.T + t) * a.H + h;
    const float lse = a.lse[(int64_t(b) * a.H + h) * a.T + t];
    const float delta = a.delta[(int64_t(b) * a.H + h) * a.T + t];
    float dot = 0.0f, dpv = 0.0f;
#pragma unroll
    for (int i = 0; i < kSimpleSlots; ++i) {
      const int d = lane + 32 * i;
      if (d < a.Dqk) dot += kv[i] * __bfloat162float(a.q[query_row * a.Dqk + d]);
      if (d < a.Dv) dpv += vv[i] * __bfloat162float(a.dout[query_row * a.Dv + d]);
    }
    const float p = expf(warp_sum(dot) * a.scale - lse);
    const float ds = p * (warp_sum(dpv) - delta);
#pragma unroll
    for (int i = 0; i < kSimpleSlots; ++i) {
      const int d = lane + 32 * i;
      if (d < a.Dqk) dk_acc[i] += ds * __bfloat162float(a.q[query_row * a.Dqk + d]);
      if (d < a.Dv) dv_acc[i] += p * __bfloat162float(a.dout[query_row * a.Dv + d]);
    }
  }
#pragma unroll
  for (int i = 0; i < kSimpleSlots; ++i) {
    const int d = lane + 32 * i;
    if (d < a.Dqk)
      a.dk[row * a.Dqk + d] =
          __float2bfloat16(__bfloat162float(a.dk[row * a.Dqk + d]) + a.scale * dk_acc[i]);
    if (d < a.Dv)
      a.dv[row * a.Dv + d] = __float2bfloat16(__bfloat162float(a.dv[row * a.Dv + d]) + dv_acc[i]);
  }
}

BackwardArgs make_backward_args(const AttentionProblem& p, const uint16_t* q, const uint16_t* k,
                                const uint16_t* v, const uint16_t* o, const float* lse,
                                const uint16_t* dout, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                                void* scratch) {
  BackwardArgs a{};
  a.q = reinterpret_cast<const bf16*>(q);
  a.k = reinterpret_cast<const bf16*>(k);
  a.v = reinterpret_cast<const bf16*>(v);
  a.o = reinterpret_cast<const bf16*>(o);
  a.lse = lse;
  a.dout = reinterpret_cast<const bf16*>(dout);
  a.dq = reinterpret_cast<bf16*>(dq);
  a.dk = reinterpret_cast<bf16*>(dk);
  a.dv = reinterpret_cast<bf16*>(dv);
  a.doc_start = p.doc_start;
  a.delta = static_cast<float*>(scratch);
  a.min_doc_blocks = reinterpret_cast<int32_t*>(
      static_cast<char*>(scratch) + round_up_256(size_t(p.B) * p.H * p.T * sizeof(float)));
  a.B = p.B;
  a.T = p.T;
  a.H = p.H;
  a.Dqk = p.Dqk;
  a.Dv = p.Dv;
  a.scale = p.scale;
  a.scale_log2 = p.scale * kLog2e;
  return a;
}

void launch_backward_preprocess(const BackwardArgs& a, CUstream_st* stream) {
  const int64_t rows = int64_t(a.B) * a.T * a.H;
  const int warps_per_block = 8;
  attention_backward_delta_kernel<<<ceil_div(rows, warps_per_block), warps_per_block * 32, 0,
                                    stream>>>(a);
  check_last_error("attention_backward_delta_kernel");
  if (a.doc_start) {
    const int blocks_per_row = ceil_div(a.T, kMinDocRows);
    const int64_t n = int64_t(a.B) * blocks_per_row;
    attention_backward_min_doc_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(a, blocks_per_row);
    check_last_error("attention_backward_min_doc_kernel");
  }
}

}  // namespace

size_t attention_backward_scratch_bytes(int B, int T, int H) {
  return round_up_256(size_t(B) * H * T * sizeof(float)) +
         round_up_256(size_t(B) * size_t(ceil_div(T, kMinDocRows)) * sizeof(int32_t));
}

void launch_attention_backward_tiled(const AttentionProblem& p, const uint16_t* q,
                                     const uint16_t* k, const uint16_t* v, const uint16_t* o,
                                     const float* lse, const uint16_t* dout, uint16_t* dq,
                                     uint16_t* dk, uint16_t* dv, void* scratch,
                                     CUstream_st* stream) {
  if (p.B == 0 || p.T == 0 || p.H == 0) return;
  const BackwardArgs args = make_backward_args(p, q, k, v, o, lse, dout, dq, dk, dv, scratch);
  launch_backward_preprocess(args, stream);
  if (p.Dqk <= 32 && p.Dv <= 32)
    launch_backward_tiled_instance<32, 32>(args, stream);
  else if (p.Dqk <= 96 && p.Dv <= 64)
    launch_backward_tiled_instance<96, 64>(args, stream);
  else if (p.Dqk <= kTiledMaxDqk && p.Dv <= kTiledMaxDv)
    launch_backward_tiled_instance<kTiledMaxDqk, kTiledMaxDv>(args, stream);
  else
    throw Error(str_cat("attention backward (tiled): head dims Dqk=", p.Dqk, " Dv=", p.Dv,
                        " exceed the instantiated maximum ", kTiledMaxDqk, "/", kTiledMaxDv));
}

void launch_attention_backward_simple(const AttentionProblem& p, const uint16_t* q,
                                      const uint16_t* k, const uint16_t* v, const uint16_t* o,
                                      const float* lse, const uint16_t* dout, uint16_t* dq,
                                      uint16_t* dk, uint16_t* dv, void* scratch,
                                      CUstream_st* stream) {
  if (p.B == 0 || p.T == 0 || p.H == 0) return;
  DM_CHECK(p.Dqk <= kSimpleMaxDim && p.Dv <= kSimpleMaxDim,
           "attention backward (simple): head dims ", p.Dqk, "/", p.Dv, " exceed ", kSimpleMaxDim);
  const BackwardArgs args = make_backward_args(p, q, k, v, o, lse, dout, dq, dk, dv, scratch);
  launch_backward_preprocess(args, stream);
  const int64_t rows = int64_t(p.B) * p.T * p.H;
  const int warps_per_block = 4;
  attention_backward_simple_dq_kernel<<<ceil_div(rows, warps_per_block), warps_per_block * 32, 0,
                                        stream>>>(args);
  check_last_error("attention_backward_simple_dq_kernel");
  attention_backward_simple_dkdv_kernel<<<ceil_div(rows, warps_per_block), warps_per_block * 32,
                                          0, stream>>>(args);
  check_last_error("attention_backward_simple_dkdv_kernel");
}

}  // namespace dm::cuda::attention_detail
