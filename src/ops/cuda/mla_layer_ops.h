// Element/row kernels of the gated MLA layer on the GPU (model/cuda/mla_gpu.cpp forward,
// mla_gpu_backward.cpp backward; the twins of model/mla.cpp): the latent RMSNorms, the RoPE tables
// and rotation, the assembly of the expanded keys/values and the output gate, and their
// backward counterparts. Plain C++17 header (no CUDA includes) for nvcc and
// the host compiler alike; kernels in mla_layer_ops.cu.
//
// Every pointer is a DEVICE pointer; bf16 tensors are their uint16_t bit patterns. Shapes use
// N = B·T tokens, H heads, nope/rope/dv the per-head dims, dq = nope + rope, kvl = kv_lora.
// doc_start [B, T] int32 (nullable): RoPE positions restart at every document,
// pos(b, t) = t − doc_start[b·T + t] (ops/cpu rope_positions_from_doc_start); nullptr → pos = t.
// `stream` is a cudaStream_t (nullptr = default stream); nothing here synchronises.
#pragma once
#include <cstdint>

struct CUstream_st;

namespace dm::cuda {

// Interleaved-pair RoPE frequencies as the CPU tables use them (ops/cpu/rope.cpp): pair i
// rotates by pos·freq[i] and both cos and sin carry the YaRN amplitude (1 without YaRN).
inline constexpr int kMlaMaxRopeHalf = 256;
struct MlaRopeFrequencies {
  int half = 0;                     // rotary dim / 2 (≤ kMlaMaxRopeHalf)
  double amplitude = 1.0;
  float freq[kMlaMaxRopeHalf] = {};  // fp32 frequencies, as the checkpoint saw them
};

// cos, sin [T, half] fp32: cos[t, i] = float(cos(t·freq[i]) · amplitude), angle in double like
// rope_build_tables.
void mla_rope_tables_device(const MlaRopeFrequencies& f, int64_t T, float* cos, float* sin,
                            CUstream_st* stream = nullptr);

// y[n, 0:D] = x[n, 0:D] · r_n · w,  r_n = 1/sqrt(mean(x[n, 0:D]²) + eps), one block per row.
// x fp32 rows of leading dim ldx ≥ D (so the latent c is read straight out of kv_a
// [N, kvl + rope]); w [D] fp32; y [N, D] bf16, contiguous.
void mla_rmsnorm_rows(const float* x, int64_t ldx, const float* w, uint16_t* y, int64_t N,
                      int64_t D, double eps, CUstream_st* stream = nullptr);

// In place on q [N, H, dq] bf16: the slice [nope, nope + rope) of every (token, head) row is
// rotated by its token's position (pairs (2i, 2i+1), fp32 math). cos/sin: the [T, rope/2] tables.
void mla_rope_queries(uint16_t* q, int64_t B, int64_t T, int64_t H, int64_t nope, int64_t rope,
                      const float* cos, const float* sin, const int32_t* doc_start,
                      CUstream_st* stream = nullptr);

// Expanded keys and values from kv = W_kvb c [N, H, nope + dv] bf16 and kv_a [N, kvl + rope]
// fp32 (the shared rope key kr is kv_a[n, kvl:]):
//   k[n, h, :] = [kv[n, h, 0:nope] | R(pos_n)·kr_n]   [N, H, dq]  bf16
//   v[n, h, :] =  kv[n, h, nope:]                     [N, H, dv]  bf16
// cos == nullptr: RoPE off (kr copied unrotated, the NoPE layer's shared key slice).
void mla_assemble_kv(const uint16_t* kv, const float* kv_a, int64_t B, int64_t T, int64_t H,
                     int64_t nope, int64_t rope, int64_t dv, int64_t kvl, const float* cos,
                     const float* sin, const int32_t* doc_start, uint16_t* k, uint16_t* v,
                     CUstream_st* stream = nullptr);

// Output gate, in place: o[i] = o[i] · sigmoid(g[i]) for i < n (o, g bf16; fp32 math).
void mla_gate_multiply(uint16_t* o, const uint16_t* g, int64_t n, CUstream_st* stream = nullptr);

// fp32 twins of the four forward kernels above (the fp32 GPU mode): same math and arguments,
// every activation fp32 (y, q, kv, k, v, o, g), nothing rounded.
void mla_rmsnorm_rows(const float* x, int64_t ldx, const float* w, float* y, int64_t N, int64_t D,
                      double eps, CUstream_st* stream = nullptr);
void mla_rope_queries(float* q, int64_t B, int64_t T, int64_t H, int64_t nope, int64_t rope,
                      const float* cos, const float* sin, const int32_t* doc_start,
                      CUstream_st* stream = nullptr);
void mla_assemble_kv(const float* kv, const float* kv_a, int64_t B, int64_t T, int64_t H,
                     int64_t nope, int64_t rope, int64_t dv, int64_t kvl, const float* cos,
                     const float* sin, const int32_t* doc_start, float* k, float* v,
                     CUstream_st* stream = nullptr);
void mla_gate_multiply(float* o, const float* g, int64_t n, CUstream_st* stream = nullptr);

// ---- Backward ----------------------------------------------------------------------------------

// Out of place: out[i] = bf16(o[i] · sigmoid(g[i])) (the training recompute keeps o ungated for
// the attention backward). o, g, out bf16 [n]; out must not alias o or g.
void mla_gate_multiply_into(const uint16_t* o, const uint16_t* g, uint16_t* out, int64_t n,
                            CUstream_st* stream = nullptr);

// Backward of o_gated = o ⊙ σ(g) given d_out = ∂L/∂o_gated (fp32), WRITTEN, fp32 math:
//   dg[i] = bf16(d_out[i] · o[i] · σ(g[i]) · (1 − σ(g[i])))   (∂L/∂g, the W_gate GEMM operand)
//   d_o[i] = bf16(d_out[i] · σ(g[i]))                           (∂L/∂o, the attention's dout)
// d_out fp32 [n]; o, g, dg, d_o bf16 [n]; dg and d_o must not alias the inputs or each other.
void mla_gate_backward(const float* d_out, const uint16_t* o, const uint16_t* g, uint16_t* dg,
                       uint16_t* d_o, int64_t n, CUstream_st* stream = nullptr);

// Transpose of mla_rope_queries, in place on dq [N, H, dq] bf16: the slice [nope, nope + rope)
// of every row is rotated by −angle with the same tables (the tables carry the YaRN amplitude,
// so this is the exact transpose of the forward map, as ops/cpu rope_apply_interleaved_inverse).
void mla_rope_queries_backward(uint16_t* dq, int64_t B, int64_t T, int64_t H, int64_t nope,
                               int64_t rope, const float* cos, const float* sin,
                               const int32_t* doc_start, CUstream_st* stream = nullptr);

// Transpose of mla_assemble_kv given dk [N, H, dq] and dv [N, H, dv] (bf16):
//   d_kv[n, h, :]      = [dk[n, h, 0:nope] | dv[n, h, :]]      [N, H, nope + dv] bf16 (WRITTEN)
//   d_kv_a[n, kvl + r] = (Rᵀ(pos_n) · Σ_h dk[n, h, nope:])_r    r < rope, bf16 (WRITTEN)
// The shared rope key kr is read by every head, so its gradient is the sum over heads (fp32, in
// head order, like the CPU), rotated back when cos != nullptr (RoPE on). d_kv_a has leading dim
// kvl + rope; its first kvl columns are NOT touched (the latent RMSNorm backward fills them).
void mla_split_kv_grad(const uint16_t* dk, const uint16_t* dv, int64_t B, int64_t T, int64_t H,
                       int64_t nope, int64_t rope, int64_t dv_dim, int64_t kvl, const float* cos,
                       const float* sin, const int32_t* doc_start, uint16_t* d_kv,
                       uint16_t* d_kv_a, CUstream_st* stream = nullptr);

// Strided row copy: y[n, 0:D] = x[n, 0:D] for n < N, x fp32 with leading dim ldx ≥ D, y fp32 or
// bf16 (rounded to nearest even) with leading dim ldy ≥ D. Must not alias.
void mla_copy_rows(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t N, int64_t D,
                   CUstream_st* stream = nullptr);
void mla_copy_rows(const float* x, int64_t ldx, uint16_t* y, int64_t ldy, int64_t N, int64_t D,
                   CUstream_st* stream = nullptr);

}  // namespace dm::cuda
