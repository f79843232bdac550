// Gated MLA layer backward on the GPU (layers.h), the twin of model/mla.cpp mla_layer_backward.
// The forward internals are recomputed from xn by the forward's own code
// (mla_detail::mla_forward_core, with the attention's lse this time) unless the forward kept
// them (training without recompute: MlaKeptViews), then the chain runs in reverse (shapes: N = B·T,
// H heads, dq = nope + rope, dv = v_head, kvl = kv_lora, ql = q_lora):
//
//   y = W_o o_g             dW_o += dyᵀ o_g;          d_out = dy W_o                 [N, H·dv]
//   o_g = o ⊙ σ(g)          dg = d_out ⊙ o ⊙ σ(1−σ);  d_o = d_out ⊙ σ;  g = W_gate x
//   o = attn(q, k, v)       dq, dk, dv (flash backward from o and lse)               bf16
//   k_h = [k_nope_h | R kr]  d[k_nope|v]_h = [dk_nope_h | dv_h];  dkr = Rᵀ Σ_h dk_rope_h
//   [k_nope|v] = W_kvb c    dW_kvb += …;  dc = d[k_nope|v] W_kvb                      fp32
//   c = RMSNorm(c_raw)      dc_raw (fp32), dw_kv_a_norm (deterministic two-stage sum)
//   [c_raw;kr] = W_kva x    dW_kva += …;  dx += [dc_raw ; dkr] W_kva
//   q = W_qb RMSNorm(q_a), q_a = W_qa x  (or q = W_q x), after dq ← Rᵀ dq (RoPE on)
//
// Precision: GEMM operands bf16 (dy rounded once), outputs feeding an RMSNorm backward fp32,
// element-wise math fp32. dxn is WRITTEN by the first projection backward that reaches it and
// accumulated by the others; parameter gradients are accumulated (+=) into `grads`.
#include <algorithm>
#include <vector>

#include "core/error.h"
#include "model/cuda/layers.h"
#include "model/cuda/mla_gpu_internal.h"
#include "ops/cpu/attention.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/mla_layer_ops.h"
#include "ops/cuda/moe_layer_ops.h"

namespace dm::cuda {

namespace {

using namespace mla_detail;

// Carves views from the arena, or (arena == nullptr) only records their byte sizes: the byte
// count and the call walk the same BackwardViews::layout, so they cannot drift apart.
struct Carver {
  DeviceArena* arena = nullptr;
  std::vector<size_t>* sizes = nullptr;

  template <class T>
  T* take(int64_t count) {
    const size_t bytes = size_t(std::max<int64_t>(count, 0)) * sizeof(T);
    if (!arena) {
      sizes->push_back(bytes);
      return nullptr;
    }
    return static_cast<T*>(arena->alloc_bytes(bytes));
  }
  void* take_bytes(size_t bytes) { return take<unsigned char>(int64_t(bytes)); }
};

// The backward's own scratch, carved after the forward's views (MlaForwardViews).
struct BackwardViews {
  float* lse = nullptr;             // [B, H, T] fp32, the recomputed attention's log-sum-exp
  uint16_t* dy = nullptr;           // [N, d] bf16, dy rounded once for the GEMMs
  uint16_t* gated = nullptr;        // [N, H·dv] bf16, o ⊙ σ(g) = W_o's input (gate on only)
  float* d_out = nullptr;           // [N, H·dv] fp32, ∂L/∂o_g (gate on only)
  uint16_t* dg = nullptr;           // [N, H·dv] bf16, ∂L/∂(W_gate x) (gate on only)
  uint16_t* d_o = nullptr;          // [N, H·dv] bf16, ∂L/∂o (attention's dout)
  void* attention_workspace = nullptr;
  uint16_t* dq = nullptr;           // [N, H, dq] bf16 (accumulated by the attention: zeroed)
  uint16_t* dk = nullptr;           // [N, H, dq] bf16 (idem)
  uint16_t* dv = nullptr;           // [N, H, dv] bf16 (idem)
  uint16_t* d_kv = nullptr;         // [N, H, nope + dv] bf16, ∂L/∂(W_kvb c)
  uint16_t* d_kv_a = nullptr;       // [N, kvl + rope] bf16, ∂L/∂(W_kva x) = [dc_raw ; dkr]
  float* c_raw = nullptr;           // [N, kvl] fp32, contiguous copy of kv_a[:, :kvl]
  float* dc = nullptr;              // [N, kvl] fp32, ∂L/∂c (the norm's output)
  float* dc_raw = nullptr;          // [N, kvl] fp32, ∂L/∂c_raw (accumulated by the norm: zeroed)
  void* norm_workspace = nullptr;   // shared by both RMSNorm backwards (stream-ordered)
  float* d_qa_normed = nullptr;     // [N, ql] fp32 (q LoRA only)
  float* d_qa = nullptr;            // [N, ql] fp32 (q LoRA only; zeroed)
  uint16_t* d_qa_bf16 = nullptr;    // [N, ql] bf16 (q LoRA only)

  static BackwardViews layout(Carver& c, const MlaDims& s) {
    const int64_t N = s.N, H = s.H, hdv = s.N * s.H * s.dv;
    BackwardViews v;
    v.lse = c.take<float>(s.B * H * s.T);
    v.dy = c.take<uint16_t>(N * s.d);
    if (s.gate) {
      v.gated = c.take<uint16_t>(hdv);
      v.d_out = c.take<float>(hdv);
      v.dg = c.take<uint16_t>(hdv);
    }
    v.d_o = c.take<uint16_t>(hdv);
    const AttnShape shape{s.B, s.T, H, s.dq, s.dv};
    v.attention_workspace = c.take_bytes(cuda::attention_causal_backward_workspace_bytes(shape));
    v.dq = c.take<uint16_t>(N * H * s.dq);
    v.dk = c.take<uint16_t>(N * H * s.dq);
    v.dv = c.take<uint16_t>(hdv);
    v.d_kv = c.take<uint16_t>(N * H * (s.nope + s.dv));
    v.d_kv_a = c.take<uint16_t>(N * (s.kvl + s.rope));
    v.c_raw = c.take<float>(N * s.kvl);
    v.dc = c.take<float>(N * s.kvl);
    v.dc_raw = c.take<float>(N * s.kvl);
    v.norm_workspace =
        c.take_bytes(std::max(rmsnorm_backward_workspace_bytes(N, s.kvl),
                              s.ql > 0 ? rmsnorm_backward_workspace_bytes(N, s.ql) : size_t(0)));
    if (s.ql > 0) {
      v.d_qa_normed = c.take<float>(N * s.ql);
      v.d_qa = c.take<float>(N * s.ql);
      v.d_qa_bf16 = c.take<uint16_t>(N * s.ql);
    }
    return v;
  }
};

}  // namespace

size_t mla_layer_backward_gpu_bytes(const ModelConfig& c, int64_t B, int64_t T) {
  const MlaDims s(c, B, T);
  std::vector<size_t> views = s.forward_views();
  Carver counter{nullptr, &views};
  BackwardViews::layout(counter, s);
  return arena_bytes(views);
}

void mla_layer_backward_gpu(GpuRun& run, const DeviceWeights& dw, const DeviceGrads& grads,
                            const MlaWeights& w, const uint16_t* xn, const float* dy, float* dxn,
                            int64_t B, int64_t T, const int32_t* doc_start, const void* kept) {
  const ModelConfig& cfg = dw.config();
  const MlaDims s(cfg, B, T);
  check_dims(s, "mla_layer_backward_gpu");
  if (s.N == 0) return;
  DM_CHECK(xn && dy && dxn, "mla_layer_backward_gpu: null xn, dy or dxn");
  DeviceArenaScope scope(run.scratch);
  CUstream_st* stream = run.stream;
  const int64_t N = s.N, d = s.d, H = s.H, dq = s.dq, dv = s.dv, kvl = s.kvl, ql = s.ql;
  const int64_t nope = s.nope, rope = s.rope, hdv = H * dv;
  const double eps = cfg.mla.latent_norm_eps;

  // Same carve order as mla_layer_backward_gpu_bytes: the forward's views, then ours. With
  // `kept` the forward left its views and the lse there (MlaKeptViews) and nothing is
  // recomputed.
  MlaForwardViews f;
  float* lse = nullptr;
  if (kept) {
    const MlaKeptViews k = MlaKeptViews::carve(const_cast<void*>(kept), s);
    f = k.f;
    lse = k.lse;
  } else {
    f = MlaForwardViews::carve(run.scratch, s);
  }
  Carver carver{&run.scratch, nullptr};
  const BackwardViews b = BackwardViews::layout(carver, s);
  if (!kept) {
    // Recompute: q, c, k, v, the ungated o with its lse, and the gate pre-activation.
    lse = b.lse;
    mla_forward_core(run, dw, w, s, f, xn, doc_start, lse);
  }

  // dxn: the first projection backward writes it (beta 0), the later ones accumulate.
  bool dxn_written = false;
  auto dxn_beta = [&dxn_written]() {
    const float beta = dxn_written ? 1.0f : 0.0f;
    dxn_written = true;
    return beta;
  };

  // y = W_o o_g: dW_o += dyᵀ o_g; d_out = dy W_o (fp32 when the gate backward follows, else
  // directly the bf16 dout of the attention).
  convert_f32_to_bf16(dy, b.dy, N * d, stream);
  if (s.gate) {
    mla_gate_multiply_into(f.o, f.gate, b.gated, N * hdv, stream);
    linear_backward(run, b.gated, dw.bf16(w.o_proj), b.dy, N, hdv, d, b.d_out, GemmOutType::F32,
                    0.0f, grads, w.o_proj);
    // o_g = o ⊙ σ(g), g = W_gate x.
    mla_gate_backward(b.d_out, f.o, f.gate, b.dg, b.d_o, N * hdv, stream);
    linear_backward(run, xn, dw.bf16(w.gate), b.dg, N, d, hdv, dxn, GemmOutType::F32, dxn_beta(),
                    grads, w.gate);
  } else {
    linear_backward(run, f.o, dw.bf16(w.o_proj), b.dy, N, hdv, d, b.d_o, GemmOutType::Bf16, 0.0f,
                    grads, w.o_proj);
  }

  // Attention (writes dq, dk, dv; cuDNN's fused kernels when there are no packed documents).
  cuda::attention_causal_backward(f.q, f.k, f.v, f.o, lse, b.d_o, b.dq, b.dk, b.dv,
                                  AttnShape{s.B, s.T, H, dq, dv}, mla_gpu_softmax_scale(cfg),
                                  b.attention_workspace, doc_start, stream);

  // k_h = [k_nope_h | R kr], v_h  →  d[k_nope | v]_h and dkr = Rᵀ Σ_h dk_rope_h (into the
  // rope-key columns of d_kv_a).
  mla_split_kv_grad(b.dk, b.dv, s.B, s.T, H, nope, rope, dv, kvl, f.rope_cos, f.rope_sin,
                    doc_start, b.d_kv, b.d_kv_a, stream);

  // [k_nope | v] = W_kvb c:  dW_kvb += d_kvᵀ c;  dc = d_kv W_kvb   [N, kvl] fp32.
  linear_backward(run, f.c, dw.bf16(w.kv_b), b.d_kv, N, kvl, H * (nope + dv), b.dc,
                  GemmOutType::F32, 0.0f, grads, w.kv_b);
  // c = RMSNorm(c_raw): the op wants contiguous rows, and c_raw sits in kv_a with leading dim
  // kvl + rope; dc_raw is stored.
  mla_copy_rows(f.kv_a, kvl + rope, b.c_raw, kvl, N, kvl, stream);
  rmsnorm_backward(b.c_raw, dw.f32(w.kv_a_norm), b.dc, b.dc_raw, grads.at(w.kv_a_norm), N, kvl, eps,
                   b.norm_workspace, stream, /*accumulate_dx=*/false);
  mla_copy_rows(b.dc_raw, kvl, b.d_kv_a, kvl + rope, N, kvl, stream);  // → d_kv_a[:, :kvl]
  // [c_raw ; kr] = W_kva x.
  linear_backward(run, xn, dw.bf16(w.kv_a), b.d_kv_a, N, d, kvl + rope, dxn, GemmOutType::F32,
                  dxn_beta(), grads, w.kv_a);

  // q path: undo the rotation of q's rope slice, then the projections.
  if (s.rope_on)
    mla_rope_queries_backward(b.dq, s.B, s.T, H, nope, rope, f.rope_cos, f.rope_sin, doc_start,
                              stream);
  if (ql > 0) {
    // q = W_qb q_n, q_n = RMSNorm(q_a), q_a = W_qa x.
    linear_backward(run, f.q_a_normed, dw.bf16(w.q_b), b.dq, N, ql, H * dq, b.d_qa_normed,
                    GemmOutType::F32, 0.0f, grads, w.q_b);
    rmsnorm_backward(f.q_a, dw.f32(w.q_a_norm), b.d_qa_normed, b.d_qa, grads.at(w.q_a_norm), N, ql,
                     eps, b.norm_workspace, stream, /*accumulate_dx=*/false);
    convert_f32_to_bf16(b.d_qa, b.d_qa_bf16, N * ql, stream);
    linear_backward(run, xn, dw.bf16(w.q_a), b.d_qa_bf16, N, d, ql, dxn, GemmOutType::F32,
                    dxn_beta(), grads, w.q_a);
  } else {
    linear_backward(run, xn, dw.bf16(w.q_proj), b.dq, N, d, H * dq, dxn, GemmOutType::F32,
                    dxn_beta(), grads, w.q_proj);
  }
}

}  // namespace dm::cuda
