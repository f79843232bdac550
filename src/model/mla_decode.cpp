// Cached MLA inference over the paged latent cache (SPEC §1.2 weight absorption, §5 paging):
// multi-token extend of one sequence and one-token decode of many, sharing one absorbed path.
// Shapes: n new tokens, H heads, nope/rope/dv head dims, kvl = kv_lora, W = kvl + rope (the
// width of a cache row [c ; kr]), P = page_tokens.
//
//   q_abs[t, h] = [ q_nope[t, h] · W_k,h  |  q_rope[t, h] ]        [n, H, W]   (W_k,h: [nope, kvl])
//   scores      = scale · q_abs · rowsᵀ  over the slot's rows 0..pos(t)   (one MQA key per row)
//   latent[t,h] = softmax(scores) · rows[:, :kvl]                   [n, H, kvl]
//   o[t, h]     = W_v,h · latent[t, h]                              [n, H, dv]  (W_v,h: [dv, kvl])
//   y           = W_o · (o ⊙ sigmoid(W_gate x))
// The softmax is flash-style over pages (running max and sum, no [n, len] score matrix), so one
// routine serves a 1-token decode row and a 2048-token extend.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/fastmath.h"
#include "core/gemm.h"
#include "model/mla.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/rmsnorm.h"


namespace dm {
namespace {

// Query tokens per attention work unit in an extend: about 128 score rows (tokens × heads) per
// unit keeps the score tile [rows, P] in L2 and gives the GEMMs a useful M.
int64_t mla_extend_block_tokens(int64_t heads) { return std::max<int64_t>(1, 128 / heads); }

size_t mla_floats_bytes(int64_t count) {
  return Arena::round_up(size_t(std::max<int64_t>(count, 0)) * sizeof(float));
}

bool mla_decode_rope_on(const MlaConfig& m) { return m.use_rope && m.qk_rope_dim > 0; }

void mla_check_paged_cache(const ModelConfig& cfg, const MlaDecodeCache& cache,
                           const char* who) {
  DM_CHECK(cache.page_tokens > 0 && cache.pages_per_slot > 0 && cache.pages && cache.page_table,
           who, ": the paged latent cache is missing (page_tokens ", cache.page_tokens, ")");
  DM_CHECK(!mla_decode_rope_on(cfg.mla) || (cache.rope_cos && cache.rope_sin), who,
           ": RoPE is on but the cache has no rope tables");
}

// Address of the cache row of `position` in `slot`.
float* mla_cache_row(const MlaDecodeCache& cache, int64_t width, int64_t slot, int64_t position) {
  const int32_t page =
      cache.page_table[slot * cache.pages_per_slot + position / cache.page_tokens];
  return cache.pages + (int64_t(page) * cache.page_tokens + position % cache.page_tokens) * width;
}

// Projects n tokens x [n, d] (row r: slot slots[r], position positions[r]): writes each token's
// cache row [RMSNorm(c) ; RoPE(kr)] and returns the absorbed queries q_abs [n, H, W] (from ws).
float* mla_absorbed_queries(const ModelConfig& cfg, const MlaWeightsT<float>& w, const float* x,
                            int64_t n, const int64_t* slots, const int64_t* positions,
                            const MlaDecodeCache& cache, Arena& ws) {
  const MlaConfig& m = cfg.mla;
  const int64_t d = cfg.hidden, H = m.num_heads;
  const int64_t nope = m.qk_nope_dim, rope = m.qk_rope_dim, dq = nope + rope;
  const int64_t kvl = m.kv_lora_rank, ql = m.q_lora_rank, W = kvl + rope;
  const int64_t kvb_rows_per_head = nope + m.v_head_dim;  // W_kvb [H·(nope+dv), kvl]

  float* q_abs = ws.alloc<float>(size_t(n * H * W));
  const size_t mark = ws.mark();
  // q [n, H, dq] and [c ; kr] [n, W], as in the expanded form.
  float* q = ws.alloc<float>(size_t(n * H * dq));
  if (ql > 0) {
    float* q_a = ws.alloc<float>(size_t(n * ql));
    gemm(false, true, n, ql, d, 1.0f, x, d, w.q_a, d, 0.0f, q_a, ql);
    rmsnorm_forward(q_a, w.q_a_norm, q_a, n, ql, m.latent_norm_eps);
    gemm(false, true, n, H * dq, ql, 1.0f, q_a, ql, w.q_b, ql, 0.0f, q, H * dq);
  } else {
    gemm(false, true, n, H * dq, d, 1.0f, x, d, w.q_proj, d, 0.0f, q, H * dq);
  }
  float* kv_a = ws.alloc<float>(size_t(n * W));
  gemm(false, true, n, W, d, 1.0f, x, d, w.kv_a, d, 0.0f, kv_a, W);
  int64_t* head_positions = ws.alloc<int64_t>(size_t(n * H));
  for (int64_t r = 0; r < n; ++r) {
    float* row = kv_a + r * W;
    rmsnorm_forward(row, w.kv_a_norm, row, 1, kvl, m.latent_norm_eps);
    std::fill(head_positions + r * H, head_positions + (r + 1) * H, positions[r]);
  }
  if (mla_decode_rope_on(m)) {
    rope_apply_interleaved(q, n * H, dq, nope, int(rope), head_positions, cache.rope_cos,
                           cache.rope_sin);
    rope_apply_interleaved(kv_a, n, W, kvl, int(rope), positions, cache.rope_cos,
                           cache.rope_sin);
  }
  for (int64_t r = 0; r < n; ++r) {
    const float* row = kv_a + r * W;
    std::copy(row, row + W, mla_cache_row(cache, W, slots[r], positions[r]));
  }
  // Absorb W_kvb's key rows into the query: q_abs[r, h, :kvl] = q_nope[r, h] · W_k,h.
  for (int64_t h = 0; h < H; ++h)
    gemm(false, false, n, kvl, nope, 1.0f, q + h * dq, H * dq,
         w.kv_b + h * kvb_rows_per_head * kvl, kvl, 0.0f, q_abs + h * W, H * W);
  for (int64_t r = 0; r < n * H; ++r)
    std::copy(q + r * dq + nope, q + (r + 1) * dq, q_abs + r * W + kvl);
  ws.release(mark);
  return q_abs;
}

// One attention work unit: `tokens` consecutive query tokens of one slot at positions
// start..start+tokens−1, rows q_abs [tokens·H, W] → latent [tokens·H, kvl]. Row (i, h) sees the
// slot's positions 0..start+i. scores: scratch [tokens·H, P]; row_max, row_sum [tokens·H].
struct MlaAttentionUnit {
  int64_t first_row = 0;  // first token's index in q_abs / latent
  int64_t tokens = 0;
  int64_t slot = 0;
  int64_t start = 0;
};

void mla_paged_attention_unit(const MlaAttentionUnit& u, const float* q_abs, float* latent,
                              const MlaDecodeCache& cache, int64_t H, int64_t kvl, int64_t W,
                              float scale, float* scores, float* row_max, float* row_sum) {
  const int64_t P = cache.page_tokens, R = u.tokens * H;
  const float* q = q_abs + u.first_row * H * W;
  float* out = latent + u.first_row * H * kvl;
  std::fill(out, out + R * kvl, 0.0f);
  std::fill(row_max, row_max + R, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + R, 0.0f);
  const int64_t last = u.start + u.tokens - 1;  // last position any row sees
  const int32_t* table = cache.page_table + u.slot * cache.pages_per_slot;
  for (int64_t page_index = 0; page_index * P <= last; ++page_index) {
    const int64_t key0 = page_index * P, keys = std::min(P, last + 1 - key0);
    const float* rows = cache.pages + int64_t(table[page_index]) * P * W;  // [keys, W]
    gemm(false, true, R, keys, W, scale, q, W, rows, W, 0.0f, scores, P);
    for (int64_t r = 0; r < R; ++r) {
      // Token r / H at position start + r / H sees keys key0..start + r / H of this page.
      const int64_t visible = std::clamp<int64_t>(u.start + r / H - key0 + 1, 0, keys);
      float* s = scores + r * P;
      if (visible == 0) {
        std::fill(s, s + keys, 0.0f);
        continue;
      }
      const float new_max = std::max(row_max[r], *std::max_element(s, s + visible));
      const float correction = std::exp(row_max[r] - new_max);  // 0 on the first visible page
      float sum = 0.0f;
      for (int64_t j = 0; j < visible; ++j) {
        s[j] = std::exp(s[j] - new_max);
        sum += s[j];
      }
      std::fill(s + visible, s + keys, 0.0f);
      row_sum[r] = row_sum[r] * correction + sum;
      row_max[r] = new_max;
      if (correction != 1.0f) {
        float* o = out + r * kvl;
        for (int64_t c = 0; c < kvl; ++c) o[c] *= correction;
      }
    }
    gemm(false, false, R, kvl, keys, 1.0f, scores, P, rows, W, 1.0f, out, kvl);
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.0f / row_sum[r];
    for (int64_t c = 0; c < kvl; ++c) out[r * kvl + c] *= inv;
  }
}

size_t mla_attention_scratch_floats(int64_t rows, int64_t page_tokens) {
  return size_t(rows * page_tokens + 2 * rows);
}

// Runs the units, several at a time on the engine's threads (one scratch slice per thread from
// ws; fewer threads when ws is short). A single unit runs on the calling thread, so small
// decode batches pay no fork/join.
void mla_paged_attention(const MlaAttentionUnit* units, int64_t num_units, int64_t max_rows,
                         const float* q_abs, float* latent, const MlaDecodeCache& cache,
                         int64_t H, int64_t kvl, int64_t W, float scale, Arena& ws) {
  ArenaScope scope(ws);
  const size_t slice = mla_floats_bytes(int64_t(
      mla_attention_scratch_floats(max_rows, cache.page_tokens)));
  const int64_t room = int64_t((ws.capacity() - ws.used()) / slice);
  DM_CHECK(room >= 1, "mla attention: workspace too small (", ws.capacity() - ws.used(),
           " bytes left, need ", slice, ")");
  const int threads = int(std::min<int64_t>({num_threads(), num_units, room}));
  float* scratch = static_cast<float*>(ws.alloc_bytes(slice * size_t(threads)));
  BlasSingleThreadScope blas_single_thread(threads > 1);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int thread_index = dm::thread_index();
    float* scores = scratch + size_t(thread_index) * (slice / sizeof(float));
    float* row_max = scores + max_rows * cache.page_tokens;
    float* row_sum = row_max + max_rows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < num_units; ++u)
      mla_paged_attention_unit(units[u], q_abs, latent, cache, H, kvl, W, scale, scores,
                               row_max, row_sum);
  }
}

// latent [n, H, kvl] → y [n, d]: o = W_v,h · latent per head, the output gate on the
// up-projected values (so W_kvb's value rows stay out of W_o), then W_o.
void mla_absorbed_output(const ModelConfig& cfg, const MlaWeightsT<float>& w, const float* x,
                         const float* latent, float* y, int64_t n, Arena& ws) {
  ArenaScope scope(ws);
  const MlaConfig& m = cfg.mla;
  const int64_t d = cfg.hidden, H = m.num_heads, nope = m.qk_nope_dim, dv = m.v_head_dim;
  const int64_t kvl = m.kv_lora_rank, kvb_rows_per_head = nope + dv;
  float* o = ws.alloc<float>(size_t(n * H * dv));
  for (int64_t h = 0; h < H; ++h)
    gemm(false, true, n, dv, kvl, 1.0f, latent + h * kvl, H * kvl,
         w.kv_b + (h * kvb_rows_per_head + nope) * kvl, kvl, 0.0f, o + h * dv, H * dv);
  if (m.output_gate) {
    float* gate = ws.alloc<float>(size_t(n * H * dv));
    gemm(false, true, n, H * dv, d, 1.0f, x, d, w.gate, d, 0.0f, gate, H * dv);
    for (int64_t i = 0; i < n * H * dv; ++i) o[i] *= sigmoid(gate[i]);
  }
  gemm(false, true, n, d, H * dv, 1.0f, o, H * dv, w.o_proj, H * dv, 0.0f, y, d);
}

// The absorbed path for n rows (slots[r], positions[r]) grouped into attention units.
void mla_absorbed_forward(const ModelConfig& cfg, const MlaWeightsT<float>& w, const float* x,
                          float* y, int64_t n, const int64_t* slots, const int64_t* positions,
                          const MlaAttentionUnit* units, int64_t num_units, int64_t max_rows,
                          const MlaDecodeCache& cache, Arena& ws) {
  ArenaScope scope(ws);
  const MlaConfig& m = cfg.mla;
  const int64_t H = m.num_heads, kvl = m.kv_lora_rank, W = kvl + m.qk_rope_dim;
  float* q_abs = mla_absorbed_queries(cfg, w, x, n, slots, positions, cache, ws);
  float* latent = ws.alloc<float>(size_t(n * H * kvl));
  mla_paged_attention(units, num_units, max_rows, q_abs, latent, cache, H, kvl, W,
                      mla_softmax_scale(m), ws);
  mla_absorbed_output(cfg, w, x, latent, y, n, ws);
}

// Peak scratch of mla_absorbed_forward for n rows in units of at most max_rows score rows.
size_t mla_absorbed_workspace_bytes(const ModelConfig& cfg, int64_t n, int64_t max_rows,
                                    int64_t page_tokens) {
  const MlaConfig& m = cfg.mla;
  const int64_t H = m.num_heads, dq = m.qk_nope_dim + m.qk_rope_dim, dv = m.v_head_dim;
  const int64_t kvl = m.kv_lora_rank, W = kvl + m.qk_rope_dim;
  size_t bytes = mla_floats_bytes(n * H * W);                           // q_abs
  size_t projection = mla_floats_bytes(n * H * dq) + mla_floats_bytes(n * m.q_lora_rank) +
                      mla_floats_bytes(n * W) +
                      Arena::round_up(size_t(n * H) * sizeof(int64_t));  // q, q_a, kv_a, positions
  size_t attention = mla_floats_bytes(n * H * kvl);                      // latent
  const size_t slice =
      mla_floats_bytes(int64_t(mla_attention_scratch_floats(max_rows, page_tokens)));
  size_t tail = std::max(slice * size_t(std::max(1, num_threads())),
                         2 * mla_floats_bytes(n * H * dv));  // per-thread scores | o, gate
  bytes += std::max(projection, attention + tail);
  return bytes + 4096;
}

}  // namespace

size_t mla_layer_decode_workspace_bytes(const ModelConfig& cfg, int64_t n, int64_t page_tokens) {
  return mla_absorbed_workspace_bytes(cfg, n, cfg.mla.num_heads, page_tokens) +
         Arena::round_up(size_t(n) * sizeof(MlaAttentionUnit));
}

size_t mla_layer_extend_workspace_bytes(const ModelConfig& cfg, int64_t n, int64_t page_tokens) {
  const MlaConfig& m = cfg.mla;
  const int64_t block = mla_extend_block_tokens(m.num_heads);
  const int64_t units = (n + block - 1) / block;
  const size_t absorbed =
      mla_absorbed_workspace_bytes(cfg, n, block * m.num_heads, page_tokens) +
      Arena::round_up(size_t(units) * sizeof(MlaAttentionUnit)) +
      2 * Arena::round_up(size_t(n) * sizeof(int64_t));  // slots, positions
  const size_t expanded = mla_layer_workspace_bytes(cfg, 1, n) +
                          mla_floats_bytes(n * m.kv_lora_rank) +
                          mla_floats_bytes(n * m.qk_rope_dim);
  return std::max(absorbed, expanded);
}

void mla_layer_extend(const ModelConfig& cfg, const MlaWeightsT<float>& w, const float* x,
                      float* y, int64_t n, int64_t slot, int64_t start,
                      const MlaDecodeCache& cache, Arena& ws) {
  mla_check_paged_cache(cfg, cache, "mla_layer_extend");
  DM_CHECK(n > 0 && start >= 0 && slot >= 0 &&
               (start + n - 1) / cache.page_tokens < cache.pages_per_slot,
           "mla_layer_extend: ", n, " tokens at position ", start, " do not fit the slot's ",
           cache.pages_per_slot, " pages of ", cache.page_tokens, " tokens");
  ArenaScope scope(ws);
  const MlaConfig& m = cfg.mla;
  const int64_t kvl = m.kv_lora_rank, rope = m.qk_rope_dim, W = kvl + rope;
  if (start == 0) {
    // Expanded form over the whole (new) sequence, then its rows go to the pages.
    float* latent = ws.alloc<float>(size_t(n * kvl));
    float* rope_key = ws.alloc<float>(size_t(std::max<int64_t>(n * rope, 1)));
    mla_layer_prefill(cfg, w, x, y, n, ws, latent, rope_key);
    for (int64_t t = 0; t < n; ++t) {
      float* row = mla_cache_row(cache, W, slot, t);
      std::copy(latent + t * kvl, latent + (t + 1) * kvl, row);
      std::copy(rope_key + t * rope, rope_key + (t + 1) * rope, row + kvl);
    }
    return;
  }
  const int64_t block = mla_extend_block_tokens(m.num_heads);
  const int64_t num_units = (n + block - 1) / block;
  int64_t* slots = ws.alloc<int64_t>(size_t(n));
  int64_t* positions = ws.alloc<int64_t>(size_t(n));
  for (int64_t t = 0; t < n; ++t) {
    slots[t] = slot;
    positions[t] = start + t;
  }
  auto* units = ws.alloc<MlaAttentionUnit>(size_t(num_units));
  for (int64_t u = 0; u < num_units; ++u) {
    const int64_t first = u * block;
    units[u] = MlaAttentionUnit{first, std::min(block, n - first), slot, start + first};
  }
  mla_absorbed_forward(cfg, w, x, y, n, slots, positions, units, num_units,
                       block * m.num_heads, cache, ws);
}

void mla_layer_decode(const ModelConfig& cfg, const MlaWeightsT<float>& w, const float* x,
                      float* y, int64_t n, const int64_t* slots, const int64_t* positions,
                      const MlaDecodeCache& cache, Arena& ws) {
  mla_check_paged_cache(cfg, cache, "mla_layer_decode");
  ArenaScope scope(ws);
  auto* units = ws.alloc<MlaAttentionUnit>(size_t(n));
  for (int64_t r = 0; r < n; ++r) {
    DM_CHECK(positions[r] >= 0 && positions[r] / cache.page_tokens < cache.pages_per_slot,
             "mla decode: position ", positions[r], " outside the slot's ",
             cache.pages_per_slot, " pages of ", cache.page_tokens, " tokens");
    units[r] = MlaAttentionUnit{r, 1, slots[r], positions[r]};
  }
  mla_absorbed_forward(cfg, w, x, y, n, slots, positions, units, n, cfg.mla.num_heads, cache,
                       ws);
}

}  // namespace dm
