#include "infer/decode.h"

#include "model/residual.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/gemm.h"
#include "infer/prefix_cache.h"
#include "model/kda.h"
#include "model/mla.h"
#include "model/moe.h"
#include "model/params.h"
#include "ops/cpu/attnres.h"
#include "ops/cpu/rmsnorm.h"

namespace dm {
namespace {

int64_t decode_latent_width(const ModelConfig& c) {
  return c.mla.kv_lora_rank + c.mla.qk_rope_dim;
}

int64_t decode_num_pages(const ModelConfig& c, int64_t S, int64_t Lmax,
                         const DecodeStateOptions& opt) {
  DM_CHECK(opt.page_tokens > 0, "decode state: page_tokens must be ≥ 1, got ", opt.page_tokens);
  const int64_t pages_per_slot = (Lmax + opt.page_tokens - 1) / opt.page_tokens;
  const size_t page = DecodeState::page_bytes(c, opt.page_tokens);
  if (opt.page_pool_bytes == 0 || page == 0) return S * pages_per_slot;
  const int64_t pages = int64_t(opt.page_pool_bytes / page);
  DM_CHECK(pages >= 1, "decode state: the page pool budget of ", opt.page_pool_bytes,
           " bytes is smaller than one page (", page, " bytes: ", opt.page_tokens,
           " tokens of every MLA layer's latent rows)");
  return pages;
}

// Carves (or, with arena == nullptr, only counts) the cache of `st` in one fixed order, so the
// size and the layout cannot disagree.
size_t decode_carve_cache(const ModelConfig& c, int64_t S, int64_t Lmax,
                          const DecodeStateOptions& opt, Arena* arena, DecodeState* st) {
  SizeCounter counter;
  auto take = [&](int64_t n) -> float* {
    counter.add<float>(size_t(n));
    return arena ? arena->alloc<float>(size_t(n)) : nullptr;
  };
  const int64_t H = c.kda.num_heads, K = c.kda.head_dim, HK = H * K;
  const int64_t tail_rows = std::max(c.kda.conv_kernel - 1, 0);
  const int64_t num_pages = decode_num_pages(c, S, Lmax, opt);
  const int64_t pages_per_slot = (Lmax + opt.page_tokens - 1) / opt.page_tokens;
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
      float* pages = take(num_pages * opt.page_tokens * decode_latent_width(c));
      if (st) st->mla_pages[i] = pages;
    }
  }
  counter.add<int32_t>(size_t(S * pages_per_slot));
  if (st) st->page_table = arena->alloc<int32_t>(size_t(S * pages_per_slot));
  counter.bytes += LatentPagePool::bookkeeping_bytes(num_pages);
  if (st) st->pages.init(num_pages, *arena);
  const int64_t rope = c.mla.qk_rope_dim;
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

// Scratch for a prefill/extend of up to T tokens and a decode step of all S slots.
size_t decode_work_bytes(const ModelConfig& c, int64_t T, int64_t S, int64_t page_tokens) {
  const int64_t N = std::max(T, S), d = c.hidden;
  SizeCounter s;
  for (int k = 0; k < 4; ++k) s.add<float>(size_t(N * d));  // p, x, xn, out
  s.add<float>(size_t(N * d * std::max(1, residual_num_blocks(c))));
  s.add<float>(size_t(S * c.vocab_size));                    // decode logits of the active rows
  s.add<int64_t>(size_t(3 * S));                             // slots, positions, ids
  size_t layer = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.mixers[i] == MixerKind::KDA)
      layer = std::max({layer, kda_layer_workspace_bytes(c, 1, T, 64),
                        kda_layer_decode_workspace_bytes(c, S)});
    else
      layer = std::max({layer, mla_layer_extend_workspace_bytes(c, T, page_tokens),
                        mla_layer_decode_workspace_bytes(c, S, page_tokens)});
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

// Sets the engine's thread count (OpenMP and BLAS) while it lives; restores the caller's after.
class ThreadCountScope {
 public:
  explicit ThreadCountScope(int threads) : saved_(num_threads()), changed_(threads != saved_) {
    if (changed_) set_num_threads(threads);
  }
  ~ThreadCountScope() {
    if (changed_) set_num_threads(saved_);
  }
  ThreadCountScope(const ThreadCountScope&) = delete;
  ThreadCountScope& operator=(const ThreadCountScope&) = delete;

 private:
  int saved_;
  bool changed_;
};

// The workspace sizes count per-thread scratch with num_threads(). A small call runs inside a
// one-thread scope (DecodeThreadScope below), so sizing there would leave a later threaded call
// short: size for the most threads this state has been used with.
void decode_ensure_work(const ModelConfig& c, DecodeState& st, int64_t prefill_tokens) {
  const int threads = num_threads();
  if (prefill_tokens <= st.work_prefill_tokens && threads <= st.work_threads) return;
  st.work_prefill_tokens = std::max(prefill_tokens, st.work_prefill_tokens);
  st.work_threads = std::max(threads, st.work_threads);
  const ThreadCountScope sizing(st.work_threads);
  st.work.reserve(decode_work_bytes(c, st.work_prefill_tokens, st.num_sequences, st.page_tokens),
                  "decode scratch");
}

MlaDecodeCache decode_mla_cache(const DecodeState& st, int layer) {
  return MlaDecodeCache{st.page_tokens, st.pages_per_slot, st.mla_pages[size_t(layer)],
                        st.page_table, st.rope_cos, st.rope_sin};
}

KdaPrefillCache decode_kda_slot(const DecodeState& st, const ModelConfig& c, int layer,
                                int64_t seq) {
  const int64_t HK = int64_t(c.kda.num_heads) * c.kda.head_dim;
  const int64_t tail_stride = std::max(c.kda.conv_kernel - 1, 0) * HK;
  const size_t i = size_t(layer);
  return KdaPrefillCache{st.kda_state[i] + seq * HK * c.kda.head_dim,
                         st.kda_conv_tail_q[i] + seq * tail_stride,
                         st.kda_conv_tail_k[i] + seq * tail_stride,
                         st.kda_conv_tail_v[i] + seq * tail_stride};
}

void decode_check_slot(const DecodeState& st, int64_t seq, const char* who) {
  DM_CHECK(seq >= 0 && seq < st.num_sequences, who, ": sequence slot ", seq, " outside [0, ",
           st.num_sequences, ")");
}

// Below this many FLOPs a decode step (or a short extend) runs on one thread. Such a step is a
// few dozen short ops (GEMMs of n rows, norms, n rows of attention), each tens of microseconds on
// one core — less than handing it to a second thread gains, and on a busy machine a hand-off can
// cost a scheduler timeslice. Measured on configs/demo.json (2 cores, shared): 2 threads at
// batch 1 ran 2.1–92 ms/step (bimodal, per process), 1 thread 2.3 ms; at batch 8, 2 threads
// 6.6–8.3 ms against 10.8 ms on 1. 2^25 FLOPs ≈ batch 2 of that model (9.2M active
// parameters); every step of a model of ≥ 17M active parameters (Kimi-Linear, K3) keeps every
// thread.
constexpr double kDecodeParallelMinFlops = double(int64_t(1) << 25);

// FLOPs of n new rows attending over `attended` cached positions in total: the weights every
// row multiplies, plus absorbed attention (2·(2·kvl + rope) per position, head and MLA layer).
double decode_step_flops(const DecodeState& st, int64_t n, int64_t attended) {
  const ModelConfig& c = st.config;
  int64_t mla_layers = 0;
  for (int i = 0; i < c.num_layers; ++i) mla_layers += c.mixers[i] == MixerKind::MLA;
  const double per_position = 2.0 * double(c.mla.num_heads) *
                              double(2 * c.mla.kv_lora_rank + c.mla.qk_rope_dim) *
                              double(mla_layers);
  return 2.0 * double(n) * double(st.active_params) + per_position * double(attended);
}

// Runs the engine on one thread (OpenMP and BLAS) while it lives, when `single`; restores the
// caller's thread count after.
class DecodeThreadScope : public ThreadCountScope {
 public:
  explicit DecodeThreadScope(bool single) : ThreadCountScope(single ? 1 : num_threads()) {}
};

// reserve() or a dm::Error that says what ran out.
void decode_reserve_or_throw(DecodeState& st, int64_t seq, int64_t total_tokens, const char* who) {
  if (reserve(st, seq, total_tokens)) return;
  const size_t pool_bytes =
      size_t(st.pages.num_pages()) * DecodeState::page_bytes(st.config, st.page_tokens);
  throw Error(str_cat(
      who, ": out of latent-cache pages: slot ", seq, " needs ",
      st.pages_for_tokens(total_tokens) - st.slot_pages[size_t(seq)], " more pages of ",
      st.page_tokens, " tokens to hold ", total_tokens, " tokens, but ", st.pages.free_pages(),
      " of ", st.pages.num_pages(), " pages are free (pool of ", pool_bytes,
      " bytes); release finished slots or raise DecodeStateOptions::page_pool_bytes"));
}

// Appends ids [n] to slot seq (positions lengths[seq]..+n−1, pages already reserved) and writes
// the last logits. checkpoints: per model layer, num_checkpoints KDA copies (layer i's at
// checkpoints + i·num_checkpoints; the prefix cache's grid points), or nullptr.
void decode_extend_reserved(Model& model, DecodeState& st, int64_t seq, const int64_t* ids,
                            int64_t n, float* last_logits, const KdaCheckpoint* checkpoints,
                            int64_t num_checkpoints) {
  const ModelConfig& c = model.config();
  const ModelWeightsT<float>& W = model.weights();
  const int64_t start = st.lengths[size_t(seq)], d = c.hidden;
  // Attention work of the new rows: Σ_t (start + t + 1) positions.
  const int64_t attended = n * start + n * (n + 1) / 2;
  const DecodeThreadScope threads(decode_step_flops(st, n, attended) < kDecodeParallelMinFlops);
  decode_ensure_work(c, st, n);
  st.work.reset();
  float* p = st.work.alloc<float>(size_t(n * d));
  decode_embed(W, ids, n, d, p);
  float* hidden = decode_run_layers(model, st.work, p, n, [&](int i, const float* xn, float* out) {
    const LayerWeightsT<float>& L = W.layers[size_t(i)];
    if (c.mixers[i] == MixerKind::KDA) {
      kda_layer_extend(c, L.kda, xn, out, n, st.work, decode_kda_slot(st, c, i, seq),
                       /*fresh=*/start == 0,
                       checkpoints ? checkpoints + int64_t(i) * num_checkpoints : nullptr,
                       checkpoints ? num_checkpoints : 0);
    } else {
      mla_layer_extend(c, L.mla, xn, out, n, seq, start, decode_mla_cache(st, i), st.work);
    }
  });
  gemm(false, true, 1, c.vocab_size, d, 1.0f, hidden + (n - 1) * d, d, W.lm_head, d, 0.0f,
       last_logits, c.vocab_size);
  st.lengths[size_t(seq)] = start + n;
  st.work.reset();
}

std::vector<int64_t> decode_checked_ids(const ModelConfig& c, const int32_t* ids, int64_t n,
                                        const char* origin) {
  std::vector<int64_t> ids64(ids, ids + n);
  check_token_ids(ids64.data(), n, c.vocab_size, origin);
  return ids64;
}

// Prefill through the prefix cache: reuse the longest cached grid prefix, compute the rest while
// checkpointing the prompt's new grid prefixes, then publish them.
void decode_prefill_with_prefix_cache(Model& model, DecodeState& st, int64_t seq,
                                      const int32_t* ids, const std::vector<int64_t>& ids64,
                                      int64_t n, float* last_logits) {
  const ModelConfig& c = model.config();
  PrefixCache& cache = *st.prefix_cache;
  const PrefixCache::Match hit = cache.match(ids, n);
  // The match is the parent of this prompt's new entries: keep it while we work.
  const PrefixCache::LockGuard lock(cache, hit.entry);

  int32_t* table = st.page_table + seq * st.pages_per_slot;
  if (hit.tokens > 0) {
    for (int i = 0; i < c.num_layers; ++i) {
      if (c.mixers[i] != MixerKind::KDA) continue;
      const KdaPrefillCache from = cache.checkpoint(hit.entry, i);
      const KdaPrefillCache to = decode_kda_slot(st, c, i, seq);
      const int64_t HK = int64_t(c.kda.num_heads) * c.kda.head_dim;
      const int64_t tail = std::max(c.kda.conv_kernel - 1, 0) * HK;
      std::copy(from.state, from.state + HK * c.kda.head_dim, to.state);
      std::copy(from.conv_tail_q, from.conv_tail_q + tail, to.conv_tail_q);
      std::copy(from.conv_tail_k, from.conv_tail_k + tail, to.conv_tail_k);
      std::copy(from.conv_tail_v, from.conv_tail_v + tail, to.conv_tail_v);
    }
    const int64_t shared = st.pages_for_tokens(hit.tokens);
    cache.prefix_pages(hit.entry, table);
    for (int64_t j = 0; j < shared; ++j) st.pages.retain(table[j]);
    st.slot_pages[size_t(seq)] = shared;
    st.lengths[size_t(seq)] = hit.tokens;
  }
  try {
    decode_reserve_or_throw(st, seq, n, "prefill");
  } catch (...) {
    release(st, seq);
    throw;
  }

  // Checkpoints at the grid points after the match, up to and including n (unless all n tokens
  // are a cached prefix already).
  const int64_t G = cache.grid_tokens();
  const int64_t new_checkpoints = hit.whole_entry >= 0 ? 0 : n / G - hit.tokens / G;
  std::vector<int32_t> pending(size_t(std::max<int64_t>(new_checkpoints, 0)));
  const int64_t got = cache.reserve_entries(int64_t(pending.size()), pending.data());
  std::vector<KdaCheckpoint> checkpoints(size_t(c.num_layers * got));
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.mixers[i] != MixerKind::KDA) continue;
    for (int64_t j = 0; j < got; ++j)
      checkpoints[size_t(i * got + j)] =
          KdaCheckpoint{(j + 1) * G, cache.checkpoint(pending[size_t(j)], i)};
  }
  try {
    decode_extend_reserved(model, st, seq, ids64.data() + hit.tokens, n - hit.tokens,
                           last_logits, got > 0 ? checkpoints.data() : nullptr, got);
  } catch (...) {
    for (int64_t j = 0; j < got; ++j) cache.abandon(pending[size_t(j)]);
    release(st, seq);
    throw;
  }
  int32_t parent = hit.entry;
  for (int64_t j = 0; j < got; ++j) {
    cache.commit(pending[size_t(j)], parent, ids, hit.tokens + (j + 1) * G, table);
    parent = pending[size_t(j)];
  }
  st.cached_tokens[size_t(seq)] = hit.tokens;
}

}  // namespace

size_t DecodeState::page_bytes(const ModelConfig& cfg, int64_t page_tokens) {
  int64_t mla_layers = 0;
  for (int i = 0; i < cfg.num_layers; ++i) mla_layers += cfg.mixers[i] == MixerKind::MLA;
  return size_t(mla_layers * page_tokens * decode_latent_width(cfg)) * sizeof(float);
}

size_t DecodeState::cache_bytes(const ModelConfig& cfg, int64_t S, int64_t Lmax,
                                const DecodeStateOptions& opt) {
  return decode_carve_cache(cfg, S, Lmax, opt, nullptr, nullptr);
}

DecodeState::DecodeState(const ModelConfig& cfg, int64_t S, int64_t Lmax,
                         const DecodeStateOptions& opt)
    : config(cfg), num_sequences(S), max_length(Lmax), page_tokens(opt.page_tokens) {
  DM_CHECK(S > 0 && Lmax > 0, "decode state: need ≥ 1 sequence and max length ≥ 1 (got ", S,
           ", ", Lmax, ")");
  DM_CHECK(Lmax <= cfg.max_context, "decode state: max length ", Lmax,
           " exceeds the context limit ", cfg.max_context);
  DM_CHECK(opt.page_tokens > 0, "decode state: page_tokens must be ≥ 1, got ", opt.page_tokens);
  pages_per_slot = (Lmax + page_tokens - 1) / page_tokens;
  active_params = count_params(cfg).active;
  const size_t L = size_t(cfg.num_layers);
  for (auto* v : {&kda_state, &kda_conv_tail_q, &kda_conv_tail_k, &kda_conv_tail_v, &mla_pages})
    v->assign(L, nullptr);
  lengths.assign(size_t(S), 0);
  cached_tokens.assign(size_t(S), 0);
  slot_pages.assign(size_t(S), 0);
  cache.reserve(cache_bytes(cfg, S, Lmax, opt), "decode cache");
  decode_carve_cache(cfg, S, Lmax, opt, &cache, this);
  std::fill(page_table, page_table + S * pages_per_slot, -1);
  if (rope_cos) mla_rope_tables(cfg.mla, Lmax, rope_cos, rope_sin);
  decode_ensure_work(cfg, *this, 1);
}

DecodeState::~DecodeState() = default;

void DecodeState::enable_prefix_cache(size_t budget_bytes, int64_t grid_tokens) {
  prefix_cache.reset();  // drops the old entries' page references first
  prefix_cache = std::make_unique<PrefixCache>(config, pages, page_tokens,
                                               page_bytes(config, page_tokens), budget_bytes,
                                               grid_tokens > 0 ? grid_tokens : page_tokens);
}

bool reserve(DecodeState& st, int64_t seq, int64_t total_tokens) {
  decode_check_slot(st, seq, "reserve");
  DM_CHECK(total_tokens >= 0 && total_tokens <= st.max_length, "reserve: ", total_tokens,
           " tokens do not fit the decode state (max length ", st.max_length, ")");
  int64_t& held = st.slot_pages[size_t(seq)];
  const int64_t need = st.pages_for_tokens(total_tokens) - held;
  if (need <= 0) return true;
  while (st.pages.free_pages() < need && st.prefix_cache && st.prefix_cache->evict_one()) {
  }
  if (st.pages.free_pages() < need) return false;
  int32_t* table = st.page_table + seq * st.pages_per_slot;
  for (int64_t j = 0; j < need; ++j) table[held++] = st.pages.take();
  return true;
}

void release(DecodeState& st, int64_t seq) {
  decode_check_slot(st, seq, "release");
  int32_t* table = st.page_table + seq * st.pages_per_slot;
  for (int64_t j = 0; j < st.slot_pages[size_t(seq)]; ++j) {
    st.pages.drop(table[j]);
    table[j] = -1;
  }
  st.slot_pages[size_t(seq)] = 0;
  st.lengths[size_t(seq)] = 0;
  st.cached_tokens[size_t(seq)] = 0;
}

void extend(Model& model, DecodeState& st, int64_t seq, const int32_t* ids, int64_t n,
            float* last_logits) {
  decode_check_slot(st, seq, "extend");
  const int64_t start = st.lengths[size_t(seq)];
  DM_CHECK(n > 0 && start + n <= st.max_length, "extend: ", n, " tokens after ", start,
           " do not fit the decode state (max length ", st.max_length, ")");
  const std::vector<int64_t> ids64 = decode_checked_ids(model.config(), ids, n, "extend ids");
  decode_reserve_or_throw(st, seq, start + n, "extend");
  decode_extend_reserved(model, st, seq, ids64.data(), n, last_logits, nullptr, 0);
}

void prefill(Model& model, DecodeState& st, int64_t seq, const int32_t* ids, int64_t n,
             float* last_logits) {
  decode_check_slot(st, seq, "prefill");
  DM_CHECK(n > 0 && n <= st.max_length, "prefill: prompt of ", n,
           " tokens does not fit the decode state (max length ", st.max_length, ")");
  const std::vector<int64_t> ids64 = decode_checked_ids(model.config(), ids, n, "prompt");
  release(st, seq);
  if (st.prefix_cache) {
    decode_prefill_with_prefix_cache(model, st, seq, ids, ids64, n, last_logits);
    return;
  }
  decode_reserve_or_throw(st, seq, n, "prefill");
  decode_extend_reserved(model, st, seq, ids64.data(), n, last_logits, nullptr, 0);
}

void decode_step(Model& model, DecodeState& st, const int32_t* next_ids, const int* active,
                 float* logits) {
  const ModelConfig& c = model.config();
  const ModelWeightsT<float>& W = model.weights();
  const int64_t S = st.num_sequences, d = c.hidden, V = c.vocab_size;
  decode_ensure_work(c, st, 1);  // grows the scratch if this thread runs more threads than before
  st.work.reset();
  // Compact the active slots into rows 0..n−1.
  int64_t* slots = st.work.alloc<int64_t>(size_t(S));
  int64_t* positions = st.work.alloc<int64_t>(size_t(S));
  int64_t* ids = st.work.alloc<int64_t>(size_t(S));
  int64_t n = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (active && !active[s]) continue;
    DM_CHECK(st.lengths[size_t(s)] > 0, "decode_step: slot ", s, " was not prefilled");
    DM_CHECK(st.lengths[size_t(s)] < st.max_length, "decode_step: slot ", s, " is full (",
             st.max_length, " tokens)");
    slots[n] = s;
    positions[n] = st.lengths[size_t(s)];
    ids[n] = next_ids[s];
    ++n;
  }
  if (n == 0) return;
  check_token_ids(ids, n, V, "next_ids");
  int64_t attended = 0;
  for (int64_t r = 0; r < n; ++r) {
    decode_reserve_or_throw(st, slots[r], positions[r] + 1, "decode_step");
    attended += positions[r] + 1;
  }
  const DecodeThreadScope threads(decode_step_flops(st, n, attended) < kDecodeParallelMinFlops);
  float* row_logits = st.work.alloc<float>(size_t(n * V));
  float* p = st.work.alloc<float>(size_t(n * d));
  decode_embed(W, ids, n, d, p);
  float* hidden = decode_run_layers(model, st.work, p, n, [&](int i, const float* xn, float* out) {
    const LayerWeightsT<float>& L = W.layers[size_t(i)];
    if (c.mixers[i] == MixerKind::KDA) {
      const KdaPrefillCache all{st.kda_state[size_t(i)], st.kda_conv_tail_q[size_t(i)],
                                st.kda_conv_tail_k[size_t(i)], st.kda_conv_tail_v[size_t(i)]};
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
