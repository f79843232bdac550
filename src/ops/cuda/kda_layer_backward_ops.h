// Backwards of the per-token pieces of the KDA layer around the operator (SPEC §1.1) on CUDA: the
// GPU twins of ops/cpu/kda_prep.h short_conv_silu_backward / kda_gate_backward, the β sigmoid of
// model/kda.cpp and ops/cpu/norm_gated.h rmsnorm_gated_backward. Forwards in kda_layer_ops.h.
// Plain C++17 header (no CUDA includes).
//
// Activations are bf16 bit patterns (uint16_t); parameters and their gradients fp32; the
// gradients that feed element-wise math (dy of the norm, dg, dβ, the operator's dq/dk/dv) fp32;
// the gradients that only feed GEMMs (dx of the norm, d gate, df, d raw, dz of β) bf16. All
// math is fp32. Every pointer is a DEVICE pointer; `stream` a cudaStream_t; nothing synchronises.
//
// Parameter gradients (o_norm, A_log, dt_bias, conv weights) are sums over rows, taken
// deterministically in two stages: each block of a fixed row range writes its partial sums to
// `partial` (fp32 scratch, *_partial_floats of it), then one block per parameter element adds
// the partials in a fixed order and ACCUMULATES (+=) the total into the gradient. No float
// atomics: the same inputs give the same bits.
#pragma once
#include <cstddef>
#include <cstdint>

struct CUstream_st;

namespace dm::cuda {

// Largest row length (head dim) of kda_rmsnorm_gated_backward: each lane keeps D/32 partial sums.
constexpr int64_t kKdaNormBackwardMaxD = 256;

// Gated RMSNorm backward per row of D (y = x·r·w ⊙ σ(gate), r = rsqrt(mean(x²) + eps)):
//   dgate = dy·x·r·w·σ(1−σ);  dx = r·(dy·w·σ − x·r·mean(dy·w·σ·x·r));  dw += Σ_rows dy·x·r·σ.
// x, gate [rows, D] bf16; w [D] fp32; dy [rows, D] fp32 → dx, dgate [rows, D] bf16 (WRITTEN;
// dx may not alias dy), dw [D] fp32 (+=). partial: kda_rmsnorm_gated_backward_partial_floats.
// dgate as a column block of wider rows: with dgate_ld > 0 the [rows·D / dgate_width,
// dgate_width] matrix (dgate_width a multiple of D: the H·K of one token) has its rows dgate_ld
// apart (the layer's joint input-gradient operand).
size_t kda_rmsnorm_gated_backward_partial_floats(int64_t rows, int64_t D);
void kda_rmsnorm_gated_backward(const uint16_t* x, const float* w, const uint16_t* gate,
                                const float* dy, uint16_t* dx, uint16_t* dgate, float* dw,
                                float* partial, int64_t rows, int64_t D, float eps,
                                CUstream_st* stream = nullptr, int64_t dgate_width = 0,
                                int64_t dgate_ld = 0);

// Decay gate backward (formulas of kda_gate_forward in kda_layer_ops.h), with z = f + dt_bias:
//   softplus: dz = −dg·a·σ(z) (−dg·a above 20),   dA_log[h] += Σ −dg·a·softplus(z)
//   safe:     dz = dg·lb·σ(1−σ)·a  (σ = σ(a·z)),  dA_log[h] += Σ dg·lb·σ(1−σ)·a·z
//   df = dz (WRITTEN, bf16), ddt_bias[c] += Σ_rows dz.
// f [N, H·K] bf16 (the raw gate output of the forward); dg [N, H·K] fp32; A_log [H], dt_bias
// [H·K] fp32. partial: kda_gate_backward_partial_floats.
size_t kda_gate_backward_partial_floats(int64_t N, int64_t H, int64_t K);
void kda_gate_backward(const uint16_t* f, const float* A_log, const float* dt_bias,
                       const float* dg, uint16_t* df, float* dA_log, float* ddt_bias,
                       float* partial, int64_t N, int64_t H, int64_t K, bool safe_gate,
                       float lower_bound, CUstream_st* stream = nullptr);

// β = σ(z) backward: dz = dβ·σ(z)(1−σ(z)) from the fp32 logits z (not the rounded β), n values;
// dz bf16 (WRITTEN). With width > 0 the values are rows of `width` (n a multiple of it) and dz's
// rows are ld_dz apart (a column block of a wider matrix: the layer's fused input-gradient
// product); width 0: dz contiguous.
void kda_beta_sigmoid_backward(const float* z, const float* dbeta, uint16_t* dz, int64_t n,
                               CUstream_st* stream = nullptr, int64_t width = 0, int64_t ld_dz = 0);

// Short conv + SiLU backward (kda_short_conv_silu_forward: no carried tail, positions before 0
// or before doc_start[b·T+t] read zeros). x [B, T, C] bf16 (the raw projection of the forward);
// w [C, Kc] fp32 (Kc ≤ 8). dy [B, T, C] fp32: the gradient of the SiLU output (read only).
// dx [B, T, C] bf16 WRITTEN (≠ x), its rows ld_dx ≥ C apart (0: C; a column block of a wider
// matrix, as the layer's fused q/k/v input-gradient product reads them); dw [C, Kc] fp32 (+=).
// One fused pass (short_conv.cu). partial: kda_short_conv_silu_backward_partial_floats.
size_t kda_short_conv_silu_backward_partial_floats(int64_t N, int64_t C, int Kc);
void kda_short_conv_silu_backward(const uint16_t* x, const float* w, const float* dy, uint16_t* dx,
                                  float* dw, float* partial, int64_t B, int64_t T, int64_t C,
                                  int Kc, const int32_t* doc_start, CUstream_st* stream = nullptr,
                                  int64_t ld_dx = 0);

}  // namespace dm::cuda
