// Causal softmax attention, CPU fp32 (SPEC §1.2, expanded MLA form for prefill/training).
//
// attention_causal_forward is a flash-style tiled softmax: for one (batch, head, query block)
// it walks the key blocks up to the diagonal, forms the [block, block] score tile with one GEMM,
// folds it into a running row max / row sum (online softmax) and accumulates P·V with a second
// GEMM. Memory is O(threads · block · (block + Dv)), never O(T²).
#include "ops/cpu/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/gemm.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace dm {

namespace {

// Per-thread scratch layout (floats). Every part is padded to 16 floats (64 bytes) so slices
// of different threads never share a cache line.
struct AttentionScratchLayout {
  int64_t block_rows = 0;      // effective block (≤ T)
  int64_t scores_floats = 0;   // [block_rows, block_rows] score / probability tile
  int64_t accum_floats = 0;    // [block_rows, Dv] unnormalised output accumulator
  int64_t rowstat_floats = 0;  // [block_rows] running max, and again for running sum
  int64_t slice_floats = 0;    // total per thread

  static int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

  AttentionScratchLayout(const AttnShape& s, int block) {
    block_rows = std::max<int64_t>(1, std::min<int64_t>(block, s.T));
    scores_floats = pad16(block_rows * block_rows);
    accum_floats = pad16(block_rows * s.Dv);
    rowstat_floats = pad16(block_rows);
    slice_floats = scores_floats + accum_floats + 2 * rowstat_floats;
  }
};

int current_thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

void check_attention_shape(const AttnShape& s) {
  DM_CHECK(s.B >= 0 && s.T >= 0 && s.H >= 0 && s.Dqk >= 0 && s.Dv >= 0,
           "attention: negative shape B=", s.B, " T=", s.T, " H=", s.H, " Dqk=", s.Dqk,
           " Dv=", s.Dv);
}

}  // namespace

size_t attention_causal_workspace_bytes(const AttnShape& s, int block) {
  DM_CHECK(block > 0, "attention: block must be positive, got ", block);
  check_attention_shape(s);
  const AttentionScratchLayout layout(s, block);
  const int64_t threads = std::max(1, num_threads());
  return Arena::round_up(size_t(threads * layout.slice_floats) * sizeof(float));
}

void attention_causal_forward(const float* q, const float* k, const float* v, float* o,
                              float* lse, const AttnShape& s, float scale, Arena& ws,
                              int block) {
  DM_CHECK(block > 0, "attention: block must be positive, got ", block);
  check_attention_shape(s);
  const int64_t B = s.B, T = s.T, H = s.H, Dqk = s.Dqk, Dv = s.Dv;
  if (B == 0 || T == 0 || H == 0) return;

  const AttentionScratchLayout layout(s, block);
  const int64_t block_rows = layout.block_rows;
  const int64_t num_query_blocks = (T + block_rows - 1) / block_rows;
  const int64_t num_batch_heads = B * H;
  const int64_t num_work_items = num_batch_heads * num_query_blocks;
  const int num_team_threads =
      int(std::max<int64_t>(1, std::min<int64_t>(std::max(1, num_threads()), num_work_items)));

  // Strides between consecutive tokens of one head in q/k ([B,T,H,Dqk]) and v/o ([B,T,H,Dv]).
  // (At least 1: cblas rejects a zero leading dimension even when the inner size is 0.)
  const int64_t qk_row_stride = std::max<int64_t>(1, H * Dqk);
  const int64_t vo_row_stride = std::max<int64_t>(1, H * Dv);

  ArenaScope scratch_scope(ws);
  float* all_thread_scratch = ws.alloc<float>(size_t(num_team_threads * layout.slice_floats));
  BlasSingleThreadScope blas_single_thread;

  constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

#pragma omp parallel num_threads(num_team_threads)
  {
    float* slice = all_thread_scratch + current_thread_index() * layout.slice_floats;
    float* score_tile = slice;                                        // [block_rows, block_rows]
    float* output_accumulator = score_tile + layout.scores_floats;    // [block_rows, Dv]
    float* running_max = output_accumulator + layout.accum_floats;    // [block_rows]
    float* running_sum = running_max + layout.rowstat_floats;         // [block_rows]

    // Causal cost grows with the query block index, so hand out the last (heaviest) query
    // blocks of every (b, h) first; dynamic scheduling then fills in with the light ones.
#pragma omp for schedule(dynamic, 1)
    for (int64_t work_item = 0; work_item < num_work_items; ++work_item) {
      const int64_t query_block = num_query_blocks - 1 - work_item / num_batch_heads;
      const int64_t batch_head = work_item % num_batch_heads;
      const int64_t b = batch_head / H, h = batch_head % H;

      const int64_t query_start = query_block * block_rows;
      const int64_t query_rows = std::min(block_rows, T - query_start);
      const float* q_tile = q + ((b * T + query_start) * H + h) * Dqk;  // rows strided H·Dqk

      std::fill(running_max, running_max + query_rows, kNegativeInfinity);
      std::fill(running_sum, running_sum + query_rows, 0.0f);
      std::fill(output_accumulator, output_accumulator + query_rows * Dv, 0.0f);

      for (int64_t key_block = 0; key_block <= query_block; ++key_block) {
        const int64_t key_start = key_block * block_rows;
        const int64_t key_rows = std::min(block_rows, T - key_start);
        const float* k_tile = k + ((b * T + key_start) * H + h) * Dqk;
        const float* v_tile = v + ((b * T + key_start) * H + h) * Dv;
        // Query and key blocks share the same grid, so only the diagonal tile is masked and
        // there query row i sees keys 0..i of the tile (at least one: no fully masked row).
        const bool is_diagonal_tile = key_block == query_block;

        // score_tile[i, j] = scale · q_i · k_j      [query_rows, key_rows], ld block_rows
        gemm(false, true, query_rows, key_rows, Dqk, scale, q_tile, qk_row_stride, k_tile,
             qk_row_stride, 0.0f, score_tile, block_rows);

        for (int64_t i = 0; i < query_rows; ++i) {
          float* score_row = score_tile + i * block_rows;
          const int64_t visible_keys = is_diagonal_tile ? i + 1 : key_rows;

          float tile_max = kNegativeInfinity;
          for (int64_t j = 0; j < visible_keys; ++j) tile_max = std::max(tile_max, score_row[j]);
          const float previous_max = running_max[i];
          const float new_max = std::max(previous_max, tile_max);
          // exp(-inf) = 0 on the first tile wipes the (zero) accumulator harmlessly.
          const float rescale_previous = std::exp(previous_max - new_max);

          float tile_sum = 0.0f;
          for (int64_t j = 0; j < visible_keys; ++j) {
            const float p = std::exp(score_row[j] - new_max);
            score_row[j] = p;
            tile_sum += p;
          }
          // Masked keys contribute nothing to P·V.
          for (int64_t j = visible_keys; j < key_rows; ++j) score_row[j] = 0.0f;

          running_sum[i] = running_sum[i] * rescale_previous + tile_sum;
          running_max[i] = new_max;
          if (rescale_previous != 1.0f) {
            float* accumulator_row = output_accumulator + i * Dv;
            for (int64_t d = 0; d < Dv; ++d) accumulator_row[d] *= rescale_previous;
          }
        }

        // output_accumulator[query_rows, Dv] += P[query_rows, key_rows] · V[key_rows, Dv]
        gemm(false, false, query_rows, Dv, key_rows, 1.0f, score_tile, block_rows, v_tile,
             vo_row_stride, 1.0f, output_accumulator, Dv);
      }

      for (int64_t i = 0; i < query_rows; ++i) {
        const int64_t t = query_start + i;
        float* output_row = o + ((b * T + t) * H + h) * Dv;
        const float inverse_sum = 1.0f / running_sum[i];
        const float* accumulator_row = output_accumulator + i * Dv;
        for (int64_t d = 0; d < Dv; ++d) output_row[d] = accumulator_row[d] * inverse_sum;
        if (lse) lse[(b * H + h) * T + t] = running_max[i] + std::log(running_sum[i]);
      }
    }
  }
}

void attention_causal_reference(const float* q, const float* k, const float* v, float* o,
                                const AttnShape& s, float scale) {
  check_attention_shape(s);
  const int64_t B = s.B, T = s.T, H = s.H, Dqk = s.Dqk, Dv = s.Dv;
  if (B == 0 || T == 0 || H == 0) return;

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
        const float* q_row = q + ((b * T + t) * H + h) * Dqk;
        double row_max = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= t; ++j) {
          const float* k_row = k + ((b * T + j) * H + h) * Dqk;
          double dot = 0.0;
          for (int64_t d = 0; d < Dqk; ++d) dot += double(q_row[d]) * double(k_row[d]);
          score_row[j] = double(scale) * dot;
          row_max = std::max(row_max, score_row[j]);
        }
        double row_sum = 0.0;
        std::fill(output_row.begin(), output_row.end(), 0.0);
        for (int64_t j = 0; j <= t; ++j) {
          const double p = std::exp(score_row[j] - row_max);
          row_sum += p;
          const float* v_row = v + ((b * T + j) * H + h) * Dv;
          for (int64_t d = 0; d < Dv; ++d) output_row[d] += p * double(v_row[d]);
        }
        float* o_row = o + ((b * T + t) * H + h) * Dv;
        for (int64_t d = 0; d < Dv; ++d) o_row[d] = float(output_row[d] / row_sum);
      }
    }
  }
}

}  // namespace dm
