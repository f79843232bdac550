// Causal softmax attention, CPU (SPEC §1.2, expanded MLA form for prefill/training): forward and
// the double reference. The backward lives in attention_backward.cpp.
//
// attention_causal_forward is a flash-style tiled softmax: for one (batch, head, query block)
// it walks the key blocks up to the diagonal, forms the [block, block] score tile with one GEMM,
// folds it into a running row max / row sum (online softmax) and accumulates P·V with a second
// GEMM. Memory is O(threads · block · (block + Dv)), never O(T²).
//
// Packed documents (doc_start): query t sees keys doc_start[t] ≤ j ≤ t. Key blocks that end
// before the smallest document start of the query block are skipped outright; inside a tile the
// keys outside [doc_start[t], t] get probability 0.
#include "ops/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/fastmath.h"
#include "core/gemm.h"
#include "core/threading.h"


namespace dm {

namespace {

// Per-thread scratch layout (in Reals). Every part is padded to 64 bytes so slices of different
// threads never share a cache line.
struct AttentionScratchLayout {
  int64_t block_rows = 0;      // effective block (≤ T)
  int64_t scores_reals = 0;    // [block_rows, block_rows] score / probability tile
  int64_t accum_reals = 0;     // [block_rows, Dv] unnormalised output accumulator
  int64_t rowstat_reals = 0;   // [block_rows] running max, and again for running sum
  int64_t slice_reals = 0;     // total per thread

  AttentionScratchLayout(const AttnShape& s, int block, size_t real_bytes) {
    const int64_t reals_per_line = int64_t(Arena::kAlign / real_bytes);
    auto pad = [&](int64_t n) { return (n + reals_per_line - 1) / reals_per_line * reals_per_line; };
    block_rows = std::max<int64_t>(1, std::min<int64_t>(block, s.T));
    scores_reals = pad(block_rows * block_rows);
    accum_reals = pad(block_rows * s.Dv);
    rowstat_reals = pad(block_rows);
    slice_reals = scores_reals + accum_reals + 2 * rowstat_reals;
  }
};

void check_attention_shape(const AttnShape& s) {
  DM_CHECK(s.B >= 0 && s.T >= 0 && s.H >= 0 && s.Dqk >= 0 && s.Dv >= 0,
           "attention: negative shape B=", s.B, " T=", s.T, " H=", s.H, " Dqk=", s.Dqk,
           " Dv=", s.Dv);
}

}  // namespace

void attention_check_doc_start(const int32_t* doc_start, int64_t B, int64_t T) {
  if (!doc_start) return;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t start = doc_start[b * T + t];
      DM_CHECK(start >= 0 && start <= t, "doc_start[", b, ", ", t, "] = ", start,
               " must lie in [0, ", t, "] (index of the token's document start within its row)");
    }
}

size_t attention_causal_workspace_bytes(const AttnShape& s, int block, size_t real_bytes) {
  DM_CHECK(block > 0, "attention: block must be positive, got ", block);
  DM_CHECK(real_bytes == 4 || real_bytes == 8, "attention: real_bytes must be 4 or 8, got ",
           real_bytes);
  check_attention_shape(s);
  const AttentionScratchLayout layout(s, block, real_bytes);
  const int64_t threads = std::max(1, num_threads());
  return Arena::round_up(size_t(threads * layout.slice_reals) * real_bytes);
}

template <typename Real>
void attention_causal_forward(const Real* q, const Real* k, const Real* v, Real* o,
                              std::type_identity_t<Real>* lse, const AttnShape& s, double scale,
                              Arena& ws, int block, const int32_t* doc_start) {
  DM_CHECK(block > 0, "attention: block must be positive, got ", block);
  check_attention_shape(s);
  const int64_t B = s.B, T = s.T, H = s.H, Dqk = s.Dqk, Dv = s.Dv;
  if (B == 0 || T == 0 || H == 0) return;
  attention_check_doc_start(doc_start, B, T);

  const AttentionScratchLayout layout(s, block, sizeof(Real));
  const int64_t block_rows = layout.block_rows;
  const int64_t num_query_blocks = (T + block_rows - 1) / block_rows;
  const int64_t num_batch_heads = B * H;
  const int64_t num_work_items = num_batch_heads * num_query_blocks;
  const int num_team_threads =
      int(std::max<int64_t>(1, std::min<int64_t>(std::max(1, num_threads()), num_work_items)));
  const Real scale_real = Real(scale);

  // Strides between consecutive tokens of one head in q/k ([B,T,H,Dqk]) and v/o ([B,T,H,Dv]).
  // (At least 1: cblas rejects a zero leading dimension even when the inner size is 0.)
  const int64_t qk_row_stride = std::max<int64_t>(1, H * Dqk);
  const int64_t vo_row_stride = std::max<int64_t>(1, H * Dv);

  ArenaScope scratch_scope(ws);
  Real* all_thread_scratch = ws.alloc<Real>(size_t(num_team_threads * layout.slice_reals));
  BlasSingleThreadScope blas_single_thread;

  constexpr Real kNegativeInfinity = -std::numeric_limits<Real>::infinity();

#pragma omp parallel num_threads(num_team_threads)
  {
    Real* slice = all_thread_scratch + thread_index() * layout.slice_reals;
    Real* score_tile = slice;                                        // [block_rows, block_rows]
    Real* output_accumulator = score_tile + layout.scores_reals;     // [block_rows, Dv]
    Real* running_max = output_accumulator + layout.accum_reals;     // [block_rows]
    Real* running_sum = running_max + layout.rowstat_reals;          // [block_rows]

    // Causal cost grows with the query block index, so hand out the last (heaviest) query
    // blocks of every (b, h) first; dynamic scheduling then fills in with the light ones.
#pragma omp for schedule(dynamic, 1)
    for (int64_t work_item = 0; work_item < num_work_items; ++work_item) {
      const int64_t query_block = num_query_blocks - 1 - work_item / num_batch_heads;
      const int64_t batch_head = work_item % num_batch_heads;
      const int64_t b = batch_head / H, h = batch_head % H;

      const int64_t query_start = query_block * block_rows;
      const int64_t query_rows = std::min(block_rows, T - query_start);
      const Real* q_tile = q + ((b * T + query_start) * H + h) * Dqk;  // rows strided H·Dqk
      const int32_t* row_doc_start = doc_start ? doc_start + b * T : nullptr;

      // Key blocks that end before every query row's document start contribute nothing.
      int64_t earliest_visible_key = query_start;
      if (row_doc_start)
        for (int64_t i = 0; i < query_rows; ++i)
          earliest_visible_key = std::min<int64_t>(earliest_visible_key,
                                                   row_doc_start[query_start + i]);
      else
        earliest_visible_key = 0;
      const int64_t first_key_block = earliest_visible_key / block_rows;

      std::fill(running_max, running_max + query_rows, kNegativeInfinity);
      std::fill(running_sum, running_sum + query_rows, Real(0));
      std::fill(output_accumulator, output_accumulator + query_rows * Dv, Real(0));

      for (int64_t key_block = first_key_block; key_block <= query_block; ++key_block) {
        const int64_t key_start = key_block * block_rows;
        const int64_t key_rows = std::min(block_rows, T - key_start);
        const Real* k_tile = k + ((b * T + key_start) * H + h) * Dqk;
        const Real* v_tile = v + ((b * T + key_start) * H + h) * Dv;

        // score_tile[i, j] = scale · q_i · k_j      [query_rows, key_rows], ld block_rows
        gemm(false, true, query_rows, key_rows, Dqk, scale_real, q_tile, qk_row_stride, k_tile,
             qk_row_stride, Real(0), score_tile, block_rows);

        for (int64_t i = 0; i < query_rows; ++i) {
          Real* score_row = score_tile + i * block_rows;
          const int64_t t = query_start + i;
          // Visible keys of this row inside the tile: [first_visible, end_visible).
          const int64_t end_visible = std::min(key_rows, t - key_start + 1);
          const int64_t first_visible =
              row_doc_start ? std::clamp<int64_t>(row_doc_start[t] - key_start, 0, key_rows) : 0;
          if (first_visible >= end_visible) {
            // Row sees nothing here (tile before its document or after the diagonal): no
            // statistics update, which would otherwise form exp(−inf − (−inf)) = NaN.
            std::fill(score_row, score_row + key_rows, Real(0));
            continue;
          }

          Real tile_max = kNegativeInfinity;
          for (int64_t j = first_visible; j < end_visible; ++j)
            tile_max = std::max(tile_max, score_row[j]);
          const Real previous_max = running_max[i];
          const Real new_max = std::max(previous_max, tile_max);
          // exp(-inf) = 0 on the first visible tile wipes the (zero) accumulator harmlessly.
          const Real rescale_previous = std::exp(previous_max - new_max);

          Real tile_sum = 0;
          // Masked keys contribute nothing to P·V.
          for (int64_t j = 0; j < first_visible; ++j) score_row[j] = Real(0);
#pragma omp simd reduction(+ : tile_sum)
          for (int64_t j = first_visible; j < end_visible; ++j) {
            const Real p = fast_exp_keep_nan(Real(score_row[j] - new_max));  // visible: finite
            score_row[j] = p;
            tile_sum += p;
          }
          for (int64_t j = end_visible; j < key_rows; ++j) score_row[j] = Real(0);

          running_sum[i] = running_sum[i] * rescale_previous + tile_sum;
          running_max[i] = new_max;
          if (rescale_previous != Real(1)) {
            Real* accumulator_row = output_accumulator + i * Dv;
            for (int64_t d = 0; d < Dv; ++d) accumulator_row[d] *= rescale_previous;
          }
        }

        // output_accumulator[query_rows, Dv] += P[query_rows, key_rows] · V[key_rows, Dv]
        gemm(false, false, query_rows, Dv, key_rows, Real(1), score_tile, block_rows, v_tile,
             vo_row_stride, Real(1), output_accumulator, Dv);
      }

      for (int64_t i = 0; i < query_rows; ++i) {
        const int64_t t = query_start + i;
        Real* output_row = o + ((b * T + t) * H + h) * Dv;
        const Real inverse_sum = Real(1) / running_sum[i];
        const Real* accumulator_row = output_accumulator + i * Dv;
        for (int64_t d = 0; d < Dv; ++d) output_row[d] = accumulator_row[d] * inverse_sum;
        if (lse) lse[(b * H + h) * T + t] = running_max[i] + std::log(running_sum[i]);
      }
    }
  }
}

template <typename Real>
void attention_causal_reference(const Real* q, const Real* k, const Real* v, Real* o,
                                const AttnShape& s, double scale, const int32_t* doc_start) {
  check_attention_shape(s);
  const int64_t B = s.B, T = s.T, H = s.H, Dqk = s.Dqk, Dv = s.Dv;
  if (B == 0 || T == 0 || H == 0) return;
  attention_check_doc_start(doc_start, B, T);

#pragma omp parallel
  {
    // Tests only: a full score row and the output row in double, so the reference is
    // accurate well beyond the fp32 kernel it checks.
    std::vector<double> score_row(static_cast<size_t>(T));
    std::vector<double> output_row(static_cast<size_t>(Dv));
#pragma omp for collapse(2) schedule(dynamic, 4)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t b = bh / H, h = bh % H;
        const int64_t first_key = doc_start ? doc_start[b * T + t] : 0;
        const Real* q_row = q + ((b * T + t) * H + h) * Dqk;
        double row_max = -std::numeric_limits<double>::infinity();
        for (int64_t j = first_key; j <= t; ++j) {
          const Real* k_row = k + ((b * T + j) * H + h) * Dqk;
          double dot = 0.0;
          for (int64_t d = 0; d < Dqk; ++d) dot += double(q_row[d]) * double(k_row[d]);
          score_row[j] = scale * dot;
          row_max = std::max(row_max, score_row[j]);
        }
        double row_sum = 0.0;
        std::fill(output_row.begin(), output_row.end(), 0.0);
        for (int64_t j = first_key; j <= t; ++j) {
          const double p = std::exp(score_row[j] - row_max);
          row_sum += p;
          const Real* v_row = v + ((b * T + j) * H + h) * Dv;
          for (int64_t d = 0; d < Dv; ++d) output_row[d] += p * double(v_row[d]);
        }
        Real* o_row = o + ((b * T + t) * H + h) * Dv;
        for (int64_t d = 0; d < Dv; ++d) o_row[d] = Real(output_row[d] / row_sum);
      }
    }
  }
}

template void attention_causal_forward<float>(const float*, const float*, const float*, float*,
                                              float*, const AttnShape&, double, Arena&, int,
                                              const int32_t*);
template void attention_causal_forward<double>(const double*, const double*, const double*,
                                               double*, double*, const AttnShape&, double, Arena&,
                                               int, const int32_t*);
template void attention_causal_reference<float>(const float*, const float*, const float*, float*,
                                                const AttnShape&, double, const int32_t*);
template void attention_causal_reference<double>(const double*, const double*, const double*,
                                                 double*, const AttnShape&, double,
                                                 const int32_t*);

}  // namespace dm
