// The per-token pieces of the KDA layer around the operator (SPEC §1.1) on CUDA: the GPU twins of
// ops/cpu/kda_prep.h (short conv + SiLU, the decay gate, β's sigmoid) and ops/cpu/norm_gated.h
// (per-head RMSNorm ⊙ sigmoid(gate)). Plain C++17 header (no CUDA includes) so the C++20 layer
// (model/cuda/kda_gpu.cpp) and nvcc (kda_layer_ops.cu) both include it.
//
// Activations are bf16 bit patterns (uint16_t, device.h float_to_bf16); parameters (conv weights,
// A_log, dt_bias, the norm weight) are fp32 (DeviceWeights::f32). All math is fp32. Every pointer
// is a DEVICE pointer; `stream` is a cudaStream_t (nullptr = default stream); nothing
// synchronises.
#pragma once
#include <cstdint>

struct CUstream_st;

namespace dm::cuda {

using KdaLayerStream = CUstream_st*;

// Depthwise causal conv (kernel Kc, no bias) + SiLU, per row of B:
//   y[b,t,c] = SiLU(Σ_j w[c,j]·x[b, t−Kc+1+j, c])   over positions ≥ max(0, doc_start[b·T+t])
// x, y [B, T, C] bf16; w [C, Kc] fp32 (Kc ≤ 8); doc_start [B·T] int32 (nullable: one document
// per row). Positions before 0 read zeros (no carried tail: that is the prefill/decode path).
// y ≠ x.
void kda_short_conv_silu_forward(const uint16_t* x, const float* w, uint16_t* y, int64_t B,
                                 int64_t T, int64_t C, int Kc, const int32_t* doc_start,
                                 KdaLayerStream stream = nullptr);

// Log-decay g [N, H·K] from the raw low-rank gate output f [N, H·K] (head h = column / K):
//   softplus (safe_gate = false): g = −exp(A_log[h]) · softplus(f + dt_bias)  (linear above 20)
//   safe     (safe_gate = true):  g = lower_bound · sigmoid(exp(A_log[h]) · (f + dt_bias))
// f, g bf16 (g may alias f); A_log [H], dt_bias [H·K] fp32.
void kda_gate_forward(const uint16_t* f, const float* A_log, const float* dt_bias, uint16_t* g,
                      int64_t N, int64_t H, int64_t K, bool safe_gate, float lower_bound,
                      KdaLayerStream stream = nullptr);

// β = sigmoid(z) for n elements: z fp32 (the b_proj GEMM output, [N, H]), β bf16.
void kda_beta_sigmoid_forward(const float* z, uint16_t* beta, int64_t n,
                              KdaLayerStream stream = nullptr);

// Gated RMSNorm per row of D (one row = one head of one token):
//   y = x · rsqrt(mean(x²) + eps) · w ⊙ sigmoid(gate)
// x, gate, y [rows, D] bf16 (y may alias x); w [D] fp32.
void kda_rmsnorm_gated_forward(const uint16_t* x, const float* w, const uint16_t* gate,
                               uint16_t* y, int64_t rows, int64_t D, float eps,
                               KdaLayerStream stream = nullptr);

// ---- fp32 twins (the fp32 GPU mode: model/cuda/layers.h with float activations) ------------
// The same math and argument rules as the bf16 versions above, with every activation fp32 (no
// rounding anywhere): the GPU side of the CPU float engine, checked against it at 1e-5.
void kda_short_conv_silu_forward(const float* x, const float* w, float* y, int64_t B, int64_t T,
                                 int64_t C, int Kc, const int32_t* doc_start,
                                 KdaLayerStream stream = nullptr);
void kda_gate_forward(const float* f, const float* A_log, const float* dt_bias, float* g, int64_t N,
                      int64_t H, int64_t K, bool safe_gate, float lower_bound,
                      KdaLayerStream stream = nullptr);
void kda_beta_sigmoid_forward(const float* z, float* beta, int64_t n,
                              KdaLayerStream stream = nullptr);
void kda_rmsnorm_gated_forward(const float* x, const float* w, const float* gate, float* y,
                               int64_t rows, int64_t D, float eps, KdaLayerStream stream = nullptr);

}  // namespace dm::cuda
