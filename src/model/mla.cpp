// Gated MLA layer (SPEC §1.2), expanded form: forward (inference or training with saved
// activations) and backward. Shapes: N = B·T tokens, H heads, dq = qk_nope + qk_rope,
// dv = v_head, kvl = kv_lora, ql = q_lora, d = hidden.
//
// Forward:
//   q      = W_qb · RMSNorm(W_qa x)   (or W_q x)                          [N, H, dq]
//   [c;kr] = W_kva x,  c = RMSNorm(c),  [k_nope | v]_h = W_kvb c          [N, kvl+rope], [N, H, nope+dv]
//   RoPE (when on) on q[:, :, nope:] and kr;  k_h = [k_nope_h | kr]       [N, H, dq]
//   o      = causal attention(q, k, v)                                    [N, H, dv]
//   o     ← o ⊙ sigmoid(W_gate x)   (output gate, when on)
//   y      = W_o o                                                        [N, d]
// The backward walks the same chain in reverse; see mla_layer_backward.
#include "model/mla.h"

#include "core/fastmath.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/gemm.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/rmsnorm.h"

namespace dm {

RopeParams mla_rope_params(const MlaConfig& m) {
  RopeParams p;
  p.dim = m.qk_rope_dim;
  p.theta = m.rope_theta;
  p.yarn = m.yarn.enabled;
  p.factor = m.yarn.factor;
  p.original_max_position = m.yarn.original_max_position;
  p.beta_fast = m.yarn.beta_fast;
  p.beta_slow = m.yarn.beta_slow;
  p.mscale = m.yarn.mscale;
  p.mscale_all_dim = m.yarn.mscale_all_dim;
  return p;
}

namespace {


constexpr int kMlaAttentionBlock = 64;

// The softmax scale as a double; the float engine rounds it to float exactly like the old
// float-only layer did, so float results are unchanged.
double mla_softmax_scale_exact(const MlaConfig& m) {
  const double base = 1.0 / std::sqrt(double(m.qk_nope_dim + m.qk_rope_dim));
  return base * (m.use_rope ? rope_softmax_scale_factor(mla_rope_params(m)) : 1.0);
}

template <typename Real>
double mla_softmax_scale_for(const MlaConfig& m) {
  return std::is_same_v<Real, float> ? double(float(mla_softmax_scale_exact(m)))
                                     : mla_softmax_scale_exact(m);
}

bool mla_rope_active(const MlaConfig& m) { return m.use_rope && m.qk_rope_dim > 0; }

template <typename Real>
Real sigmoid_stable(Real x) {
  return sigmoid(x);  // core/fastmath.h
}

// y[N,out] = x[N,in] · W[out,in]ᵀ
template <typename Real>
void linear_forward(Real* y, const Real* x, const Real* W, int64_t N, int64_t in, int64_t out) {
  gemm(false, true, N, out, in, Real(1), x, in, W, in, Real(0), y, out);
}
// Backward of y = x Wᵀ, accumulating:  dW[out,in] += dyᵀ x;  dx[N,in] += dy W (dx may be null).
template <typename Real>
void linear_backward(const Real* dy, const Real* x, const Real* W, Real* dW, Real* dx, int64_t N,
                     int64_t in, int64_t out) {
  gemm(true, false, out, in, N, Real(1), dy, out, x, in, Real(1), dW, in);
  if (dx) gemm(false, false, N, in, out, Real(1), dy, out, W, in, Real(1), dx, in);
}

// Cosine/sine tables for positions 0..T−1 and the position of every token (and of every
// (token, head) row of q), honouring doc_start. All from `ws`.
template <typename Real>
struct MlaRopeTables {
  Real *cos = nullptr, *sin = nullptr;  // [T, rope/2]
  int64_t* token_positions = nullptr;   // [N]
  int64_t* head_positions = nullptr;    // [N·H]

  MlaRopeTables(const MlaConfig& m, int64_t B, int64_t T, const int32_t* doc_start, Arena& ws) {
    const int64_t N = B * T, H = m.num_heads, half = m.qk_rope_dim / 2;
    cos = ws.alloc<Real>(size_t(T * half));
    sin = ws.alloc<Real>(size_t(T * half));
    token_positions = ws.alloc<int64_t>(size_t(N));
    head_positions = ws.alloc<int64_t>(size_t(N * H));
    rope_build_tables(mla_rope_params(m), T, cos, sin);
    rope_positions_from_doc_start(doc_start, B, T, token_positions);
    for (int64_t row = 0; row < N * H; ++row) head_positions[row] = token_positions[row / H];
  }
  static void count(const MlaConfig& m, int64_t B, int64_t T, size_t real_bytes, size_t& bytes) {
    const int64_t half = std::max(m.qk_rope_dim / 2, 1);
    bytes += 2 * Arena::round_up(size_t(T * half) * real_bytes);
    bytes += Arena::round_up(size_t(B * T) * sizeof(int64_t));
    bytes += Arena::round_up(size_t(B * T * m.num_heads) * sizeof(int64_t));
  }
};

void check_mla_config(const ModelConfig& cfg) {
  const MlaConfig& m = cfg.mla;
  DM_CHECK(cfg.hidden > 0 && m.num_heads > 0 && m.kv_lora_rank > 0 && m.v_head_dim > 0 &&
               m.qk_nope_dim >= 0 && m.qk_rope_dim >= 0 && m.q_lora_rank >= 0,
           "mla: bad config (hidden ", cfg.hidden, ", heads ", m.num_heads, ", kv_lora ",
           m.kv_lora_rank, ", v_head ", m.v_head_dim, ")");
  DM_CHECK(!mla_rope_active(m) || m.qk_rope_dim % 2 == 0, "mla: qk_rope_dim must be even, got ",
           m.qk_rope_dim);
}

size_t reals_bytes(int64_t count, size_t real_bytes) {
  return Arena::round_up(size_t(std::max<int64_t>(count, 0)) * real_bytes);
}

}  // namespace

float mla_softmax_scale(const MlaConfig& m) { return float(mla_softmax_scale_exact(m)); }

size_t mla_layer_saved_bytes(const ModelConfig& cfg, int64_t B, int64_t T, size_t real_bytes) {
  const MlaConfig& m = cfg.mla;
  const int64_t N = B * T, H = m.num_heads, dq = m.qk_nope_dim + m.qk_rope_dim,
                dv = m.v_head_dim;
  size_t bytes = 0;
  if (m.q_lora_rank > 0) bytes += reals_bytes(N * m.q_lora_rank, real_bytes);  // q_a
  bytes += reals_bytes(N * (m.kv_lora_rank + m.qk_rope_dim), real_bytes);     // kv_a
  bytes += 2 * reals_bytes(N * H * dq, real_bytes);                           // q, k
  bytes += 2 * reals_bytes(N * H * dv, real_bytes);                           // v, attn_out
  bytes += reals_bytes(B * H * T, real_bytes);                                // lse
  if (m.output_gate) bytes += reals_bytes(N * H * dv, real_bytes);            // gate_sigmoid
  return bytes;
}

size_t mla_layer_workspace_bytes(const ModelConfig& cfg, int64_t B, int64_t T,
                                 size_t real_bytes) {
  const MlaConfig& m = cfg.mla;
  const int64_t N = B * T, H = m.num_heads, dq = m.qk_nope_dim + m.qk_rope_dim,
                dv = m.v_head_dim;
  // Without `saved`, every saved buffer is scratch too, so this is the larger of the two cases.
  size_t bytes = mla_layer_saved_bytes(cfg, B, T, real_bytes);
  bytes += reals_bytes(N * m.q_lora_rank, real_bytes);                       // normed q_a
  bytes += reals_bytes(N * m.kv_lora_rank, real_bytes);                      // c
  bytes += reals_bytes(N * H * (m.qk_nope_dim + dv), real_bytes);            // kv
  bytes += reals_bytes(N * H * dv, real_bytes);                              // gated output
  MlaRopeTables<float>::count(m, B, T, real_bytes, bytes);
  bytes += attention_causal_workspace_bytes(AttnShape{B, T, H, dq, dv}, kMlaAttentionBlock,
                                            real_bytes);
  return bytes + 4096;
}

size_t mla_layer_backward_workspace_bytes(const ModelConfig& cfg, int64_t B, int64_t T,
                                          size_t real_bytes) {
  const MlaConfig& m = cfg.mla;
  const int64_t N = B * T, H = m.num_heads, dq = m.qk_nope_dim + m.qk_rope_dim,
                dv = m.v_head_dim, kvl = m.kv_lora_rank, ql = m.q_lora_rank;
  size_t bytes = 0;
  bytes += 2 * reals_bytes(N * H * dv, real_bytes);                // gated output, d_out
  bytes += 2 * reals_bytes(N * H * dq, real_bytes);                // dq, dk
  bytes += reals_bytes(N * H * dv, real_bytes);                    // dv
  bytes += attention_causal_backward_workspace_bytes(AttnShape{B, T, H, dq, dv},
                                                     kMlaAttentionBlock, real_bytes);
  bytes += reals_bytes(N * H * (m.qk_nope_dim + dv), real_bytes);  // d_kv
  bytes += reals_bytes(N * (kvl + m.qk_rope_dim), real_bytes);     // d_kv_a
  MlaRopeTables<float>::count(m, B, T, real_bytes, bytes);
  bytes += 4 * reals_bytes(N * kvl, real_bytes);                   // c_raw, c, dc, dc_raw
  bytes += 3 * reals_bytes(N * ql, real_bytes);                    // normed q_a, d of both
  return bytes + 4096;
}

namespace {

// The expanded forward; latent_out [N, kvl] / rope_key_out [N, rope] (optional, prefill)
// receive c after its RMSNorm and kr after RoPE: exactly what the decode cache holds.
template <typename Real>
void mla_layer_forward_impl(const ModelConfig& cfg, const MlaWeightsT<Real>& w, const Real* x,
                            Real* y, int64_t B, int64_t T, Arena& ws, const int32_t* doc_start,
                            MlaSaved<Real>* saved, Arena* saved_arena, Real* latent_out,
                            Real* rope_key_out) {
  check_mla_config(cfg);
  DM_CHECK(!saved || (saved_arena && saved_arena != &ws),
           "mla forward: `saved` needs its own saved_arena (not the workspace arena)");
  ArenaScope scope(ws);
  // Buffers the backward reads go to the saved arena when training, to scratch otherwise.
  Arena& store = saved ? *saved_arena : ws;
  const MlaConfig& m = cfg.mla;
  const int64_t N = B * T, d = cfg.hidden, H = m.num_heads;
  const int64_t nope = m.qk_nope_dim, rope = m.qk_rope_dim, dq = nope + rope, dv = m.v_head_dim;
  const int64_t kvl = m.kv_lora_rank, ql = m.q_lora_rank;

  // q [N, H, dq]
  Real* q_a = ql > 0 ? store.alloc<Real>(size_t(N * ql)) : nullptr;
  Real* q = store.alloc<Real>(size_t(N * H * dq));
  if (ql > 0) {
    Real* q_a_normed = ws.alloc<Real>(size_t(N * ql));
    linear_forward(q_a, x, w.q_a, N, d, ql);
    rmsnorm_forward(q_a, w.q_a_norm, q_a_normed, N, ql, m.latent_norm_eps);
    linear_forward(q, q_a_normed, w.q_b, N, ql, H * dq);
  } else {
    linear_forward(q, x, w.q_proj, N, d, H * dq);
  }
  // [c ; kr] = W_kva x;  c = RMSNorm(c);  [k_nope | v]_h = W_kvb c
  Real* kv_a = store.alloc<Real>(size_t(N * (kvl + rope)));
  Real* c = ws.alloc<Real>(size_t(N * kvl));
  Real* kv = ws.alloc<Real>(size_t(N * H * (nope + dv)));
  linear_forward(kv_a, x, w.kv_a, N, d, kvl + rope);
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(c + n * kvl, kv_a + n * (kvl + rope), size_t(kvl) * sizeof(Real));
  rmsnorm_forward(c, w.kv_a_norm, c, N, kvl, m.latent_norm_eps);
  linear_forward(kv, c, w.kv_b, N, kvl, H * (nope + dv));

  if (mla_rope_active(m)) {
    const MlaRopeTables<Real> tables(m, B, T, doc_start, ws);
    // q_rope of every head: rows [N·H] of stride dq, rotary slice at offset nope.
    rope_apply_interleaved(q, N * H, dq, nope, int(rope), tables.head_positions, tables.cos,
                           tables.sin);
    rope_apply_interleaved(kv_a, N, kvl + rope, kvl, int(rope), tables.token_positions,
                           tables.cos, tables.sin);
  }
  if (latent_out) std::copy(c, c + N * kvl, latent_out);
  if (rope_key_out)
    for (int64_t n = 0; n < N; ++n)
      std::copy(kv_a + n * (kvl + rope) + kvl, kv_a + (n + 1) * (kvl + rope),
                rope_key_out + n * rope);
  // Expanded keys/values: k_h = [k_nope_h | kr] (kr shared by all heads), v_h.
  Real* k = store.alloc<Real>(size_t(N * H * dq));
  Real* v = store.alloc<Real>(size_t(N * H * dv));
#pragma omp parallel for schedule(static) if (N * H * dq > 65536)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      const Real* kv_row = kv + (n * H + h) * (nope + dv);
      Real* k_row = k + (n * H + h) * dq;
      std::memcpy(k_row, kv_row, size_t(nope) * sizeof(Real));
      std::memcpy(k_row + nope, kv_a + n * (kvl + rope) + kvl, size_t(rope) * sizeof(Real));
      std::memcpy(v + (n * H + h) * dv, kv_row + nope, size_t(dv) * sizeof(Real));
    }
  Real* attn_out = store.alloc<Real>(size_t(N * H * dv));
  Real* lse = saved ? store.alloc<Real>(size_t(B * H * T)) : nullptr;
  const AttnShape shape{B, T, H, dq, dv};
  attention_causal_forward(q, k, v, attn_out, lse, shape, mla_softmax_scale_for<Real>(m), ws,
                           kMlaAttentionBlock, doc_start);

  Real* gate_sigmoid = nullptr;
  Real* projected_input = attn_out;  // what W_o multiplies: the (gated) attention output
  if (m.output_gate) {
    gate_sigmoid = store.alloc<Real>(size_t(N * H * dv));
    linear_forward(gate_sigmoid, x, w.gate, N, d, H * dv);
    // Training keeps attn_out ungated for the backward; inference gates in place.
    projected_input = saved ? ws.alloc<Real>(size_t(N * H * dv)) : attn_out;
#pragma omp parallel for schedule(static) if (N * H * dv > 65536)
    for (int64_t i = 0; i < N * H * dv; ++i) {
      gate_sigmoid[i] = sigmoid_stable(gate_sigmoid[i]);
      projected_input[i] = attn_out[i] * gate_sigmoid[i];
    }
  }
  linear_forward(y, projected_input, w.o_proj, N, H * dv, d);

  if (saved) {
    *saved = MlaSaved<Real>{B, T, q_a, kv_a, q, k, v, attn_out, lse, gate_sigmoid};
  }
}

}  // namespace

template <typename Real>
void mla_layer_forward(const ModelConfig& cfg, const MlaWeightsT<Real>& w, const Real* x, Real* y,
                       int64_t B, int64_t T, Arena& ws, const int32_t* doc_start,
                       std::type_identity_t<MlaSaved<Real>>* saved, Arena* saved_arena) {
  mla_layer_forward_impl<Real>(cfg, w, x, y, B, T, ws, doc_start, saved, saved_arena, nullptr,
                               nullptr);
}

template <typename Real>
void mla_layer_backward(const ModelConfig& cfg, const MlaWeightsT<Real>& w,
                        MlaWeightsT<Real>& grad, const Real* x,
                        const std::type_identity_t<MlaSaved<Real>>& saved, const Real* dy,
                        Real* dx, int64_t B, int64_t T, Arena& ws, const int32_t* doc_start) {
  check_mla_config(cfg);
  DM_CHECK(saved.B == B && saved.T == T && saved.q && saved.k && saved.v && saved.attn_out &&
               saved.lse && saved.kv_a,
           "mla backward: `saved` is empty or from a forward of another shape (saved B=",
           saved.B, " T=", saved.T, ", now B=", B, " T=", T, ")");
  ArenaScope scope(ws);
  const MlaConfig& m = cfg.mla;
  const int64_t N = B * T, d = cfg.hidden, H = m.num_heads;
  const int64_t nope = m.qk_nope_dim, rope = m.qk_rope_dim, dq = nope + rope, dv = m.v_head_dim;
  const int64_t kvl = m.kv_lora_rank, ql = m.q_lora_rank, Hdv = H * dv;
  DM_CHECK(!m.output_gate || saved.gate_sigmoid, "mla backward: gate activations missing");
  DM_CHECK(ql == 0 || saved.q_a, "mla backward: q_a activations missing");

  // y = W_o · o_gated:  dW_o += dyᵀ o_gated,  d_out = dy W_o      d_out [N, H·dv]
  Real* gated_output = m.output_gate ? ws.alloc<Real>(size_t(N * Hdv)) : saved.attn_out;
  if (m.output_gate) {
#pragma omp parallel for schedule(static) if (N * Hdv > 65536)
    for (int64_t i = 0; i < N * Hdv; ++i) gated_output[i] = saved.attn_out[i] * saved.gate_sigmoid[i];
  }
  Real* d_out = ws.alloc<Real>(size_t(N * Hdv));
  std::fill(d_out, d_out + N * Hdv, Real(0));
  linear_backward(dy, gated_output, w.o_proj, grad.o_proj, d_out, N, Hdv, d);

  // o_gated = o ⊙ σ(g), g = W_gate x:  dg = d_out ⊙ o ⊙ σ(1−σ) (into gated_output's buffer),
  // d_o = d_out ⊙ σ (in place).
  if (m.output_gate) {
    Real* d_gate_preactivation = gated_output;
#pragma omp parallel for schedule(static) if (N * Hdv > 65536)
    for (int64_t i = 0; i < N * Hdv; ++i) {
      const Real s = saved.gate_sigmoid[i];
      d_gate_preactivation[i] = d_out[i] * saved.attn_out[i] * s * (Real(1) - s);
      d_out[i] *= s;
    }
    linear_backward(d_gate_preactivation, x, w.gate, grad.gate, dx, N, d, Hdv);
  }

  // Attention: gradients of q, k, v (zeroed here: the op accumulates).
  Real* d_q = ws.alloc<Real>(size_t(N * H * dq));
  Real* d_k = ws.alloc<Real>(size_t(N * H * dq));
  Real* d_v = ws.alloc<Real>(size_t(N * H * dv));
  std::fill(d_q, d_q + N * H * dq, Real(0));
  std::fill(d_k, d_k + N * H * dq, Real(0));
  std::fill(d_v, d_v + N * H * dv, Real(0));
  attention_causal_backward(saved.q, saved.k, saved.v, saved.attn_out, saved.lse, d_out, d_q,
                            d_k, d_v, AttnShape{B, T, H, dq, dv}, mla_softmax_scale_for<Real>(m),
                            ws, kMlaAttentionBlock, doc_start);

  // k_h = [k_nope_h | kr], v_h: scatter back to d[k_nope | v]_h [N, H, nope+dv]; kr is one
  // tensor read by every head, so its gradient is the sum over heads (in head order).
  Real* d_kv = ws.alloc<Real>(size_t(N * H * (nope + dv)));
  Real* d_kv_a = ws.alloc<Real>(size_t(N * (kvl + rope)));  // [N, kvl + rope] = [dc ; dkr]
#pragma omp parallel for schedule(static) if (N * H * dq > 65536)
  for (int64_t n = 0; n < N; ++n) {
    Real* d_kr = d_kv_a + n * (kvl + rope) + kvl;
    std::fill(d_kr, d_kr + rope, Real(0));
    for (int64_t h = 0; h < H; ++h) {
      const Real* d_k_row = d_k + (n * H + h) * dq;
      Real* d_kv_row = d_kv + (n * H + h) * (nope + dv);
      std::memcpy(d_kv_row, d_k_row, size_t(nope) * sizeof(Real));
      std::memcpy(d_kv_row + nope, d_v + (n * H + h) * dv, size_t(dv) * sizeof(Real));
      for (int64_t r = 0; r < rope; ++r) d_kr[r] += d_k_row[nope + r];
    }
  }

  // RoPE: the transpose of the rotation is the negative-angle rotation (same tables).
  if (mla_rope_active(m)) {
    const MlaRopeTables<Real> tables(m, B, T, doc_start, ws);
    rope_apply_interleaved_inverse(d_q, N * H, dq, nope, int(rope), tables.head_positions,
                                   tables.cos, tables.sin);
    rope_apply_interleaved_inverse(d_kv_a, N, kvl + rope, kvl, int(rope),
                                   tables.token_positions, tables.cos, tables.sin);
  }

  // [k_nope | v] = W_kvb c, c = RMSNorm(c_raw): recompute c from the saved c_raw.
  Real* c_raw = ws.alloc<Real>(size_t(N * kvl));
  Real* c = ws.alloc<Real>(size_t(N * kvl));
  Real* d_c = ws.alloc<Real>(size_t(N * kvl));
  Real* d_c_raw = ws.alloc<Real>(size_t(N * kvl));
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(c_raw + n * kvl, saved.kv_a + n * (kvl + rope), size_t(kvl) * sizeof(Real));
  rmsnorm_forward(c_raw, w.kv_a_norm, c, N, kvl, m.latent_norm_eps);
  std::fill(d_c, d_c + N * kvl, Real(0));
  std::fill(d_c_raw, d_c_raw + N * kvl, Real(0));
  linear_backward(d_kv, c, w.kv_b, grad.kv_b, d_c, N, kvl, H * (nope + dv));
  rmsnorm_backward(c_raw, w.kv_a_norm, d_c, d_c_raw, grad.kv_a_norm, N, kvl,
                   m.latent_norm_eps);
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(d_kv_a + n * (kvl + rope), d_c_raw + n * kvl, size_t(kvl) * sizeof(Real));
  // [c_raw ; kr] = W_kva x
  linear_backward(d_kv_a, x, w.kv_a, grad.kv_a, dx, N, d, kvl + rope);

  // q = W_qb · RMSNorm(q_a), q_a = W_qa x   (or q = W_q x)
  if (ql > 0) {
    Real* q_a_normed = ws.alloc<Real>(size_t(N * ql));
    Real* d_q_a_normed = ws.alloc<Real>(size_t(N * ql));
    Real* d_q_a = ws.alloc<Real>(size_t(N * ql));
    rmsnorm_forward(saved.q_a, w.q_a_norm, q_a_normed, N, ql, m.latent_norm_eps);
    std::fill(d_q_a_normed, d_q_a_normed + N * ql, Real(0));
    std::fill(d_q_a, d_q_a + N * ql, Real(0));
    linear_backward(d_q, q_a_normed, w.q_b, grad.q_b, d_q_a_normed, N, ql, H * dq);
    rmsnorm_backward(saved.q_a, w.q_a_norm, d_q_a_normed, d_q_a, grad.q_a_norm, N, ql,
                     m.latent_norm_eps);
    linear_backward(d_q_a, x, w.q_a, grad.q_a, dx, N, d, ql);
  } else {
    linear_backward(d_q, x, w.q_proj, grad.q_proj, dx, N, d, H * dq);
  }
}

// ---------------------------------------------------------------------------------------------
// Cached inference (float engine): prefill through the expanded form, decode absorbed.

void mla_layer_prefill(const ModelConfig& cfg, const MlaWeightsT<float>& w, const float* x,
                       float* y, int64_t T, Arena& ws, float* latent_cache,
                       float* rope_key_cache) {
  DM_CHECK(latent_cache && (rope_key_cache || cfg.mla.qk_rope_dim == 0),
           "mla_layer_prefill: the latent and rope-key caches are required");
  mla_layer_forward_impl<float>(cfg, w, x, y, /*B=*/1, T, ws, nullptr, nullptr, nullptr,
                                latent_cache, rope_key_cache);
}

void mla_rope_tables(const MlaConfig& m, int64_t positions, float* cos, float* sin) {
  if (mla_rope_active(m)) rope_build_tables(mla_rope_params(m), positions, cos, sin);
}

// mla_layer_extend and mla_layer_decode (absorbed, paged): model/mla_decode.cpp.

template void mla_layer_forward<float>(const ModelConfig&, const MlaWeightsT<float>&,
                                       const float*, float*, int64_t, int64_t, Arena&,
                                       const int32_t*, MlaSaved<float>*, Arena*);
template void mla_layer_forward<double>(const ModelConfig&, const MlaWeightsT<double>&,
                                        const double*, double*, int64_t, int64_t, Arena&,
                                        const int32_t*, MlaSaved<double>*, Arena*);
template void mla_layer_backward<float>(const ModelConfig&, const MlaWeightsT<float>&,
                                        MlaWeightsT<float>&, const float*,
                                        const MlaSaved<float>&, const float*, float*, int64_t,
                                        int64_t, Arena&, const int32_t*);
template void mla_layer_backward<double>(const ModelConfig&, const MlaWeightsT<double>&,
                                         MlaWeightsT<double>&, const double*,
                                         const MlaSaved<double>&, const double*, double*, int64_t,
                                         int64_t, Arena&, const int32_t*);

}  // namespace dm
