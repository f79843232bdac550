#include "model/kda.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/gemm.h"
#include "ops/cpu/kda.h"
#include "ops/cpu/kda_prep.h"
#include "ops/cpu/norm_gated.h"

namespace dm {
namespace {

// Allocates from an arena, or (arena == nullptr) only counts: the byte functions run the same
// allocation sequence as the layer, so they cannot disagree with it.
struct KdaLayerAllocator {
  Arena* arena = nullptr;
  SizeCounter counter;
  template <typename T>
  T* take(int64_t n) {
    counter.add<T>(size_t(n));
    return arena ? arena->alloc<T>(size_t(n)) : nullptr;
  }
};

struct KdaLayerDims {
  int64_t N, d, H, K, HK;
  int Kc;
};

KdaLayerDims kda_layer_dims(const ModelConfig& cfg, int64_t B, int64_t T) {
  const int64_t H = cfg.kda.num_heads, K = cfg.kda.head_dim;
  return {B * T, int64_t(cfg.hidden), H, K, H * K, cfg.kda.conv_kernel};
}

// y[N,out] (+)= x[N,in] · W[out,in]ᵀ
template <typename Real>
void kda_linear(Real* y, const Real* x, const Real* W, int64_t N, int64_t in, int64_t out,
                bool accumulate = false) {
  gemm(false, true, N, out, in, Real(1), x, in, W, in, Real(accumulate ? 1 : 0), y, out);
}

// Backward of y = x·Wᵀ: dW[out,in] += dyᵀ·x; dx[N,in] (+)= dy·W (dx == nullptr: skipped).
template <typename Real>
void kda_linear_backward(const Real* x, const Real* W, const Real* dy, Real* dW, Real* dx,
                         int64_t N, int64_t in, int64_t out, bool accumulate_dx = true) {
  gemm(true, false, out, in, N, Real(1), dy, out, x, in, Real(1), dW, in);
  if (dx) gemm(false, false, N, in, out, Real(1), dy, out, W, in, Real(accumulate_dx ? 1 : 0), dx, in);
}

// The layer's saved activations, from `keep` (the saved arena, or ws when nothing is kept; then
// buffers that are dead by the time the next one is written share memory, as the inference
// forward always did).
template <typename Real>
KdaSaved<Real> kda_layer_carve_saved(KdaLayerAllocator& keep, const KdaLayerDims& dims,
                                     bool keeping, bool full_rank_gate, Real* log_decay) {
  const int64_t N = dims.N, HK = dims.HK, K = dims.K, H = dims.H;
  KdaSaved<Real> s;
  s.q_raw = keep.take<Real>(N * HK);
  s.k_raw = keeping ? keep.take<Real>(N * HK) : s.q_raw;
  s.v_raw = keeping ? keep.take<Real>(N * HK) : s.q_raw;
  s.gate_low = keep.take<Real>(N * K);
  s.gate_raw = keeping ? keep.take<Real>(N * HK) : s.q_raw;
  s.beta = keep.take<Real>(N * H);
  s.o = keep.take<Real>(N * HK);
  if (!full_rank_gate) s.out_gate_low = keeping ? keep.take<Real>(N * K) : s.gate_low;
  s.out_gate = keeping ? keep.take<Real>(N * HK) : log_decay;  // g is dead after the operator
  return s;
}

template <typename Real>
size_t kda_layer_forward_bytes(const ModelConfig& cfg, int64_t B, int64_t T, int chunk,
                               bool for_saved_arena) {
  const KdaLayerDims dims = kda_layer_dims(cfg, B, T);
  KdaLayerAllocator ws_counter, saved_counter;
  // Without `saved` everything is in ws; with it, ws holds only q, k, v, g.
  for (int i = 0; i < 4; ++i) ws_counter.take<Real>(dims.N * dims.HK);
  KdaLayerAllocator& keep = for_saved_arena ? saved_counter : ws_counter;
  kda_layer_carve_saved<Real>(keep, dims, for_saved_arena, cfg.kda.full_rank_output_gate,
                              nullptr);
  if (for_saved_arena) return saved_counter.counter.bytes;
  const KdaShape shape{B, T, dims.H, dims.K, dims.K};
  return ws_counter.counter.bytes + (chunk > 0 ? kda_chunk_workspace_bytes<Real>(shape, chunk) : 0) +
         4096;
}

}  // namespace

size_t kda_layer_workspace_bytes(const ModelConfig& cfg, int64_t B, int64_t T, int chunk,
                                 size_t elem_size) {
  return elem_size == sizeof(double) ? kda_layer_forward_bytes<double>(cfg, B, T, chunk, false)
                                     : kda_layer_forward_bytes<float>(cfg, B, T, chunk, false);
}

size_t kda_layer_saved_bytes(const ModelConfig& cfg, int64_t B, int64_t T, size_t elem_size) {
  return elem_size == sizeof(double) ? kda_layer_forward_bytes<double>(cfg, B, T, 0, true)
                                     : kda_layer_forward_bytes<float>(cfg, B, T, 0, true);
}

namespace {

// What a prefill/extend additionally wants from the forward (B = 1, no doc_start): the operator
// state and the last Kc−1 raw (pre-conv) inputs of each conv, read before the first token (unless
// `fresh`) and left after the last, so decode (or the next extend) continues where this ended;
// and copies of both after each checkpoint's token count.
template <typename Real>
struct KdaPrefillOutputs {
  Real* final_state = nullptr;                                                  // [H, K, V]
  Real *conv_tail_q = nullptr, *conv_tail_k = nullptr, *conv_tail_v = nullptr;  // [Kc−1, H·K]
  bool fresh = true;  // zero initial state and tails (a new sequence)
  const KdaCheckpoint* checkpoints = nullptr;
  int64_t num_checkpoints = 0;
};

// The conv tail of branch 0/1/2 (q/k/v) in a prefill output or a checkpoint copy.
template <typename Real>
Real* kda_branch_tail(const KdaPrefillOutputs<Real>& p, int branch) {
  return branch == 0 ? p.conv_tail_q : branch == 1 ? p.conv_tail_k : p.conv_tail_v;
}
inline float* kda_branch_tail(const KdaPrefillCache& c, int branch) {
  return branch == 0 ? c.conv_tail_q : branch == 1 ? c.conv_tail_k : c.conv_tail_v;
}

// What the conv reads before token 0 of a prefill/extend: the carried tail, or zeros.
template <typename Real>
const Real* kda_prefill_tail_in(const KdaPrefillOutputs<Real>* p, int branch) {
  return (p && !p->fresh) ? kda_branch_tail(*p, branch) : nullptr;
}

// dst [W, C] = the W raw rows before token `tokens` of the sequence [old_tail ; raw], old_tail
// [W, C] (nullptr = zeros) and raw [T, C]. dst may be old_tail (rows move forward only).
template <typename Real, typename Dst>
void kda_tail_after(const Real* old_tail, const Real* raw, int64_t C, int64_t W, int64_t tokens,
                    Dst* dst) {
  for (int64_t j = 0; j < W; ++j) {
    const int64_t e = tokens + j;  // row index in [old_tail ; raw]
    Dst* out = dst + j * C;
    if (e >= W) std::copy(raw + (e - W) * C, raw + (e - W + 1) * C, out);
    else if (old_tail == nullptr) std::fill(out, out + C, Dst(0));
    else if (static_cast<const void*>(old_tail + e * C) != static_cast<const void*>(out))
      std::copy(old_tail + e * C, old_tail + (e + 1) * C, out);
  }
}

// After a branch's conv: its tail at every checkpoint, then (in place) after the last token.
template <typename Real>
void kda_prefill_keep_tails(const KdaPrefillOutputs<Real>& p, int branch, const Real* raw,
                            int64_t T, int64_t C, int Kc) {
  const int64_t W = Kc - 1;
  if (W <= 0) return;
  Real* tail = kda_branch_tail(p, branch);
  const Real* old_tail = p.fresh ? nullptr : tail;
  for (int64_t i = 0; i < p.num_checkpoints; ++i)
    kda_tail_after(old_tail, raw, C, W, p.checkpoints[i].tokens,
                   kda_branch_tail(p.checkpoints[i].copy, branch));
  kda_tail_after(old_tail, raw, C, W, T, tail);
}

// The operator over the T tokens of a prefill/extend, in pieces between checkpoints (a piece
// starts from the state the previous one left; the state is copied at every checkpoint).
template <typename Real>
void kda_prefill_operator(const Real* q, const Real* k, const Real* v, const Real* g,
                          const Real* beta, Real* o, const KdaPrefillOutputs<Real>& p,
                          const KdaShape& s, Real scale, int chunk, Arena& ws) {
  const int64_t HK = s.H * s.K, KV = s.H * s.K * s.V;
  const Real* s0 = p.fresh ? nullptr : p.final_state;
  int64_t begin = 0;
  for (int64_t i = 0; i <= p.num_checkpoints; ++i) {
    const int64_t end = i < p.num_checkpoints ? p.checkpoints[i].tokens : s.T;
    if (end > begin) {
      const KdaShape piece{1, end - begin, s.H, s.K, s.V};
      if (chunk > 0)
        kda_chunk_forward<Real>(q + begin * HK, k + begin * HK, v + begin * HK, g + begin * HK,
                                beta + begin * s.H, s0, o + begin * HK, p.final_state, piece,
                                scale, chunk, ws);
      else
        kda_recurrent_forward<Real>(q + begin * HK, k + begin * HK, v + begin * HK,
                                    g + begin * HK, beta + begin * s.H, s0, o + begin * HK,
                                    p.final_state, piece, scale);
      s0 = p.final_state;
    }
    if (i < p.num_checkpoints) {
      float* copy = p.checkpoints[i].copy.state;
      if (s0) std::copy(s0, s0 + KV, copy);
      else std::fill(copy, copy + KV, 0.0f);
    }
    begin = end;
  }
}

template <typename Real>
void kda_layer_forward_impl(const ModelConfig& cfg, const KdaWeightsT<Real>& w, const Real* x,
                            Real* y, int64_t B, int64_t T, Arena& ws, const KdaRunOptions& opt,
                            const int32_t* doc_start, KdaSaved<Real>* saved, Arena* saved_arena,
                            const KdaPrefillOutputs<Real>* prefill_out) {
  DM_CHECK(saved == nullptr || saved_arena != nullptr,
           "kda_layer_forward: `saved` needs a saved arena");
  ArenaScope scope(ws);
  const KdaLayerDims dims = kda_layer_dims(cfg, B, T);
  const int64_t N = dims.N, d = dims.d, H = dims.H, K = dims.K, HK = dims.HK;
  const int Kc = dims.Kc;
  const bool full_rank_gate = cfg.kda.full_rank_output_gate;
  KdaLayerAllocator scratch{&ws, {}};
  KdaLayerAllocator keep{saved ? saved_arena : &ws, {}};
  Real* q = scratch.take<Real>(N * HK);
  Real* k = scratch.take<Real>(N * HK);
  Real* v = scratch.take<Real>(N * HK);
  Real* g = scratch.take<Real>(N * HK);
  KdaSaved<Real> act =
      kda_layer_carve_saved<Real>(keep, dims, saved != nullptr, full_rank_gate, g);
  act.chunk = opt.chunk;

  // q, k, v = SiLU(ShortConv(W x)) — [B, T, H·K], i.e. the operator's [B, T, H, K] layout.
  kda_linear(act.q_raw, x, w.q_proj, N, d, HK);
  short_conv_silu_forward<Real>(act.q_raw, w.q_conv, kda_prefill_tail_in(prefill_out, 0),
                                q, B, T, HK, Kc, doc_start);
  if (prefill_out) kda_prefill_keep_tails(*prefill_out, 0, act.q_raw, T, HK, Kc);
  kda_linear(act.k_raw, x, w.k_proj, N, d, HK);
  short_conv_silu_forward<Real>(act.k_raw, w.k_conv, kda_prefill_tail_in(prefill_out, 1),
                                k, B, T, HK, Kc, doc_start);
  if (prefill_out) kda_prefill_keep_tails(*prefill_out, 1, act.k_raw, T, HK, Kc);
  kda_linear(act.v_raw, x, w.v_proj, N, d, HK);
  short_conv_silu_forward<Real>(act.v_raw, w.v_conv, kda_prefill_tail_in(prefill_out, 2),
                                v, B, T, HK, Kc, doc_start);
  if (prefill_out) kda_prefill_keep_tails(*prefill_out, 2, act.v_raw, T, HK, Kc);

  // Per-channel log decay g = gate(W_f↑ W_f↓ x) and per-head β = sigmoid(W_β x).
  kda_linear(act.gate_low, x, w.f_a, N, d, K);
  kda_linear(act.gate_raw, act.gate_low, w.f_b, N, K, HK);
  kda_gate_forward<Real>(act.gate_raw, w.A_log, w.dt_bias, g, N, H, K, cfg.kda.gate,
                         cfg.kda.gate_lower_bound);
  kda_linear(act.beta, x, w.b_proj, N, d, H);
  for (int64_t i = 0; i < N * H; ++i) act.beta[i] = kda_sigmoid(act.beta[i]);

  const KdaShape s{B, T, H, K, K};
  const Real scale = Real(1) / std::sqrt(Real(K));
  if (prefill_out)
    kda_prefill_operator<Real>(q, k, v, g, act.beta, act.o, *prefill_out, s, scale, opt.chunk,
                               ws);
  else if (opt.chunk > 0)
    kda_chunk_forward<Real>(q, k, v, g, act.beta, nullptr, act.o, nullptr, s, scale, opt.chunk,
                            ws, doc_start);
  else
    kda_recurrent_forward<Real>(q, k, v, g, act.beta, nullptr, act.o, nullptr, s, scale,
                                doc_start);

  // Output gate (low-rank or full-rank), per-head RMSNorm ⊙ sigmoid(gate), then W_o. Without
  // `saved` the norm runs in place in o; with it, o is kept and the dead g holds the result.
  if (full_rank_gate) {
    kda_linear(act.out_gate, x, w.g_full, N, d, HK);
  } else {
    kda_linear(act.out_gate_low, x, w.g_a, N, d, K);
    kda_linear(act.out_gate, act.out_gate_low, w.g_b, N, K, HK);
  }
  Real* normed = saved ? g : act.o;
  rmsnorm_gated_forward<Real>(act.o, w.o_norm, act.out_gate, normed, N * H, K, cfg.rms_eps);
  kda_linear(y, normed, w.o_proj, N, HK, d);
  if (saved) *saved = act;
}

}  // namespace

template <typename Real>
void kda_layer_forward(const ModelConfig& cfg, const KdaWeightsT<Real>& w, const Real* x, Real* y,
                       int64_t B, int64_t T, Arena& ws, const KdaRunOptions& opt,
                       const int32_t* doc_start, KdaSaved<Real>* saved, Arena* saved_arena) {
  kda_layer_forward_impl<Real>(cfg, w, x, y, B, T, ws, opt, doc_start, saved, saved_arena,
                               nullptr);
}

// ---------------------------------------------------------------------------------------------
namespace {

template <typename Real>
struct KdaLayerBackwardBuffers {
  Real *q, *k, *v, *log_decay;     // [N, H·K] recomputed operator inputs
  Real* normed_then_d_o;           // [N, H·K] normed output, then the operator's do
  Real* d_normed_then_d_raw;       // [N, H·K] d(normed), then d(W x) before each short conv
  Real* d_out_gate_then_d_gate;    // [N, H·K] d(out gate), then d(gate_raw)
  Real *dq, *dk, *dv, *dg;         // [N, H·K] operator input gradients
  Real* dbeta;                     // [N, H]
  Real* d_low;                     // [N, K]
};

template <typename Real>
KdaLayerBackwardBuffers<Real> kda_layer_carve_backward(KdaLayerAllocator& a,
                                                       const KdaLayerDims& dims) {
  const int64_t NHK = dims.N * dims.HK;
  KdaLayerBackwardBuffers<Real> b;
  for (Real** p : {&b.q, &b.k, &b.v, &b.log_decay, &b.normed_then_d_o, &b.d_normed_then_d_raw,
                   &b.d_out_gate_then_d_gate, &b.dq, &b.dk, &b.dv, &b.dg})
    *p = a.take<Real>(NHK);
  b.dbeta = a.take<Real>(dims.N * dims.H);
  b.d_low = a.take<Real>(dims.N * dims.K);
  return b;
}

template <typename Real>
size_t kda_layer_backward_bytes(const ModelConfig& cfg, int64_t B, int64_t T, int chunk) {
  const KdaLayerDims dims = kda_layer_dims(cfg, B, T);
  KdaLayerAllocator counter;
  kda_layer_carve_backward<Real>(counter, dims);
  const KdaShape shape{B, T, dims.H, dims.K, dims.K};
  return counter.counter.bytes +
         (chunk > 0 ? kda_chunk_backward_workspace_bytes<Real>(shape, chunk) : 0) + 4096;
}

template <typename Real>
void kda_zero(Real* p, int64_t n) {
  std::fill(p, p + n, Real(0));
}

}  // namespace

size_t kda_layer_backward_workspace_bytes(const ModelConfig& cfg, int64_t B, int64_t T,
                                          int chunk, size_t elem_size) {
  return elem_size == sizeof(double) ? kda_layer_backward_bytes<double>(cfg, B, T, chunk)
                                     : kda_layer_backward_bytes<float>(cfg, B, T, chunk);
}

template <typename Real>
void kda_layer_backward(const ModelConfig& cfg, const KdaWeightsT<Real>& w,
                        KdaWeightsT<Real>& grad, const Real* x, const KdaSaved<Real>& saved,
                        const Real* dy, Real* dx, int64_t B, int64_t T, Arena& ws,
                        const int32_t* doc_start) {
  ArenaScope scope(ws);
  const KdaLayerDims dims = kda_layer_dims(cfg, B, T);
  const int64_t N = dims.N, d = dims.d, H = dims.H, K = dims.K, HK = dims.HK;
  const int Kc = dims.Kc;
  KdaLayerAllocator allocator{&ws, {}};
  const KdaLayerBackwardBuffers<Real> buf = kda_layer_carve_backward<Real>(allocator, dims);

  // Recompute what the forward did not keep: q, k, v, g and the normed output.
  short_conv_silu_forward<Real>(saved.q_raw, w.q_conv, nullptr, buf.q, B, T, HK, Kc, doc_start);
  short_conv_silu_forward<Real>(saved.k_raw, w.k_conv, nullptr, buf.k, B, T, HK, Kc, doc_start);
  short_conv_silu_forward<Real>(saved.v_raw, w.v_conv, nullptr, buf.v, B, T, HK, Kc, doc_start);
  kda_gate_forward<Real>(saved.gate_raw, w.A_log, w.dt_bias, buf.log_decay, N, H, K,
                         cfg.kda.gate, cfg.kda.gate_lower_bound);
  Real* normed = buf.normed_then_d_o;
  rmsnorm_gated_forward<Real>(saved.o, w.o_norm, saved.out_gate, normed, N * H, K, cfg.rms_eps);

  // y = normed · o_projᵀ
  Real* d_normed = buf.d_normed_then_d_raw;
  kda_linear_backward(normed, w.o_proj, dy, grad.o_proj, d_normed, N, HK, d,
                      /*accumulate_dx=*/false);
  // normed = RMSNorm(o)·o_norm ⊙ sigmoid(out_gate), per head.
  Real* d_o = buf.normed_then_d_o;
  Real* d_out_gate = buf.d_out_gate_then_d_gate;
  kda_zero(d_o, N * HK);
  kda_zero(d_out_gate, N * HK);
  rmsnorm_gated_backward<Real>(saved.o, w.o_norm, saved.out_gate, d_normed, d_o, grad.o_norm,
                               d_out_gate, N * H, K, cfg.rms_eps);
  // Output gate: G x = g_proj x, or g_b (g_a x).
  if (cfg.kda.full_rank_output_gate) {
    kda_linear_backward(x, w.g_full, d_out_gate, grad.g_full, dx, N, d, HK);
  } else {
    kda_linear_backward(saved.out_gate_low, w.g_b, d_out_gate, grad.g_b, buf.d_low, N, K, HK,
                        /*accumulate_dx=*/false);
    kda_linear_backward(x, w.g_a, buf.d_low, grad.g_a, dx, N, d, K);
  }

  // The operator (zero initial state, final state unused).
  for (Real* p : {buf.dq, buf.dk, buf.dv, buf.dg}) kda_zero(p, N * HK);
  kda_zero(buf.dbeta, N * H);
  const KdaShape s{B, T, H, K, K};
  const Real scale = Real(1) / std::sqrt(Real(K));
  if (saved.chunk > 0)
    kda_chunk_backward<Real>(buf.q, buf.k, buf.v, buf.log_decay, saved.beta, nullptr, d_o,
                             nullptr, buf.dq, buf.dk, buf.dv, buf.dg, buf.dbeta, nullptr, s,
                             scale, saved.chunk, ws, doc_start);
  else
    kda_recurrent_backward<Real>(buf.q, buf.k, buf.v, buf.log_decay, saved.beta, nullptr, d_o,
                                 nullptr, buf.dq, buf.dk, buf.dv, buf.dg, buf.dbeta, nullptr, s,
                                 scale, doc_start);

  // β = sigmoid(b_proj x): dz = dβ·β(1−β).
  for (int64_t i = 0; i < N * H; ++i)
    buf.dbeta[i] *= saved.beta[i] * (Real(1) - saved.beta[i]);
  kda_linear_backward(x, w.b_proj, buf.dbeta, grad.b_proj, dx, N, d, H);

  // g = gate(f_b (f_a x)).
  Real* d_gate_raw = buf.d_out_gate_then_d_gate;
  kda_zero(d_gate_raw, N * HK);
  kda_gate_backward<Real>(saved.gate_raw, w.A_log, w.dt_bias, buf.dg, d_gate_raw, grad.A_log,
                          grad.dt_bias, N, H, K, cfg.kda.gate, cfg.kda.gate_lower_bound);
  kda_linear_backward(saved.gate_low, w.f_b, d_gate_raw, grad.f_b, buf.d_low, N, K, HK,
                      /*accumulate_dx=*/false);
  kda_linear_backward(x, w.f_a, buf.d_low, grad.f_a, dx, N, d, K);

  // q, k, v = SiLU(ShortConv(W x)).
  struct Branch {
    const Real* raw;
    const Real* conv;
    Real* grad_conv;
    const Real* proj;
    Real* grad_proj;
    const Real* d_act;
  };
  Real* d_raw = buf.d_normed_then_d_raw;
  for (const Branch& br : {Branch{saved.q_raw, w.q_conv, grad.q_conv, w.q_proj, grad.q_proj, buf.dq},
                           Branch{saved.k_raw, w.k_conv, grad.k_conv, w.k_proj, grad.k_proj, buf.dk},
                           Branch{saved.v_raw, w.v_conv, grad.v_conv, w.v_proj, grad.v_proj, buf.dv}}) {
    kda_zero(d_raw, N * HK);
    short_conv_silu_backward<Real>(br.raw, br.conv, nullptr, br.d_act, d_raw, br.grad_conv, B, T,
                                   HK, Kc, doc_start);
    kda_linear_backward(x, br.proj, d_raw, br.grad_proj, dx, N, d, HK);
  }
}

// ---------------------------------------------------------------------------------------------
// Cached inference: prefill (the chunked forward, keeping the final state and conv tails) and one
// decode step (the recurrent operator on the stored state). Float only: the engine's scalar.

void kda_layer_extend(const ModelConfig& cfg, const KdaWeightsT<float>& w, const float* x,
                      float* y, int64_t T, Arena& ws, const KdaPrefillCache& cache, bool fresh,
                      const KdaCheckpoint* checkpoints, int64_t num_checkpoints, int chunk) {
  DM_CHECK(cache.state && cache.conv_tail_q && cache.conv_tail_k && cache.conv_tail_v,
           "kda_layer_extend: the state and the three conv tails are required");
  for (int64_t i = 0; i < num_checkpoints; ++i) {
    const KdaCheckpoint& c = checkpoints[i];
    DM_CHECK(c.tokens >= 1 && c.tokens <= T && (i == 0 || c.tokens > checkpoints[i - 1].tokens),
             "kda_layer_extend: checkpoint ", i, " after ", c.tokens,
             " tokens is not increasing within 1..", T);
    DM_CHECK(c.copy.state && c.copy.conv_tail_q && c.copy.conv_tail_k && c.copy.conv_tail_v,
             "kda_layer_extend: checkpoint ", i, " has no buffers");
  }
  const KdaPrefillOutputs<float> io{cache.state,    cache.conv_tail_q, cache.conv_tail_k,
                                    cache.conv_tail_v, fresh,        checkpoints,
                                    num_checkpoints};
  kda_layer_forward_impl<float>(cfg, w, x, y, /*B=*/1, T, ws, KdaRunOptions{chunk}, nullptr,
                                nullptr, nullptr, &io);
}

void kda_layer_prefill(const ModelConfig& cfg, const KdaWeightsT<float>& w, const float* x,
                       float* y, int64_t T, Arena& ws, const KdaPrefillCache& out, int chunk) {
  kda_layer_extend(cfg, w, x, y, T, ws, out, /*fresh=*/true, nullptr, 0, chunk);
}

size_t kda_layer_decode_workspace_bytes(const ModelConfig& cfg, int64_t n) {
  const KdaLayerDims dims = kda_layer_dims(cfg, n, 1);
  SizeCounter c;
  for (int i = 0; i < 9; ++i) c.add<float>(size_t(n * dims.HK));  // raw q/k/v, q/k/v, g, gate, o…
  c.add<float>(size_t(n * dims.HK));                               // output gate
  c.add<float>(size_t(2 * n * dims.K));                            // low-rank gate inputs
  c.add<float>(size_t(n * dims.H));                                // β
  return c.bytes + 4096;
}

void kda_layer_decode(const ModelConfig& cfg, const KdaWeightsT<float>& w, const float* x,
                      float* y, int64_t n, const int64_t* slots, const KdaPrefillCache& cache,
                      Arena& ws) {
  ArenaScope scope(ws);
  const KdaLayerDims dims = kda_layer_dims(cfg, n, 1);
  const int64_t d = dims.d, H = dims.H, K = dims.K, HK = dims.HK;
  const int Kc = dims.Kc;
  const int64_t tail_rows = Kc - 1;
  float* q_raw = ws.alloc<float>(size_t(n * HK));   // [n, H·K] W_q x (before the conv)
  float* k_raw = ws.alloc<float>(size_t(n * HK));
  float* v_raw = ws.alloc<float>(size_t(n * HK));
  float* q = ws.alloc<float>(size_t(n * HK));       // [n, H·K] SiLU(conv(·))
  float* k = ws.alloc<float>(size_t(n * HK));
  float* v = ws.alloc<float>(size_t(n * HK));
  float* log_decay = ws.alloc<float>(size_t(n * HK));
  float* gate_raw = ws.alloc<float>(size_t(n * HK));
  float* o = ws.alloc<float>(size_t(n * HK));
  float* out_gate = ws.alloc<float>(size_t(n * HK));
  float* gate_low = ws.alloc<float>(size_t(n * K));
  float* out_gate_low = ws.alloc<float>(size_t(n * K));
  float* beta = ws.alloc<float>(size_t(n * H));

  kda_linear(q_raw, x, w.q_proj, n, d, HK);
  kda_linear(k_raw, x, w.k_proj, n, d, HK);
  kda_linear(v_raw, x, w.v_proj, n, d, HK);
  // One token per sequence: the conv reads the sequence's Kc−1 previous raw inputs from its
  // tail, which then shifts by one row (oldest out, this token in).
  struct ConvBranch {
    const float* raw;
    const float* conv;
    float* tails;
    float* out;
  };
  for (const ConvBranch& br : {ConvBranch{q_raw, w.q_conv, cache.conv_tail_q, q},
                               ConvBranch{k_raw, w.k_conv, cache.conv_tail_k, k},
                               ConvBranch{v_raw, w.v_conv, cache.conv_tail_v, v}}) {
    for (int64_t r = 0; r < n; ++r) {
      float* tail = br.tails + slots[r] * tail_rows * HK;  // [Kc−1, H·K]
      short_conv_silu_forward<float>(br.raw + r * HK, br.conv, tail_rows > 0 ? tail : nullptr,
                                     br.out + r * HK, 1, 1, HK, Kc);
      if (tail_rows > 0) {
        std::copy(tail + HK, tail + tail_rows * HK, tail);
        std::copy(br.raw + r * HK, br.raw + (r + 1) * HK, tail + (tail_rows - 1) * HK);
      }
    }
  }
  kda_linear(gate_low, x, w.f_a, n, d, K);
  kda_linear(gate_raw, gate_low, w.f_b, n, K, HK);
  kda_gate_forward<float>(gate_raw, w.A_log, w.dt_bias, log_decay, n, H, K, cfg.kda.gate,
                          cfg.kda.gate_lower_bound);
  kda_linear(beta, x, w.b_proj, n, d, H);
  for (int64_t i = 0; i < n * H; ++i) beta[i] = kda_sigmoid(beta[i]);

  // The recurrent operator, state updated in place (s0 == sT), one call per sequence (each
  // sequence's state lives at its own slot). A batch with enough state to update runs its rows
  // on the engine's threads: one fork/join per layer, where a single row would parallelise
  // only over its heads (and not at all below the operator's own work threshold).
  const KdaShape one_token{1, 1, H, K, K};
  const float scale = 1.0f / std::sqrt(float(K));
  constexpr int64_t kKdaDecodeRowsParallelMinWork = int64_t(1) << 18;  // state floats updated
  const bool rows_parallel = n > 1 && n * H * K * K >= kKdaDecodeRowsParallelMinWork;
#pragma omp parallel for schedule(static) if (rows_parallel)
  for (int64_t r = 0; r < n; ++r) {
    float* state = cache.state + slots[r] * H * K * K;  // [H, K, V]
    kda_recurrent_forward<float>(q + r * HK, k + r * HK, v + r * HK, log_decay + r * HK,
                                 beta + r * H, state, o + r * HK, state, one_token, scale);
  }
  if (cfg.kda.full_rank_output_gate) {
    kda_linear(out_gate, x, w.g_full, n, d, HK);
  } else {
    kda_linear(out_gate_low, x, w.g_a, n, d, K);
    kda_linear(out_gate, out_gate_low, w.g_b, n, K, HK);
  }
  rmsnorm_gated_forward<float>(o, w.o_norm, out_gate, o, n * H, K, cfg.rms_eps);
  kda_linear(y, o, w.o_proj, n, HK, d);
}

#define DM_KDA_LAYER_INSTANTIATE(Real)                                                          \
  template void kda_layer_forward<Real>(const ModelConfig&, const KdaWeightsT<Real>&,           \
                                        const Real*, Real*, int64_t, int64_t, Arena&,           \
                                        const KdaRunOptions&, const int32_t*, KdaSaved<Real>*,  \
                                        Arena*);                                                \
  template void kda_layer_backward<Real>(const ModelConfig&, const KdaWeightsT<Real>&,          \
                                         KdaWeightsT<Real>&, const Real*, const KdaSaved<Real>&, \
                                         const Real*, Real*, int64_t, int64_t, Arena&,          \
                                         const int32_t*);
DM_KDA_LAYER_INSTANTIATE(float)
DM_KDA_LAYER_INSTANTIATE(double)
#undef DM_KDA_LAYER_INSTANTIATE

}  // namespace dm
