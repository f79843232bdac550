// Row kernels of the cached GPU decode step (model/cuda/decode_gpu.cpp): one new token per active
// slot, n rows: what the prefill layer kernels (kda_layer_ops.h, mla_layer_ops.h: gate, β, gated
// RMSNorm, latent norm, output gate — shared with decode) do not cover: the conv step against
// the carried tail (model/kda.cpp kda_layer_decode), and from model/mla_decode.cpp the latent
// row → paged cache at the slot's position and the absorbed query's RoPE half.
// Plain C++17 header (no CUDA includes) for nvcc and the host compiler.
//
// Every pointer is a DEVICE pointer; bf16 tensors are their uint16_t bit patterns; parameters
// (conv weights, A_log, dt_bias, norm weights) are fp32; all math is fp32. Row r of a step is
// slot slots[r] at position positions[r]. `stream` is a cudaStream_t (nullptr = default stream);
// nothing here synchronises.
#pragma once
#include <cstdint>

struct CUstream_st;

namespace dm::cuda {

using DecodeStream = CUstream_st*;

// Per-step row bookkeeping, one block per row r (slot = slots[r]):
//   positions[r] = lengths[slot];  seq_len[r] = positions[r] + 1;  lengths[slot] += 1;
//   row_table[r, :] = page_table[slot, :]            (page tables [·, P] int32)
// so the attention kernel sees per-row page tables of the compacted batch. Each slot must
// appear at most once in slots.
void decode_prepare_rows(const int32_t* slots, int64_t n, int32_t* lengths,
                         const int32_t* page_table, int64_t P, int32_t* positions,
                         int32_t* seq_len, int32_t* row_table, DecodeStream stream = nullptr);

// ---- KDA ----------------------------------------------------------------------------------
// The short conv (kernel Kc, no bias) + SiLU of ONE token per row, for the q, k and v branches
// at once, against each slot's carried raw inputs, then the tail advances by one row:
//   out[r, c] = SiLU(Σ_{j<Kc−1} w[c, j]·tail[slot, j, c] + w[c, Kc−1]·raw[r, c])
//   tail[slot, 0:Kc−2] ← tail[slot, 1:Kc−1];  tail[slot, Kc−2] ← raw[r]
// raw, out [n, C] bf16; w [C, Kc] fp32; tail [S, Kc−1, C] bf16 (unused when Kc == 1).
struct KdaConvStepArgs {
  const uint16_t* raw[3] = {};
  const float* weight[3] = {};
  uint16_t* tail[3] = {};
  uint16_t* out[3] = {};
};
void decode_kda_conv_step(const KdaConvStepArgs& a, const int32_t* slots, int64_t n, int64_t C,
                          int Kc, DecodeStream stream = nullptr);

// The recurrent KDA operator (ops/cuda/kda.h, T = 1) of row r against slot slots[r]'s state, in
// place: state [S, H, K, V] fp32, q, k, g [n, H, K], v, o [n, H, V], beta [n, H] bf16. One
// launch for any set of distinct slots (the slot → row mapping is data, so a captured CUDA graph
// serves every set of n active slots). K ≤ kKdaCudaRecurrentMaxK. Implemented in
// kda_recurrent.cu (the same kernel).
// The gate and β arrive raw and are applied inside the step's kernel (two launches fewer per
// KDA layer): g = kda_gate_forward's formula of f and β = σ(z), each rounded to bf16 as those
// two kernels store them, so the step sees the same bits as after them.
struct KdaStepGates {
  const uint16_t* f = nullptr;         // [n, H·K] bf16: the gate's low-rank up-projection
  const float* A_log = nullptr;        // [H]
  const float* dt_bias = nullptr;      // [H·K]
  const float* beta_logits = nullptr;  // [n, H] fp32
  bool safe_gate = false;
  float lower_bound = 0.0f;
};
void decode_kda_recurrent_step(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                               const KdaStepGates& gates, float* state, const int32_t* slots,
                               uint16_t* o, int64_t n, int64_t H, int64_t K, int64_t V, float scale,
                               DecodeStream stream = nullptr);

// The conv step, the gate's and the output gate's up-projections, the recurrent step and the
// gated RMSNorm of a KDA layer in one launch (kda_decode_fused.cu; the same values as
// decode_kda_conv_step → f GEMV → decode_kda_recurrent_step → g GEMV → kda_rmsnorm_gated but
// for the order of the two GEMVs' sums), for K = V = kKdaFusedHeadDim, conv kernels up to
// kKdaFusedMaxConv and n ≤ kKdaFusedMaxRows rows (kda_decode_fused_applies; each row reads its
// heads' gate weights, which the unfused step's GEMM over many rows reads once):
//   raw[b] [n, H·K] bf16 (q, k, v before the conv), conv_weight[b] [H·K, Kc] fp32, tail[b]
//   [S, Kc−1, H·K] bf16; low [n, K] bf16 (W_f↓ x) and f_up [H·K, K] bf16 (W_f↑); A_log [H],
//   dt_bias [H·K] fp32; beta_logits [n, H] fp32; the output gate as low_gate [n, K] with g_up
//   [H·K, K] (low rank), or as gate [n, H·K] bf16 (full rank; g_up = nullptr); norm_weight [K]
//   fp32; state [S, H, K, K] fp32 in place; out [n, H·K] bf16 = RMSNorm(o)·w·σ(gate).
// Tensors read 16 bytes at a time (low, low_gate, f_up, g_up) must be 16-byte aligned.
constexpr int kKdaFusedHeadDim = 128;
constexpr int kKdaFusedMaxConv = 8;
constexpr int kKdaFusedMaxRows = 4;
struct KdaFusedStepArgs {
  int64_t H = 0;
  int conv_kernel = 0;
  float scale = 1.0f, eps = 0.0f, lower_bound = 0.0f;
  bool safe_gate = false;
  const uint16_t* raw[3] = {};
  const float* conv_weight[3] = {};
  uint16_t* tail[3] = {};
  const uint16_t *low = nullptr, *f_up = nullptr;
  const float *A_log = nullptr, *dt_bias = nullptr, *beta_logits = nullptr;
  const uint16_t *low_gate = nullptr, *g_up = nullptr, *gate = nullptr;
  const float* norm_weight = nullptr;
  float* state = nullptr;
  const int32_t* slots = nullptr;
  uint16_t* out = nullptr;
};
bool kda_decode_fused_applies(int64_t n, int64_t K, int64_t V, int conv_kernel);
void decode_kda_fused_step(const KdaFusedStepArgs& a, int64_t n, DecodeStream stream = nullptr);

// ---- MLA ----------------------------------------------------------------------------------
// Writes each row's latent cache row [RMSNorm(c)·w ; RoPE(kr)] (kvl + rope wide, bf16) into its
// slot's page: page row_table[r, pos / page_tokens], row pos % page_tokens of
// pages [num_pages, page_tokens, kvl + rope]. kv_a [n, kvl + rope] fp32 (the W_kva GEMM);
// cos/sin [positions, rope/2] fp32 tables (nullptr: RoPE off, kr copied as is). Interleaved
// pairs: (x0, x1) → (x0·cos − x1·sin, x1·cos + x0·sin), as ops/cpu/rope.cpp.
void decode_mla_write_latent(const float* kv_a, const float* norm_w, int64_t n, int64_t kvl,
                             int64_t rope, float eps, const float* cos, const float* sin,
                             const int32_t* positions, const int32_t* row_table, int64_t P,
                             int64_t page_tokens, uint16_t* pages, DecodeStream stream = nullptr);

// The absorbed step's per-head products for n ≤ kMlaDecodeProjectionMaxRows rows (own kernels,
// launched with PDL; mla_decode_projections.cu), W_kvb [H·(nope + dv), kvl] bf16:
//   absorb_query:  q_abs[r, h, :kvl] = q[r, h, :nope]·W_k,h (W_k,h = rows h·(nope + dv) + [0,
//                  nope)), q_abs[r, h, kvl:] = RoPE(q[r, h, nope:]) as decode_mla_query_rope;
//   value_projection: o[r, h·dv + d] = W_v,h[d, :]·latent[r, h, :] (W_v,h = rows h·(nope + dv)
//                  + nope + d), latent [n, H, kvl] bf16, o [n, H·dv] bf16.
// decode_mla_projections_apply: n in range, kvl a multiple of 8, W_kvb and latent 16-byte
// aligned (nullptr passes). Larger batches keep the strided-batched GEMMs.
constexpr int64_t kMlaDecodeProjectionMaxRows = 4;
bool decode_mla_projections_apply(int64_t n, int64_t kvl, const uint16_t* kv_b,
                                  const uint16_t* latent);
void decode_mla_absorb_query(const uint16_t* q, const uint16_t* kv_b, int64_t n, int64_t H,
                             int64_t nope, int64_t rope, int64_t kvl, int64_t dv, const float* cos,
                             const float* sin, const int32_t* positions, uint16_t* q_abs,
                             DecodeStream stream = nullptr);
void decode_mla_value_projection(const uint16_t* latent, const uint16_t* kv_b, int64_t n, int64_t H,
                                 int64_t nope, int64_t kvl, int64_t dv, uint16_t* o,
                                 DecodeStream stream = nullptr);

// The rope half of the absorbed queries: q_abs[r, h, kvl + i] = RoPE(q[r, h, nope + i]) at
// positions[r] (unrotated when cos == nullptr). q [n, H, nope + rope] bf16,
// q_abs [n, H, kvl + rope] bf16 (its first kvl columns are the absorbed key part, not touched).
void decode_mla_query_rope(const uint16_t* q, int64_t n, int64_t H, int64_t nope, int64_t rope,
                           int64_t kvl, const float* cos, const float* sin,
                           const int32_t* positions, uint16_t* q_abs,
                           DecodeStream stream = nullptr);

}  // namespace dm::cuda
