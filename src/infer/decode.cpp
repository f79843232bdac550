#include "infer/decode.h"

#include "model/residual.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/gemm.h"
#include "model/kda.h"
#include "model/mla.h"
#include "model/moe.h"
#include "ops/cpu/attnres.h"
#include "ops/cpu/rmsnorm.h"

namespace dm {
namespace {

// Carves (or, with arena == nullptr, only counts) the cache of `st` in one fixed order, so the
// size and the layout cannot disagree.
size_t decode_carve_cache(const ModelConfig& c, int64_t S, int64_t Lmax, Arena* arena,
                          DecodeState* st) {
  SizeCounter counter;
  auto take = [&](int64_t n) -> float* {
    counter.add<float>(size_t(n));
    return arena ? arena->alloc<float>(size_t(n)) : nullptr;
  };
  const int64_t H = c.kda.num_heads, K = c.kda.head_dim, HK = H * K;
  const int64_t tail_rows = std::max(c.kda.conv_kernel - 1, 0);
  const int64_t kvl = c.mla.kv_lora_rank, rope = c.mla.qk_rope_dim;
  bool any_mla = false;
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.mixers[i] == MixerKind::KDA) {
      float* s = take(S * H * K * K);
      float* tq = take(S * tail_rows * HK);
      float* tk = take(S * tail_rows * HK);
      float* tv = take(S * tail_rows * HK);
      if (st) {
        st->kda_state[i] = s;
        st->kda_conv_tail_q[i] = tq;
        st->kda_conv_tail_k[i] = tk;
        st->kda_conv_tail_v[i] = tv;
      }
    } else {
      any_mla = true;
      float* lat = take(S * Lmax * kvl);
      float* kr = take(S * Lmax * rope);
      if (st) {
        st->mla_latent[i] = lat;
        st->mla_rope_key[i] = kr;
      }
    }
  }
  if (any_mla && c.mla.use_rope && rope > 0) {
    float* cs = take(Lmax * (rope / 2));
    float* sn = take(Lmax * (rope / 2));
    if (st) {
      st->rope_cos = cs;
      st->rope_sin = sn;
    }
  }
  return counter.bytes + 4096;
}

// Scratch for a prefill of up to T tokens and a decode step of all S slots.
size_t decode_work_bytes(const ModelConfig& c, int64_t T, int64_t S, int64_t Lmax) {
  const int64_t N = std::max(T, S), d = c.hidden;
  SizeCounter s;
  for (int k = 0; k < 4; ++k) s.add<float>(size_t(N * d));  // p, x, xn, out
  s.add<float>(size_t(N * d * std::max(1, residual_num_blocks(c))));
  s.add<float>(size_t(S * c.vocab_size));                    // decode logits of the active rows
  s.add<int64_t>(size_t(2 * S));                             // slots, positions
  size_t layer = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.mixers[i] == MixerKind::KDA)
      layer = std::max({layer, kda_layer_workspace_bytes(c, 1, T, 64),
                        kda_layer_decode_workspace_bytes(c, S)});
    else
      layer = std::max({layer, mla_layer_workspace_bytes(c, 1, T),
                        mla_layer_decode_workspace_bytes(c, S, Lmax)});
    layer = std::max(layer, c.ffns[i] == FfnKind::MoE ? moe_layer_workspace_bytes(c, N)
                                                      : dense_ffn_workspace_bytes(c, N));
  }
  return s.bytes + layer + 65536;
}

// The layer loop of ModelT::forward (plain residual or Block AttnRes, SPEC §1.3) over N rows
// that are independent across depth; `mixer(i, xn, out)` runs layer i's token mixer (prefill or
// decode form, with `work` as scratch). p [N, d] holds the embeddings on entry. Returns the
// final-normed hidden rows [N, d] (from `work`, valid until the caller releases it).
template <typename MixerFn>
float* decode_run_layers(Model& model, Arena& work, float* p, int64_t N, MixerFn&& mixer) {
  const ModelConfig& c = model.config();
  const ModelWeightsT<float>& W = model.weights();
  const int64_t d = c.hidden;
  float* x = work.alloc<float>(size_t(N * d));
  float* xn = work.alloc<float>(size_t(N * d));
  float* out = work.alloc<float>(size_t(N * d));
  float* blocks = work.alloc<float>(size_t(N * d * std::max(1, residual_num_blocks(c))));
  auto ffn = [&](int i, const float* in, float* o) {
    const size_t mark = work.mark();
    if (c.ffns[i] == FfnKind::MoE)
      moe_layer_forward<float>(c, W.layers[i].moe, in, o, N, work);
    else
      dense_ffn_forward<float>(c, W.layers[i].dense, in, o, N, work);
    work.release(mark);
  };
  return residual_stack_forward<float>(c, W, N, p, x, xn, out, blocks, mixer, ffn,
                                       [](const char*, int, const float*) {});
}

void decode_embed(const ModelWeightsT<float>& W, const int64_t* ids, int64_t n, int64_t d,
                  float* p) {
  for (int64_t r = 0; r < n; ++r)
    std::copy(W.embed + ids[r] * d, W.embed + (ids[r] + 1) * d, p + r * d);
}

void decode_ensure_work(const ModelConfig& c, DecodeState& st, int64_t prefill_tokens) {
  if (prefill_tokens <= st.work_prefill_tokens) return;
  st.work_prefill_tokens = prefill_tokens;
  st.work.reserve(decode_work_bytes(c, prefill_tokens, st.num_sequences, st.max_length),
                  "decode scratch");
}

MlaDecodeCache decode_mla_cache(const DecodeState& st, int layer) {
  return MlaDecodeCache{st.max_length, st.mla_latent[layer], st.mla_rope_key[layer], st.rope_cos,
                        st.rope_sin};
}

}  // namespace

size_t DecodeState::cache_bytes(const ModelConfig& cfg, int64_t S, int64_t Lmax) {
  return decode_carve_cache(cfg, S, Lmax, nullptr, nullptr);
}

DecodeState::DecodeState(const ModelConfig& cfg, int64_t S, int64_t Lmax)
    : num_sequences(S), max_length(Lmax) {
  DM_CHECK(S > 0 && Lmax > 0, "decode state: need ≥ 1 sequence and max length ≥ 1 (got ", S,
           ", ", Lmax, ")");
  DM_CHECK(Lmax <= cfg.max_context, "decode state: max length ", Lmax,
           " exceeds the context limit ", cfg.max_context);
  const size_t L = size_t(cfg.num_layers);
  for (auto* v : {&kda_state, &kda_conv_tail_q, &kda_conv_tail_k, &kda_conv_tail_v, &mla_latent,
                  &mla_rope_key})
    v->assign(L, nullptr);
  lengths.assign(size_t(S), 0);
  cache.reserve(cache_bytes(cfg, S, Lmax), "decode cache");
  decode_carve_cache(cfg, S, Lmax, &cache, this);
  if (rope_cos) mla_rope_tables(cfg.mla, Lmax, rope_cos, rope_sin);
  decode_ensure_work(cfg, *this, 1);
}

void prefill(Model& model, DecodeState& st, int64_t seq, const int32_t* ids, int64_t n,
             float* last_logits) {
  const ModelConfig& c = model.config();
  const ModelWeightsT<float>& W = model.weights();
  DM_CHECK(seq >= 0 && seq < st.num_sequences, "prefill: sequence slot ", seq, " outside [0, ",
           st.num_sequences, ")");
  DM_CHECK(n > 0 && n <= st.max_length, "prefill: prompt of ", n,
           " tokens does not fit the decode state (max length ", st.max_length, ")");
  std::vector<int64_t> ids64(ids, ids + n);
  check_token_ids(ids64.data(), n, c.vocab_size, "prompt");
  decode_ensure_work(c, st, n);
  st.work.reset();
  const int64_t d = c.hidden, H = c.kda.num_heads, K = c.kda.head_dim;
  const int64_t tail_stride = std::max(c.kda.conv_kernel - 1, 0) * H * K;
  const int64_t Lmax = st.max_length;
  float* p = st.work.alloc<float>(size_t(n * d));
  decode_embed(W, ids64.data(), n, d, p);
  float* hidden = decode_run_layers(model, st.work, p, n, [&](int i, const float* xn, float* out) {
    const LayerWeightsT<float>& L = W.layers[i];
    if (c.mixers[i] == MixerKind::KDA) {
      const KdaPrefillCache slot{st.kda_state[i] + seq * H * K * K,
                                 st.kda_conv_tail_q[i] + seq * tail_stride,
                                 st.kda_conv_tail_k[i] + seq * tail_stride,
                                 st.kda_conv_tail_v[i] + seq * tail_stride};
      kda_layer_prefill(c, L.kda, xn, out, n, st.work, slot);
    } else {
      mla_layer_prefill(c, L.mla, xn, out, n, st.work,
                        st.mla_latent[i] + seq * Lmax * c.mla.kv_lora_rank,
                        st.mla_rope_key[i] + seq * Lmax * c.mla.qk_rope_dim);
    }
  });
  gemm(false, true, 1, c.vocab_size, d, 1.0f, hidden + (n - 1) * d, d, W.lm_head, d, 0.0f,
       last_logits, c.vocab_size);
  st.lengths[size_t(seq)] = n;
  st.work.reset();
}

void decode_step(Model& model, DecodeState& st, const int32_t* next_ids, const int* active,
                 float* logits) {
  const ModelConfig& c = model.config();
  const ModelWeightsT<float>& W = model.weights();
  const int64_t S = st.num_sequences, d = c.hidden, V = c.vocab_size;
  st.work.reset();
  // Compact the active slots into rows 0..n−1.
  int64_t* slots = st.work.alloc<int64_t>(size_t(S));
  int64_t* positions = st.work.alloc<int64_t>(size_t(S));
  std::vector<int64_t> ids;
  int64_t n = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (active && !active[s]) continue;
    DM_CHECK(st.lengths[size_t(s)] > 0, "decode_step: slot ", s, " was not prefilled");
    DM_CHECK(st.lengths[size_t(s)] < st.max_length, "decode_step: slot ", s, " is full (",
             st.max_length, " tokens)");
    slots[n] = s;
    positions[n] = st.lengths[size_t(s)];
    ids.push_back(next_ids[s]);
    ++n;
  }
  if (n == 0) return;
  check_token_ids(ids.data(), n, V, "next_ids");
  float* row_logits = st.work.alloc<float>(size_t(n * V));
  float* p = st.work.alloc<float>(size_t(n * d));
  decode_embed(W, ids.data(), n, d, p);
  float* hidden = decode_run_layers(model, st.work, p, n, [&](int i, const float* xn, float* out) {
    const LayerWeightsT<float>& L = W.layers[i];
    if (c.mixers[i] == MixerKind::KDA) {
      const KdaPrefillCache all{st.kda_state[i], st.kda_conv_tail_q[i], st.kda_conv_tail_k[i],
                                st.kda_conv_tail_v[i]};
      kda_layer_decode(c, L.kda, xn, out, n, slots, all, st.work);
    } else {
      mla_layer_decode(c, L.mla, xn, out, n, slots, positions, decode_mla_cache(st, i), st.work);
    }
  });
  gemm(false, true, n, V, d, 1.0f, hidden, d, W.lm_head, d, 0.0f, row_logits, V);
  for (int64_t r = 0; r < n; ++r) {
    std::copy(row_logits + r * V, row_logits + (r + 1) * V, logits + slots[r] * V);
    ++st.lengths[size_t(slots[r])];
  }
  st.work.reset();
}

}  // namespace dm
