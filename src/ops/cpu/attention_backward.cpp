// Backward of the causal softmax attention (SPEC §1.2, training), FlashAttention-2 style, and a
// full-matrix reference backward in double (tests).
//
// With S = scale·Q Kᵀ (masked), P = softmax(S) row-wise, O = P V, and upstream dO:
//   Δ_t  = Σ_d dO_td · O_td            (= Σ_j P_tj dP_tj, one number per query row)
//   dP   = dO Vᵀ,  dS = P ⊙ (dP − Δ)
//   dV  += Pᵀ dO,  dQ += scale · dS K,  dK += scale · dSᵀ Q
// P is never stored: every [block, block] tile recomputes it as exp(S − lse) from the lse the
// forward saved, so memory stays O(threads · block²) plus Δ [B, H, T].
//
// Parallelism and determinism. Tiles (query block i, key block j ≤ i) of one (b, h) write dQ_i,
// dK_j and dV_j. Two schedules produce bit-identical results, because every tile is computed by
// the same code and every gradient block sums its tiles in the same order (dQ_i over j
// ascending, dK_j/dV_j over i ascending), each GEMM accumulating straight into the output:
//   - per-head: one thread owns a whole (b, h) and walks all its tiles (5 GEMMs per tile). Used
//     when there are enough heads to keep every thread busy.
//   - two-pass: pass 1 parallel over (b, h, key block) writes dK_j, dV_j; pass 2 parallel over
//     (b, h, query block) writes dQ_i. P and dP are recomputed in both passes (7 GEMMs per tile
//     instead of 5) but the parallelism is B·H·T/block. Used when B·H is small.
// So the gradients do not depend on the thread count, and no atomics or reductions are needed.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/fastmath.h"
#include "core/gemm.h"
#include "core/threading.h"
#include "ops/cpu/attention.h"


namespace dm {

namespace {

// Per-thread scratch (in Reals): the probability tile P and the dP / dS tile, each
// [block_rows, block_rows], padded to 64 bytes.
struct AttentionBackwardScratchLayout {
  int64_t block_rows = 0;
  int64_t tile_reals = 0;
  int64_t slice_reals = 0;
  int64_t delta_reals = 0;  // Δ [B, H, T], shared

  AttentionBackwardScratchLayout(const AttnShape& s, int block, size_t real_bytes) {
    const int64_t reals_per_line = int64_t(Arena::kAlign / real_bytes);
    auto pad = [&](int64_t n) { return (n + reals_per_line - 1) / reals_per_line * reals_per_line; };
    block_rows = std::max<int64_t>(1, std::min<int64_t>(block, s.T));
    tile_reals = pad(block_rows * block_rows);
    slice_reals = 2 * tile_reals;
    delta_reals = pad(s.B * s.H * s.T);
  }
};

// Everything a tile needs, so the two schedules call exactly the same tile code.
template <typename Real>
struct AttentionBackwardProblem {
  const Real *q, *k, *v, *lse, *dout, *delta;
  Real *dq, *dk, *dv;
  const int32_t* doc_start;  // [B, T] or nullptr
  int64_t T, H, Dqk, Dv, block_rows, num_blocks;
  int64_t qk_row_stride, vo_row_stride;  // H·Dqk, H·Dv (≥ 1 for cblas)
  Real scale;

  int64_t block_start(int64_t block) const { return block * block_rows; }
  int64_t block_size(int64_t block) const { return std::min(block_rows, T - block * block_rows); }

  // False when no query row of `query_block` sees any key of `key_block` (above the diagonal, or
  // the whole key block lies before every row's document start).
  bool tile_has_visible_keys(int64_t b, int64_t query_block, int64_t key_block) const {
    if (key_block > query_block) return false;
    if (!doc_start) return true;
    const int64_t last_key = block_start(key_block) + block_size(key_block) - 1;
    const int64_t query_start = block_start(query_block);
    const int32_t* row_doc_start = doc_start + b * T;
    for (int64_t t = query_start; t < query_start + block_size(query_block); ++t)
      if (row_doc_start[t] <= last_key) return true;
    return false;
  }

  // Fills prob_tile with P and dscore_tile with dS for tile (query_block, key_block) of (b, h),
  // both [query_rows, key_rows] with leading dimension block_rows; masked entries are 0.
  void compute_probability_and_dscore_tiles(int64_t b, int64_t h, int64_t query_block,
                                            int64_t key_block, Real* prob_tile,
                                            Real* dscore_tile) const {
    const int64_t query_start = block_start(query_block), query_rows = block_size(query_block);
    const int64_t key_start = block_start(key_block), key_rows = block_size(key_block);
    const Real* q_tile = q + ((b * T + query_start) * H + h) * Dqk;
    const Real* k_tile = k + ((b * T + key_start) * H + h) * Dqk;
    const Real* v_tile = v + ((b * T + key_start) * H + h) * Dv;
    const Real* dout_tile = dout + ((b * T + query_start) * H + h) * Dv;
    const Real* lse_rows = lse + (b * H + h) * T + query_start;
    const Real* delta_rows = delta + (b * H + h) * T + query_start;
    const int32_t* row_doc_start = doc_start ? doc_start + b * T : nullptr;

    // S = scale · Q_i K_jᵀ      [query_rows, key_rows]
    gemm(false, true, query_rows, key_rows, Dqk, scale, q_tile, qk_row_stride, k_tile,
         qk_row_stride, Real(0), prob_tile, block_rows);
    // dP = dO_i V_jᵀ            [query_rows, key_rows]
    gemm(false, true, query_rows, key_rows, Dv, Real(1), dout_tile, vo_row_stride, v_tile,
         vo_row_stride, Real(0), dscore_tile, block_rows);

    for (int64_t i = 0; i < query_rows; ++i) {
      const int64_t t = query_start + i;
      const int64_t end_visible = std::min(key_rows, t - key_start + 1);
      const int64_t first_visible =
          row_doc_start ? std::clamp<int64_t>(row_doc_start[t] - key_start, 0, key_rows) : 0;
      Real* prob_row = prob_tile + i * block_rows;
      Real* dscore_row = dscore_tile + i * block_rows;
      const Real row_lse = lse_rows[i], row_delta = delta_rows[i];
      // Masked keys (before the document start, after the diagonal): P = dS = 0.
      for (int64_t j = 0; j < std::min(first_visible, key_rows); ++j)
        prob_row[j] = dscore_row[j] = Real(0);
#pragma omp simd
      for (int64_t j = first_visible; j < end_visible; ++j) {
        // exp(S − lse) ≤ 1 for visible keys: lse is the log of a sum that contains exp(S).
        const Real p = fast_exp_keep_nan(Real(prob_row[j] - row_lse));
        prob_row[j] = p;
        dscore_row[j] = p * (dscore_row[j] - row_delta);
      }
      for (int64_t j = std::max<int64_t>(end_visible, first_visible); j < key_rows; ++j)
        prob_row[j] = dscore_row[j] = Real(0);
    }
  }

  // dV_j += Pᵀ dO_i;  dK_j += scale · dSᵀ Q_i
  void accumulate_key_value_gradients(int64_t b, int64_t h, int64_t query_block,
                                      int64_t key_block, const Real* prob_tile,
                                      const Real* dscore_tile) const {
    const int64_t query_start = block_start(query_block), query_rows = block_size(query_block);
    const int64_t key_start = block_start(key_block), key_rows = block_size(key_block);
    const Real* q_tile = q + ((b * T + query_start) * H + h) * Dqk;
    const Real* dout_tile = dout + ((b * T + query_start) * H + h) * Dv;
    Real* dk_tile = dk + ((b * T + key_start) * H + h) * Dqk;
    Real* dv_tile = dv + ((b * T + key_start) * H + h) * Dv;
    gemm(true, false, key_rows, Dv, query_rows, Real(1), prob_tile, block_rows, dout_tile,
         vo_row_stride, Real(1), dv_tile, vo_row_stride);
    gemm(true, false, key_rows, Dqk, query_rows, scale, dscore_tile, block_rows, q_tile,
         qk_row_stride, Real(1), dk_tile, qk_row_stride);
  }

  // dQ_i += scale · dS K_j
  void accumulate_query_gradient(int64_t b, int64_t h, int64_t query_block, int64_t key_block,
                                 const Real* dscore_tile) const {
    const int64_t query_start = block_start(query_block), query_rows = block_size(query_block);
    const int64_t key_start = block_start(key_block), key_rows = block_size(key_block);
    const Real* k_tile = k + ((b * T + key_start) * H + h) * Dqk;
    Real* dq_tile = dq + ((b * T + query_start) * H + h) * Dqk;
    gemm(false, false, query_rows, Dqk, key_rows, scale, dscore_tile, block_rows, k_tile,
         qk_row_stride, Real(1), dq_tile, qk_row_stride);
  }
};

void check_backward_shape(const AttnShape& s, int block) {
  DM_CHECK(block > 0, "attention backward: block must be positive, got ", block);
  DM_CHECK(s.B >= 0 && s.T >= 0 && s.H >= 0 && s.Dqk >= 0 && s.Dv >= 0,
           "attention backward: negative shape B=", s.B, " T=", s.T, " H=", s.H, " Dqk=", s.Dqk,
           " Dv=", s.Dv);
}

}  // namespace

size_t attention_causal_backward_workspace_bytes(const AttnShape& s, int block,
                                                 size_t real_bytes) {
  check_backward_shape(s, block);
  DM_CHECK(real_bytes == 4 || real_bytes == 8,
           "attention backward: real_bytes must be 4 or 8, got ", real_bytes);
  const AttentionBackwardScratchLayout layout(s, block, real_bytes);
  const int64_t threads = std::max(1, num_threads());
  return Arena::round_up(size_t(layout.delta_reals) * real_bytes) +
         Arena::round_up(size_t(threads * layout.slice_reals) * real_bytes);
}

template <typename Real>
void attention_causal_backward(const Real* q, const Real* k, const Real* v, const Real* o,
                               const Real* lse, const Real* dout, Real* dq, Real* dk, Real* dv,
                               const AttnShape& s, double scale, Arena& ws, int block,
                               const int32_t* doc_start) {
  check_backward_shape(s, block);
  const int64_t B = s.B, T = s.T, H = s.H, Dqk = s.Dqk, Dv = s.Dv;
  if (B == 0 || T == 0 || H == 0) return;
  attention_check_doc_start(doc_start, B, T);

  const AttentionBackwardScratchLayout layout(s, block, sizeof(Real));
  const int64_t num_blocks = (T + layout.block_rows - 1) / layout.block_rows;
  const int64_t num_batch_heads = B * H;
  const int available_threads = std::max(1, num_threads());

  ArenaScope scratch_scope(ws);
  Real* delta = ws.alloc<Real>(size_t(layout.delta_reals));  // [B, H, T]

  // Δ[b, h, t] = Σ_d dO · O, summed in double (for float inputs) in a fixed order.
#pragma omp parallel for schedule(static) if (B * T * H * Dv >= (1 << 15))
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t b = bt / T, t = bt % T;
    for (int64_t h = 0; h < H; ++h) {
      const Real* dout_row = dout + (bt * H + h) * Dv;
      const Real* o_row = o + (bt * H + h) * Dv;
      double dot = 0;
      for (int64_t d = 0; d < Dv; ++d) dot += double(dout_row[d]) * double(o_row[d]);
      delta[(b * H + h) * T + t] = Real(dot);
    }
  }

  AttentionBackwardProblem<Real> problem{q, k, v, lse, dout, delta, dq, dk, dv, doc_start,
                                         T, H, Dqk, Dv, layout.block_rows, num_blocks,
                                         std::max<int64_t>(1, H * Dqk),
                                         std::max<int64_t>(1, H * Dv), Real(scale)};

  // Per-head schedule when every thread gets whole heads with little imbalance.
  const bool use_per_head_schedule =
      num_blocks == 1 || available_threads == 1 ||
      (num_batch_heads >= available_threads &&
       (num_batch_heads % available_threads == 0 || num_batch_heads >= 4 * available_threads));

  const int64_t max_parallel_items =
      use_per_head_schedule ? num_batch_heads : num_batch_heads * num_blocks;
  const int num_team_threads =
      int(std::max<int64_t>(1, std::min<int64_t>(available_threads, max_parallel_items)));
  Real* all_thread_scratch = ws.alloc<Real>(size_t(num_team_threads * layout.slice_reals));
  BlasSingleThreadScope blas_single_thread;

  if (use_per_head_schedule) {
#pragma omp parallel num_threads(num_team_threads)
    {
      Real* prob_tile = all_thread_scratch + thread_index() * layout.slice_reals;
      Real* dscore_tile = prob_tile + layout.tile_reals;
#pragma omp for schedule(dynamic, 1)
      for (int64_t batch_head = 0; batch_head < num_batch_heads; ++batch_head) {
        const int64_t b = batch_head / H, h = batch_head % H;
        for (int64_t key_block = 0; key_block < num_blocks; ++key_block)
          for (int64_t query_block = key_block; query_block < num_blocks; ++query_block) {
            if (!problem.tile_has_visible_keys(b, query_block, key_block)) continue;
            problem.compute_probability_and_dscore_tiles(b, h, query_block, key_block, prob_tile,
                                                         dscore_tile);
            problem.accumulate_key_value_gradients(b, h, query_block, key_block, prob_tile,
                                                   dscore_tile);
            problem.accumulate_query_gradient(b, h, query_block, key_block, dscore_tile);
          }
      }
    }
    return;
  }

  const int64_t num_work_items = num_batch_heads * num_blocks;
#pragma omp parallel num_threads(num_team_threads)
  {
    Real* prob_tile = all_thread_scratch + thread_index() * layout.slice_reals;
    Real* dscore_tile = prob_tile + layout.tile_reals;

    // Pass 1: dK_j, dV_j. Key block j has (num_blocks − j) query blocks: low j first (heaviest).
#pragma omp for schedule(dynamic, 1)
    for (int64_t work_item = 0; work_item < num_work_items; ++work_item) {
      const int64_t key_block = work_item / num_batch_heads;
      const int64_t batch_head = work_item % num_batch_heads;
      const int64_t b = batch_head / H, h = batch_head % H;
      for (int64_t query_block = key_block; query_block < num_blocks; ++query_block) {
        if (!problem.tile_has_visible_keys(b, query_block, key_block)) continue;
        problem.compute_probability_and_dscore_tiles(b, h, query_block, key_block, prob_tile,
                                                     dscore_tile);
        problem.accumulate_key_value_gradients(b, h, query_block, key_block, prob_tile,
                                               dscore_tile);
      }
    }
    // (implicit barrier: pass 2 reads nothing pass 1 writes, but the scratch tiles are reused)

    // Pass 2: dQ_i. Query block i has i + 1 key blocks: high i first (heaviest).
#pragma omp for schedule(dynamic, 1)
    for (int64_t work_item = 0; work_item < num_work_items; ++work_item) {
      const int64_t query_block = num_blocks - 1 - work_item / num_batch_heads;
      const int64_t batch_head = work_item % num_batch_heads;
      const int64_t b = batch_head / H, h = batch_head % H;
      for (int64_t key_block = 0; key_block <= query_block; ++key_block) {
        if (!problem.tile_has_visible_keys(b, query_block, key_block)) continue;
        problem.compute_probability_and_dscore_tiles(b, h, query_block, key_block, prob_tile,
                                                     dscore_tile);
        problem.accumulate_query_gradient(b, h, query_block, key_block, dscore_tile);
      }
    }
  }
}

template <typename Real>
void attention_causal_reference_backward(const Real* q, const Real* k, const Real* v,
                                         const Real* dout, Real* dq, Real* dk, Real* dv,
                                         const AttnShape& s, double scale,
                                         const int32_t* doc_start) {
  const int64_t B = s.B, T = s.T, H = s.H, Dqk = s.Dqk, Dv = s.Dv;
  attention_check_doc_start(doc_start, B, T);
  // Tests only: plain loops over full T×T matrices in double, straight from the definitions
  // (Δ from P·dP rather than dO·O, so it shares no shortcut with the kernel).
  std::vector<double> prob(size_t(T * T)), dprob(size_t(T * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      auto q_at = [&](int64_t t, int64_t d) { return double(q[((b * T + t) * H + h) * Dqk + d]); };
      auto k_at = [&](int64_t t, int64_t d) { return double(k[((b * T + t) * H + h) * Dqk + d]); };
      auto v_at = [&](int64_t t, int64_t d) { return double(v[((b * T + t) * H + h) * Dv + d]); };
      auto dout_at = [&](int64_t t, int64_t d) {
        return double(dout[((b * T + t) * H + h) * Dv + d]);
      };
      std::fill(prob.begin(), prob.end(), 0.0);
      std::fill(dprob.begin(), dprob.end(), 0.0);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t first_key = doc_start ? doc_start[b * T + t] : 0;
        double row_max = -INFINITY;
        for (int64_t j = first_key; j <= t; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < Dqk; ++d) dot += q_at(t, d) * k_at(j, d);
          prob[t * T + j] = scale * dot;
          row_max = std::max(row_max, prob[t * T + j]);
        }
        double row_sum = 0;
        for (int64_t j = first_key; j <= t; ++j) {
          prob[t * T + j] = std::exp(prob[t * T + j] - row_max);
          row_sum += prob[t * T + j];
        }
        for (int64_t j = first_key; j <= t; ++j) prob[t * T + j] /= row_sum;
        // dP_tj = dO_t · V_j;  dS = P ⊙ (dP − Σ_j P dP)
        double delta = 0;
        for (int64_t j = first_key; j <= t; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < Dv; ++d) dot += dout_at(t, d) * v_at(j, d);
          dprob[t * T + j] = dot;
          delta += prob[t * T + j] * dot;
        }
        for (int64_t j = first_key; j <= t; ++j)
          dprob[t * T + j] = prob[t * T + j] * (dprob[t * T + j] - delta);  // now dS
      }
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t d = 0; d < Dqk; ++d) {
          double dq_sum = 0, dk_sum = 0;
          for (int64_t j = 0; j < T; ++j) {
            dq_sum += dprob[t * T + j] * k_at(j, d);  // dS[t, j] K[j]
            dk_sum += dprob[j * T + t] * q_at(j, d);  // dS[j, t] Q[j]
          }
          dq[((b * T + t) * H + h) * Dqk + d] += Real(scale * dq_sum);
          dk[((b * T + t) * H + h) * Dqk + d] += Real(scale * dk_sum);
        }
        for (int64_t d = 0; d < Dv; ++d) {
          double dv_sum = 0;
          for (int64_t j = 0; j < T; ++j) dv_sum += prob[j * T + t] * dout_at(j, d);
          dv[((b * T + t) * H + h) * Dv + d] += Real(dv_sum);
        }
      }
    }
}

template void attention_causal_backward<float>(const float*, const float*, const float*,
                                               const float*, const float*, const float*, float*,
                                               float*, float*, const AttnShape&, double, Arena&,
                                               int, const int32_t*);
template void attention_causal_backward<double>(const double*, const double*, const double*,
                                                const double*, const double*, const double*,
                                                double*, double*, double*, const AttnShape&,
                                                double, Arena&, int, const int32_t*);
template void attention_causal_reference_backward<float>(const float*, const float*,
                                                         const float*, const float*, float*,
                                                         float*, float*, const AttnShape&, double,
                                                         const int32_t*);
template void attention_causal_reference_backward<double>(const double*, const double*,
                                                          const double*, const double*, double*,
                                                          double*, double*, const AttnShape&,
                                                          double, const int32_t*);

}  // namespace dm
