#include "model/model.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "core/gemm.h"
#include "model/kda.h"
#include "model/mla.h"
#include "model/moe.h"
#include "ops/cpu/attnres.h"
#include "ops/cpu/loss.h"
#include "ops/cpu/rmsnorm.h"
#include "model/residual.h"

namespace dm {

void check_token_ids(const int64_t* tokens, int64_t n, int64_t vocab, const std::string& origin) {
  for (int64_t i = 0; i < n; ++i)
    DM_CHECK(tokens[i] >= 0 && tokens[i] < vocab, origin, ": token id ", tokens[i],
             " at position ", i, " is outside the vocabulary [0, ", vocab, ")");
}

namespace {

int num_attnres_blocks(const ModelConfig& c) { return residual_num_blocks(c); }

template <typename Real>
void add_rows(Real* y, const Real* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

// Scratch bytes any one sub-layer needs (forward or backward) for a batch of B×T.
size_t layer_scratch_bytes(const ModelConfig& c, int64_t B, int64_t T, size_t rs, bool backward,
                           int chunk) {
  const int64_t N = B * T;
  size_t s = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.mixers[i] == MixerKind::KDA)
      s = std::max(s, backward ? kda_layer_backward_workspace_bytes(c, B, T, chunk, rs)
                               : kda_layer_workspace_bytes(c, B, T, chunk, rs));
    else
      s = std::max(s, backward ? mla_layer_backward_workspace_bytes(c, B, T, rs)
                               : mla_layer_workspace_bytes(c, B, T, rs));
    // The FFN output m [N, d] is taken from the scratch arena before the FFN's own scratch.
    const size_t m = Arena::round_up(size_t(N * c.hidden) * rs);
    if (c.ffns[i] == FfnKind::MoE)
      s = std::max(s, m + (backward ? moe_layer_backward_workspace_bytes(c, N, rs)
                                    : moe_layer_workspace_bytes(c, N, rs)));
    else
      s = std::max(s, m + (backward ? dense_ffn_backward_workspace_bytes(c, N, rs)
                                    : dense_ffn_workspace_bytes(c, N, rs)));
  }
  return s + attnres_backward_workspace_bytes(c.hidden, rs) + 65536;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Training state: what one layer's forward leaves for its backward, and the arenas.
template <typename Real>
struct ModelT<Real>::Train {
  // One layer's recorded forward (SPEC §1.3 names): x = attention-site mix (mixer input before
  // its norm), xn = its norm, y = FFN-site mix, yn = its norm, p_mid = p after the mixer.
  struct LayerRecord {
    Real *x = nullptr, *xn = nullptr, *y = nullptr, *yn = nullptr, *p_mid = nullptr;
    KdaSaved<Real> kda{};
    MlaSaved<Real> mla{};
    MoeSaved<Real> moe{};
    DenseFfnSaved<Real> dense{};
  };
  int64_t B = 0, T = 0;
  bool recompute = true;
  Arena saved;     // p_in per layer, sealed blocks, final-site tensors, layer records
  Arena scratch;   // sub-layer scratch (forward and backward)
  Arena grads;     // stream gradients
  std::vector<Real*> p_in;          // [L] p (or residual) entering layer i
  std::vector<int> sealed_in;       // [L] sealed block count entering layer i
  std::vector<uint8_t> p_empty_in;  // [L]
  Real* blocks = nullptr;           // [nb, N, d]
  Real *final_in = nullptr, *final_h = nullptr, *p_out = nullptr;
  std::vector<LayerRecord> records;  // [L] or [1] with recompute
  size_t records_mark = 0;
};

template <typename Real>
ModelT<Real>::ModelT(std::unique_ptr<ModelWeightsT<Real>> w) : w_(std::move(w)) {}
template <typename Real>
ModelT<Real>::~ModelT() = default;

template <typename Real>
std::unique_ptr<ModelT<Real>> ModelT<Real>::load(const std::string& dir) {
  return std::make_unique<ModelT<Real>>(weights_load<Real>(dir));
}

template <typename Real>
size_t ModelT<Real>::activation_bytes(int64_t B, int64_t T) const {
  const ModelConfig& c = w_->cfg;
  const int64_t N = B * T, d = c.hidden;
  SizeCounter s;
  for (int k = 0; k < 4; ++k) s.add<Real>(N * d);  // p, x, xn, out
  s.add<Real>(N * d * std::max(1, num_attnres_blocks(c)));
  return s.bytes + layer_scratch_bytes(c, B, T, sizeof(Real), false, 64) + 4096;
}

template <typename Real>
size_t ModelT<Real>::activation_peak() const {
  return act_.peak() + (train_ ? train_->saved.peak() + train_->scratch.peak() + train_->grads.peak() : 0);
}

template <typename Real>
void ModelT<Real>::ensure_activations(int64_t B, int64_t T) {
  if (B <= act_B_ && T <= act_T_) return;
  act_B_ = std::max(B, act_B_);
  act_T_ = std::max(T, act_T_);
  act_.reserve(activation_bytes(act_B_, act_T_), "activations");
}

template <typename Real>
void ModelT<Real>::forward(const int64_t* tokens, int64_t B, int64_t T, Real* logits,
                           ForwardObserver* obs, const ForwardOptions& opt, const int32_t* doc_start) {
  const ModelConfig& c = w_->cfg;
  const ModelWeightsT<Real>& W = *w_;
  DM_CHECK(B > 0 && T > 0, "forward: empty batch");
  DM_CHECK(T <= c.max_context, "forward: sequence length ", T, " exceeds the context limit ",
           c.max_context);
  check_token_ids(tokens, B * T, c.vocab_size, "input_ids");
  ensure_activations(B, T);
  act_.reset();
  const int64_t N = B * T, d = c.hidden;
  Real* p = act_.alloc<Real>(N * d);
  Real* x = act_.alloc<Real>(N * d);
  Real* xn = act_.alloc<Real>(N * d);
  Real* out = act_.alloc<Real>(N * d);
  const int nb = std::max(1, num_attnres_blocks(c));
  Real* blocks = act_.alloc<Real>(N * d * nb);
  std::vector<float> conv;
  auto emit = [&](const char* name, int i, const Real* t) {
    if (!obs) return;
    const std::string full = i < 0 ? std::string(name) : name + std::to_string(i);
    if constexpr (std::is_same_v<Real, float>) {
      obs->on_tensor(full, t, N, d);
    } else {
      conv.assign(t, t + N * d);
      obs->on_tensor(full, conv.data(), N, d);
    }
  };
  for (int64_t n = 0; n < N; ++n)
    std::copy(W.embed + tokens[n] * d, W.embed + (tokens[n] + 1) * d, p + n * d);
  auto mixer = [&](int i, const Real* in, Real* o) {
    if (c.mixers[i] == MixerKind::KDA)
      kda_layer_forward<Real>(c, W.layers[i].kda, in, o, B, T, act_, KdaRunOptions{opt.kda_chunk}, doc_start);
    else
      mla_layer_forward<Real>(c, W.layers[i].mla, in, o, B, T, act_, doc_start);
  };
  auto ffn = [&](int i, const Real* in, Real* o) {
    if (c.ffns[i] != FfnKind::MoE) {
      dense_ffn_forward<Real>(c, W.layers[i].dense, in, o, N, act_);
      return;
    }
    const size_t mark = act_.mark();
    MoeRoutingT<Real> r;
    moe_layer_forward<Real>(c, W.layers[i].moe, in, o, N, act_, &r);
    if (obs) {
      if constexpr (std::is_same_v<Real, float>) {
        obs->on_router(i, r.idx, r.weight, N, c.moe.top_k);
      } else {
        std::vector<float> wf(r.weight, r.weight + N * c.moe.top_k);
        obs->on_router(i, r.idx, wf.data(), N, c.moe.top_k);
      }
    }
    act_.release(mark);
  };
  residual_stack_forward<Real>(c, W, N, p, x, xn, out, blocks, mixer, ffn, emit);
  gemm(false, true, N, c.vocab_size, d, Real(1), xn, d, W.lm_head, d, Real(0), logits, c.vocab_size);
}

// ---------------------------------------------------------------------------------------------
// Training forward + backward.

template <typename Real>
size_t ModelT<Real>::train_activation_bytes(int64_t B, int64_t T, const TrainOptions& opt) const {
  const ModelConfig& c = w_->cfg;
  const int64_t N = B * T, d = c.hidden, L = c.num_layers;
  const size_t rs = sizeof(Real);
  SizeCounter s;
  for (int64_t i = 0; i < L; ++i) s.add<Real>(N * d);              // p_in
  s.add<Real>(N * d * std::max(1, num_attnres_blocks(c)));          // sealed blocks
  for (int k = 0; k < 3; ++k) s.add<Real>(N * d);                   // final_in, final_h, p_out
  size_t record = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    size_t r = 5 * Arena::round_up(size_t(N * d) * rs);
    r += c.mixers[i] == MixerKind::KDA ? kda_layer_saved_bytes(c, B, T, rs) : mla_layer_saved_bytes(c, B, T, rs);
    r += c.ffns[i] == FfnKind::MoE ? moe_layer_saved_bytes(c, N, rs) : dense_ffn_saved_bytes(c, N, rs);
    record = opt.recompute ? std::max(record, r) : record + r;
  }
  return s.bytes + record + 4096;
}

namespace {
// Stream-gradient buffers: dp, dx, dxn, dsub, plus dblocks [nb, N, d] and an LM-head tile.
template <typename Real>
size_t stream_grad_bytes(const ModelConfig& c, int64_t N, int64_t lm_rows) {
  SizeCounter s;
  for (int k = 0; k < 4; ++k) s.add<Real>(N * c.hidden);
  s.add<Real>(N * c.hidden * std::max(1, num_attnres_blocks(c)));
  s.add<Real>(lm_rows * c.vocab_size * 2);
  return s.bytes + 4096;
}
}  // namespace

template <typename Real>
TrainStepResult ModelT<Real>::forward_backward(const int64_t* tokens, const int64_t* targets,
                                               const int32_t* doc_start, int64_t B, int64_t T,
                                               ModelWeightsT<Real>& G, double loss_scale,
                                               const TrainOptions& opt, RoutingSink* sink) {
  const ModelConfig& c = w_->cfg;
  const ModelWeightsT<Real>& W = *w_;
  DM_CHECK(B > 0 && T > 0, "train: empty batch");
  DM_CHECK(T <= c.max_context, "train: sequence length ", T, " exceeds the context limit ", c.max_context);
  check_token_ids(tokens, B * T, c.vocab_size, "tokens");
  const int64_t N = B * T, d = c.hidden, V = c.vocab_size, L = c.num_layers;
  const size_t rs = sizeof(Real);
  if (!train_) train_ = std::make_unique<Train>();
  Train& tr = *train_;
  if (tr.B < B || tr.T < T || tr.recompute != opt.recompute) {
    tr.B = std::max(tr.B, B);
    tr.T = std::max(tr.T, T);
    tr.recompute = opt.recompute;
    tr.saved.reserve(train_activation_bytes(tr.B, tr.T, opt), "train saved activations");
    tr.scratch.reserve(std::max(layer_scratch_bytes(c, tr.B, tr.T, rs, true, opt.kda_chunk),
                                layer_scratch_bytes(c, tr.B, tr.T, rs, false, opt.kda_chunk)),
                       "train scratch");
    tr.grads.reserve(stream_grad_bytes<Real>(c, tr.B * tr.T, opt.lm_head_rows), "stream grads");
  }
  tr.saved.reset();
  tr.scratch.reset();
  tr.grads.reset();
  const bool attnres = c.residual == ResidualKind::AttnRes;
  const int nb = std::max(1, num_attnres_blocks(c));
  tr.p_in.assign(L, nullptr);
  tr.sealed_in.assign(L, 0);
  tr.p_empty_in.assign(L, 0);
  for (int64_t i = 0; i < L; ++i) tr.p_in[i] = tr.saved.template alloc<Real>(N * d);
  tr.blocks = tr.saved.template alloc<Real>(N * d * nb);
  tr.final_in = tr.saved.template alloc<Real>(N * d);
  tr.final_h = tr.saved.template alloc<Real>(N * d);
  tr.p_out = tr.saved.template alloc<Real>(N * d);
  tr.records.assign(opt.recompute ? 1 : L, typename Train::LayerRecord{});
  tr.records_mark = tr.saved.mark();

  Real* p = tr.p_out;  // the running p lives in p_out; copies go to p_in[i]
  int sealed = 0;
  bool p_empty = false;
  std::vector<const Real*> srcs;
  std::vector<Real*> dsrcs;
  auto sources_of = [&](int n_sealed, bool with_p, const Real* pp) {
    srcs.clear();
    for (int j = 0; j < n_sealed; ++j) srcs.push_back(tr.blocks + int64_t(j) * N * d);
    if (with_p) srcs.push_back(pp);
  };

  // Runs layer i's forward from the state (p = p_in[i], sealed_in, p_empty_in) into record `r`,
  // leaving p updated. `report` sends routing to the sink (first pass only).
  auto layer_forward = [&](int i, typename Train::LayerRecord& r, Real* pp, bool report) {
    const LayerWeightsT<Real>& Lw = W.layers[i];
    Arena& sv = tr.saved;
    r.x = sv.template alloc<Real>(N * d);
    r.xn = sv.template alloc<Real>(N * d);
    r.y = sv.template alloc<Real>(N * d);
    r.yn = sv.template alloc<Real>(N * d);
    r.p_mid = sv.template alloc<Real>(N * d);
    int s = tr.sealed_in[i];
    bool empty = tr.p_empty_in[i];
    if (attnres && s > 0) {
      sources_of(s, !empty, pp);
      attnres_forward<Real>(srcs.data(), int(srcs.size()), Lw.attn_site.query, Lw.attn_site.norm, r.x,
                            nullptr, N, d, c.rms_eps);
    } else {
      std::copy(pp, pp + N * d, r.x);
    }
    if (attnres && i % c.attn_res_block == 0) {  // seal: blocks[s] = p (already stored on pass 1)
      std::copy(pp, pp + N * d, tr.blocks + int64_t(s) * N * d);
      ++s;
      empty = true;
    }
    rmsnorm_forward<Real>(r.x, Lw.input_norm, r.xn, N, d, c.rms_eps);
    Real* a = r.p_mid;  // mixer output, then p_mid = (empty ? a : p + a)
    if (c.mixers[i] == MixerKind::KDA)
      kda_layer_forward<Real>(c, Lw.kda, r.xn, a, B, T, tr.scratch, KdaRunOptions{opt.kda_chunk},
                              doc_start, &r.kda, &tr.saved);
    else
      mla_layer_forward<Real>(c, Lw.mla, r.xn, a, B, T, tr.scratch, doc_start, &r.mla, &tr.saved);
    if (!empty) add_rows(a, pp, N * d);
    std::copy(a, a + N * d, pp);  // p = p_mid
    if (attnres) {
      sources_of(s, true, pp);
      attnres_forward<Real>(srcs.data(), int(srcs.size()), Lw.ffn_site.query, Lw.ffn_site.norm, r.y,
                            nullptr, N, d, c.rms_eps);
    } else {
      std::copy(pp, pp + N * d, r.y);
    }
    rmsnorm_forward<Real>(r.y, Lw.post_norm, r.yn, N, d, c.rms_eps);
    Real* m = tr.scratch.template alloc<Real>(N * d);
    if (c.ffns[i] == FfnKind::MoE) {
      moe_layer_forward<Real>(c, Lw.moe, r.yn, m, N, tr.scratch, nullptr, &r.moe, &tr.saved);
      if (report && sink) {
        if constexpr (std::is_same_v<Real, float>)
          sink->on_routing(i, r.moe.routing.scores, r.moe.routing.cutoff, r.moe.routing.idx, N,
                           c.moe.num_experts, c.moe.top_k);
      }
    } else {
      dense_ffn_forward<Real>(c, Lw.dense, r.yn, m, N, tr.scratch, &r.dense, &tr.saved);
    }
    add_rows(pp, m, N * d);
    tr.scratch.reset();
    return s;
  };

  // ---- forward, recording each layer's input ----
  for (int64_t n = 0; n < N; ++n)
    std::copy(W.embed + tokens[n] * d, W.embed + (tokens[n] + 1) * d, p + n * d);
  for (int i = 0; i < L; ++i) {
    std::copy(p, p + N * d, tr.p_in[i]);
    tr.sealed_in[i] = sealed;
    tr.p_empty_in[i] = p_empty;
    typename Train::LayerRecord& r = tr.records[opt.recompute ? 0 : i];
    if (opt.recompute) tr.saved.release(tr.records_mark);
    sealed = layer_forward(i, r, p, true);
    p_empty = false;
  }
  if (attnres) {
    sources_of(sealed, true, p);
    attnres_forward<Real>(srcs.data(), int(srcs.size()), W.output_site.query, W.output_site.norm,
                          tr.final_in, nullptr, N, d, c.rms_eps);
  } else {
    std::copy(p, p + N * d, tr.final_in);
  }
  rmsnorm_forward<Real>(tr.final_in, W.final_norm, tr.final_h, N, d, c.rms_eps);

  // ---- fused LM head + cross-entropy, tile by tile (no [N, V] logits kept) ----
  Real* dp = tr.grads.template alloc<Real>(N * d);
  Real* dx = tr.grads.template alloc<Real>(N * d);
  Real* dxn = tr.grads.template alloc<Real>(N * d);
  Real* dh = tr.grads.template alloc<Real>(N * d);
  Real* dblocks = tr.grads.template alloc<Real>(N * d * nb);
  Real* tile = tr.grads.template alloc<Real>(opt.lm_head_rows * V);
  Real* dtile = tr.grads.template alloc<Real>(opt.lm_head_rows * V);
  std::fill(dh, dh + N * d, Real(0));
  TrainStepResult res;
  for (int64_t r0 = 0; r0 < N; r0 += opt.lm_head_rows) {
    const int64_t rows = std::min(opt.lm_head_rows, N - r0);
    gemm(false, true, rows, V, d, Real(1), tr.final_h + r0 * d, d, W.lm_head, d, Real(0), tile, V);
    const CrossEntropyResult ce =
        cross_entropy_forward_backward<Real>(tile, targets + r0, dtile, rows, V, loss_scale);
    res.loss_sum += ce.loss_sum;
    res.count += ce.count;
    res.correct += ce.correct;
    gemm(false, false, rows, d, V, Real(1), dtile, V, W.lm_head, d, Real(1), dh + r0 * d, d);
    gemm(true, false, V, d, rows, Real(1), dtile, V, tr.final_h + r0 * d, d, Real(1), G.lm_head, d);
  }

  // ---- backward ----
  std::fill(dp, dp + N * d, Real(0));
  std::fill(dblocks, dblocks + N * d * nb, Real(0));
  std::fill(dx, dx + N * d, Real(0));
  rmsnorm_backward<Real>(tr.final_in, W.final_norm, dh, dx, G.final_norm, N, d, c.rms_eps);
  auto dsources_of = [&](int n_sealed, bool with_p) {
    dsrcs.clear();
    for (int j = 0; j < n_sealed; ++j) dsrcs.push_back(dblocks + int64_t(j) * N * d);
    if (with_p) dsrcs.push_back(dp);
  };
  if (attnres) {
    sources_of(sealed, true, p);
    dsources_of(sealed, true);
    attnres_backward<Real>(srcs.data(), int(srcs.size()), W.output_site.query, W.output_site.norm,
                           dx, dsrcs.data(), G.output_site.query, G.output_site.norm, N, d,
                           c.rms_eps, tr.scratch);
  } else {
    add_rows(dp, dx, N * d);
  }

  for (int i = int(L) - 1; i >= 0; --i) {
    const LayerWeightsT<Real>& Lw = W.layers[i];
    LayerWeightsT<Real>& Lg = G.layers[i];
    typename Train::LayerRecord& r = tr.records[opt.recompute ? 0 : i];
    int s_in = tr.sealed_in[i];
    if (opt.recompute) {  // rebuild layer i's internals from its recorded input
      tr.saved.release(tr.records_mark);
      std::copy(tr.p_in[i], tr.p_in[i] + N * d, p);
      layer_forward(i, r, p, false);
    }
    const bool seals = attnres && i % c.attn_res_block == 0;
    const int s_mid = s_in + (seals ? 1 : 0);
    // FFN sub-layer: p_out = p_mid + FFN(norm(y)), y = mix(blocks[0..s_mid), p_mid).
    std::fill(dxn, dxn + N * d, Real(0));
    if (c.ffns[i] == FfnKind::MoE)
      moe_layer_backward<Real>(c, Lw.moe, Lg.moe, r.yn, r.moe, dp, dxn, N, tr.scratch);
    else
      dense_ffn_backward<Real>(c, Lw.dense, Lg.dense, r.yn, &r.dense, dp, dxn, N, tr.scratch);
    tr.scratch.reset();
    std::fill(dx, dx + N * d, Real(0));
    rmsnorm_backward<Real>(r.y, Lw.post_norm, dxn, dx, Lg.post_norm, N, d, c.rms_eps);
    if (attnres) {
      sources_of(s_mid, true, r.p_mid);
      dsources_of(s_mid, true);
      attnres_backward<Real>(srcs.data(), int(srcs.size()), Lw.ffn_site.query, Lw.ffn_site.norm, dx,
                             dsrcs.data(), Lg.ffn_site.query, Lg.ffn_site.norm, N, d, c.rms_eps,
                             tr.scratch);
      tr.scratch.reset();
    } else {
      add_rows(dp, dx, N * d);
    }
    // Mixer sub-layer: p_mid = [p_in +] Mixer(norm(x)); dp is now d p_mid = d a.
    std::fill(dxn, dxn + N * d, Real(0));
    if (c.mixers[i] == MixerKind::KDA)
      kda_layer_backward<Real>(c, Lw.kda, Lg.kda, r.xn, r.kda, dp, dxn, B, T, tr.scratch, doc_start);
    else
      mla_layer_backward<Real>(c, Lw.mla, Lg.mla, r.xn, r.mla, dp, dxn, B, T, tr.scratch, doc_start);
    tr.scratch.reset();
    std::fill(dx, dx + N * d, Real(0));
    rmsnorm_backward<Real>(r.x, Lw.input_norm, dxn, dx, Lg.input_norm, N, d, c.rms_eps);
    if (seals) {
      // p restarted after sealing: p_in's gradient is what its sealed copy collected.
      Real* db = dblocks + int64_t(s_in) * N * d;
      std::copy(db, db + N * d, dp);
      std::fill(db, db + N * d, Real(0));
    }
    // x = mix(blocks[0..s_in), p_in) when s_in > 0, else x = p_in.
    if (attnres && s_in > 0) {
      sources_of(s_in, !tr.p_empty_in[i], tr.p_in[i]);
      dsources_of(s_in, !tr.p_empty_in[i]);
      attnres_backward<Real>(srcs.data(), int(srcs.size()), Lw.attn_site.query, Lw.attn_site.norm, dx,
                             dsrcs.data(), Lg.attn_site.query, Lg.attn_site.norm, N, d, c.rms_eps,
                             tr.scratch);
      tr.scratch.reset();
    } else {
      add_rows(dp, dx, N * d);
    }
  }
  // dp is now d(embeddings).
  for (int64_t n = 0; n < N; ++n) {
    Real* g = G.embed + tokens[n] * d;
    const Real* s = dp + n * d;
    for (int64_t k = 0; k < d; ++k) g[k] += s[k];
  }
  return res;
}

template class ModelT<float>;
template class ModelT<double>;

}  // namespace dm
