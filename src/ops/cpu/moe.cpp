// Mixture-of-experts forward (CPU; float engine, double for reference checks): sigmoid router with
// DeepSeek expert groups and QB cutoffs, token→expert dispatch plan, grouped expert compute.
// SPEC §1.5, §1.6. The backward lives in moe_backward.cpp.
#include "ops/cpu/moe.h"

#include "core/fastmath.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/gemm.h"

namespace dm {
namespace {

// Routing a token is O(E·k); below this many (token, expert) pairs a parallel region is overhead.
constexpr int64_t kRouteParallelMinPairs = 1 << 14;

template <typename Real>
inline Real router_sigmoid(Real x) {
  return sigmoid(x);  // core/fastmath.h
}

// Descending list of the best `capacity` (value, expert) pairs seen so far. Experts are offered
// in ascending index order and an equal value never displaces an earlier one, so ties go to the
// lower expert index (deterministic, unlike torch.topk).
template <typename Real>
struct TopList {
  Real value[kMoeRouteMaxTopK + 1];
  int32_t expert[kMoeRouteMaxTopK + 1];
  int count = 0;
  int capacity = 0;

  void offer(Real v, int32_t e) {
    if (count == capacity && !(v > value[count - 1])) return;
    int pos = count < capacity ? count++ : capacity - 1;
    while (pos > 0 && value[pos - 1] < v) {
      value[pos] = value[pos - 1];
      expert[pos] = expert[pos - 1];
      --pos;
    }
    value[pos] = v;
    expert[pos] = e;
  }
};

void check_router_params(const RouterParams& p) {
  const int E = p.num_experts, k = p.top_k;
  DM_CHECK(E > 0, "moe_route: num_experts must be > 0, got ", E);
  DM_CHECK(k >= 1 && k <= E, "moe_route: top_k must be in [1, num_experts=", E, "], got ", k);
  DM_CHECK(k <= kMoeRouteMaxTopK, "moe_route: top_k ", k, " exceeds the supported maximum ",
           kMoeRouteMaxTopK);
  DM_CHECK(p.n_group >= 1, "moe_route: n_group must be >= 1, got ", p.n_group);
  if (p.n_group > 1) {
    DM_CHECK(p.n_group <= kMoeRouteMaxGroups, "moe_route: n_group ", p.n_group,
             " exceeds the supported maximum ", kMoeRouteMaxGroups);
    DM_CHECK(E % p.n_group == 0, "moe_route: num_experts ", E, " not divisible by n_group ",
             p.n_group);
    DM_CHECK(p.topk_group >= 1 && p.topk_group <= p.n_group,
             "moe_route: topk_group must be in [1, ", p.n_group, "], got ", p.topk_group);
    DM_CHECK(int64_t(p.topk_group) * (E / p.n_group) >= k, "moe_route: topk_group ", p.topk_group,
             " groups of ", E / p.n_group, " experts cannot supply top_k ", k);
  }
}

// Routes one token: writes its scores [E], idx [k], w [k] and (optionally) its cutoff.
template <typename Real>
void route_one_token(const Real* logit_row, const Real* bias, const RouterParams& p,
                     Real* score_row, int32_t* idx_row, Real* w_row, Real* cutoff_out) {
  const int E = p.num_experts, k = p.top_k;
  for (int e = 0; e < E; ++e) score_row[e] = router_sigmoid(logit_row[e]);
  // s + b is recomputed where needed instead of stored: no per-token scratch row.
  auto biased = [&](int e) { return score_row[e] + (bias ? bias[e] : Real(0)); };

  // Group selection (DeepSeek-V3): a group scores the sum of its two best biased values; the
  // topk_group best groups stay eligible. group_eligible[g] == 1 ⇔ group g kept.
  uint8_t group_eligible[kMoeRouteMaxGroups];
  const bool grouped = p.n_group > 1 && p.topk_group < p.n_group;
  const int group_size = E / p.n_group;
  if (grouped) {
    TopList<Real> best_groups;
    best_groups.capacity = p.topk_group;
    for (int g = 0; g < p.n_group; ++g) {
      Real first = -std::numeric_limits<Real>::infinity(), second = first;
      for (int e = g * group_size; e < (g + 1) * group_size; ++e) {
        const Real v = biased(e);
        if (v > first) {
          second = first;
          first = v;
        } else if (v > second) {
          second = v;
        }
      }
      // A one-expert group has no second value; it then scores its single value.
      const Real group_score = group_size >= 2 ? first + second : first;
      best_groups.offer(group_score, g);
      group_eligible[g] = 0;
    }
    for (int i = 0; i < best_groups.count; ++i) group_eligible[best_groups.expert[i]] = 1;
  }

  // Top-(k+1) over eligible experts: the first k are the selection, the (k+1)-th is the QB cutoff.
  // Experts of dropped groups are simply not offered, i.e. not selectable. NOTE: the HF
  // DeepSeek-V3 / Kimi reference instead masked_fill's them with 0.0 and runs topk over all E, so
  // with negative biased scores it could pick a dropped-group expert (a 0.0 beats a negative);
  // we treat that as an artefact of the reference, not as intended semantics.
  TopList<Real> best;
  best.capacity = k + 1;
  for (int e = 0; e < E; ++e) {
    if (grouped && !group_eligible[e / group_size]) continue;
    best.offer(biased(e), e);
  }
  if (cutoff_out)
    *cutoff_out = best.count == k + 1 ? best.value[k] : -std::numeric_limits<Real>::infinity();

  // Output in ascending expert order (insertion sort of k ≤ 63 ids).
  for (int i = 0; i < k; ++i) {
    const int32_t e = best.expert[i];
    int pos = i;
    while (pos > 0 && idx_row[pos - 1] > e) {
      idx_row[pos] = idx_row[pos - 1];
      --pos;
    }
    idx_row[pos] = e;
  }
  // Weights come from the unbiased scores: the bias steers selection only (SPEC §1.5/§1.6).
  Real score_sum = 0;
  for (int i = 0; i < k; ++i) score_sum += score_row[idx_row[i]];
  const Real scaling = p.scaling;
  const Real scale = p.renormalize ? scaling / (score_sum + Real(1e-20)) : scaling;
  for (int i = 0; i < k; ++i) w_row[i] = score_row[idx_row[i]] * scale;
}

// y[rows,out] = x[rows,in]·W[out,in]ᵀ. A one-row tile (common in decode) is a matrix-vector
// product; OpenBLAS 0.3.21's sgemm does not forward M = 1 to its faster gemv kernels itself.
inline void expert_linear(float* y, const float* x, const float* W, int64_t rows, int64_t in,
                          int64_t out) {
  if (rows == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, int(out), int(in), 1.0f, W, int(in), x, 1, 0.0f, y, 1);
    return;
  }
  linear(y, x, W, rows, in, out);
}
inline void expert_linear(double* y, const double* x, const double* W, int64_t rows, int64_t in,
                          int64_t out) {
  if (rows == 1) {
    cblas_dgemv(CblasRowMajor, CblasNoTrans, int(out), int(in), 1.0, W, int(in), x, 1, 0.0, y, 1);
    return;
  }
  gemm(false, true, rows, out, in, 1.0, x, in, W, in, 0.0, y, out);
}

// Elements of per-thread scratch for one tile: gathered x [T,Din], gate/h [T,F], up [T,F];
// rounded to whole cache lines so neighbouring threads' slices never share one.
int64_t expert_tile_scratch_elements(int64_t Din, int64_t F, size_t elem_bytes) {
  const int64_t elements = kMoeExpertTileRows * (Din + 2 * F);
  const int64_t per_line = int64_t(Arena::kAlign / elem_bytes);
  return (elements + per_line - 1) / per_line * per_line;
}

}  // namespace

template <typename Real>
void moe_route(const Real* logits, const std::type_identity_t<Real>* bias, int64_t N,
               const RouterParams& p, Real* scores, int32_t* idx, Real* w,
               std::type_identity_t<Real>* cutoff) {
  check_router_params(p);
  DM_CHECK(N >= 0, "moe_route: negative token count ", N);
  const int E = p.num_experts, k = p.top_k;
  const bool parallel = N * E >= kRouteParallelMinPairs;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < N; ++t) {
    route_one_token(logits + t * E, bias, p, scores + t * E, idx + t * k, w + t * k,
                    cutoff ? cutoff + t : nullptr);
  }
}

void moe_plan_build(const int32_t* idx, int64_t N, int k, int E, MoePlan* plan, Arena& a) {
  DM_CHECK(N >= 0 && k >= 1 && E >= 1, "moe_plan_build: bad shape N=", N, " k=", k, " E=", E);
  DM_CHECK(N * k <= int64_t(std::numeric_limits<int32_t>::max()), "moe_plan_build: N·k = ", N * k,
           " rows exceed int32 token ids");
  const int64_t total_rows = N * k;
  plan->N = N;
  plan->k = k;
  plan->E = E;
  plan->offsets = a.alloc<int64_t>(size_t(E) + 1);
  plan->token = a.alloc<int32_t>(size_t(std::max<int64_t>(total_rows, 1)));
  plan->slot = a.alloc<int32_t>(size_t(std::max<int64_t>(total_rows, 1)));
  int64_t* offsets = plan->offsets;

  // Counting sort by expert, stable in (token, slot) order. offsets[e+1] first holds the count of
  // expert e; after the prefix sum offsets[e] is e's first row and is used as the write cursor,
  // which leaves offsets[e] = end of e = start of e+1; one shift right restores the starts.
  std::fill(offsets, offsets + E + 1, int64_t(0));
  for (int64_t r = 0; r < total_rows; ++r) {
    const int32_t e = idx[r];
    DM_CHECK(e >= 0 && e < E, "moe_plan_build: expert id ", e, " of token ", r / k, " slot ", r % k,
             " outside [0, ", E, ")");
    ++offsets[e + 1];
  }
  for (int e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  for (int64_t t = 0; t < N; ++t) {
    for (int s = 0; s < k; ++s) {
      const int64_t row = offsets[idx[t * k + s]]++;
      plan->token[row] = int32_t(t);
      plan->slot[row] = s;
    }
  }
  for (int e = E; e > 0; --e) offsets[e] = offsets[e - 1];
  offsets[0] = 0;
}

size_t moe_plan_bytes(int64_t N, int k, int E) {
  const size_t rows = size_t(std::max<int64_t>(N * k, 1));
  return Arena::round_up((size_t(E) + 1) * sizeof(int64_t)) +
         2 * Arena::round_up(rows * sizeof(int32_t));
}

void moe_check_expert_args(const char* who, const MoePlan& plan, int64_t E, int64_t Din, int64_t F,
                           bool has_saved_gate, bool has_saved_up) {
  DM_CHECK(plan.E == E, who, ": plan has ", plan.E, " experts, weights have ", E);
  DM_CHECK(Din > 0 && F > 0, who, ": bad expert shape Din=", Din, " F=", F);
  DM_CHECK(has_saved_gate == has_saved_up, who, ": saved_gate and saved_up go together");
}

size_t moe_experts_forward_workspace_bytes(int64_t N, int k, const ExpertWeights& ew, int threads,
                                           size_t elem_bytes) {
  const int64_t total_rows = N * k;
  // Σ_e ⌈n_e/T⌉ ≤ Σ_e (n_e/T + 1) over non-empty experts.
  const int64_t max_tiles = total_rows / kMoeExpertTileRows + std::min<int64_t>(ew.E, total_rows);
  size_t bytes = 0;
  bytes += Arena::round_up(size_t(std::max<int64_t>(max_tiles, 1)) * sizeof(int32_t));  // expert
  bytes += Arena::round_up(size_t(std::max<int64_t>(max_tiles, 1)) * sizeof(int64_t));  // begin
  bytes += Arena::round_up(size_t(std::max<int64_t>(total_rows, 1)) * sizeof(int64_t));
  bytes += Arena::round_up(size_t(std::max<int64_t>(total_rows, 1)) * size_t(ew.Din) * elem_bytes);
  bytes += Arena::round_up(size_t(std::max(threads, 1)) *
                           size_t(expert_tile_scratch_elements(ew.Din, ew.F, elem_bytes)) *
                           elem_bytes);
  return bytes;
}

template <typename Real>
void moe_experts_forward(const Real* x, const MoePlan& plan, const Real* w,
                         const ExpertWeightsT<Real>& ew, const GluActivation& act, Real* y,
                         Arena& ws, std::type_identity_t<Real>* saved_gate,
                         std::type_identity_t<Real>* saved_up) {
  moe_check_expert_args("moe_experts_forward", plan, ew.E, ew.Din, ew.F, saved_gate != nullptr,
                        saved_up != nullptr);
  const int64_t N = plan.N, Din = ew.Din, F = ew.F, E = ew.E;
  const int k = plan.k;
  const int64_t total_rows = N * k;
  if (N == 0) return;
  ArenaScope scope(ws);

  // Work items: tiles of ≤ kMoeExpertTileRows sorted rows of one expert. Experts with zero rows
  // contribute no item (and no GEMM); a big expert splits so the dynamic schedule can balance.
  int64_t num_tiles = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = plan.offsets[e + 1] - plan.offsets[e];
    num_tiles += (rows + kMoeExpertTileRows - 1) / kMoeExpertTileRows;
  }
  DM_CHECK(plan.offsets[E] == total_rows, "moe_experts_forward: plan covers ", plan.offsets[E],
           " rows, expected N·k = ", total_rows);
  int32_t* tile_expert = ws.alloc<int32_t>(size_t(std::max<int64_t>(num_tiles, 1)));
  int64_t* tile_row_begin = ws.alloc<int64_t>(size_t(std::max<int64_t>(num_tiles, 1)));
  {
    int64_t tile = 0;
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = plan.offsets[e]; r < plan.offsets[e + 1]; r += kMoeExpertTileRows) {
        tile_expert[tile] = int32_t(e);
        tile_row_begin[tile] = r;
        ++tile;
      }
    }
  }
  // sorted_row_of_pair[t·k + s]: where (token t, slot s) sits in the expert-sorted order.
  int64_t* sorted_row_of_pair = ws.alloc<int64_t>(size_t(total_rows));
  // expert_out[r, :] = E_{expert(r)}(x[token(r)]) for each sorted row r, unweighted. [N·k, Din]
  Real* expert_out = ws.alloc<Real>(size_t(total_rows) * size_t(Din));
  const int threads = std::max(1, num_threads());
  const int64_t scratch_elements = expert_tile_scratch_elements(Din, F, sizeof(Real));
  Real* thread_scratch = ws.alloc<Real>(size_t(threads) * size_t(scratch_elements));

  for (int64_t r = 0; r < total_rows; ++r)
    sorted_row_of_pair[int64_t(plan.token[r]) * k + plan.slot[r]] = r;

  {
    // Expert-parallel (one single-threaded GEMM chain per tile) pays off once the tiles can keep
    // about half the threads busy; with fewer (decode: N·k single-row tiles) the tiles run one
    // after the other and BLAS threads each product instead. Measured on 16 cores, E=64, k=6,
    // Din=1024, F=512: N=1 (6 tiles) 0.83 ms sequential vs 1.14 ms parallel; N=2 (≤12 tiles)
    // 2.4 ms vs 1.5 ms; N=512 93 ms vs 38 ms.
    const bool expert_parallel = threads > 1 && 2 * num_tiles >= threads;
    BlasSingleThreadScope blas_single_thread(expert_parallel);
#pragma omp parallel num_threads(threads) if (expert_parallel)
    {
      const int thread_id = thread_index();
      Real* gathered = thread_scratch + int64_t(thread_id) * scratch_elements;  // [T,Din]
      Real* gate = gathered + kMoeExpertTileRows * Din;                         // [T,F] → h
      Real* up = gate + kMoeExpertTileRows * F;                                 // [T,F]
#pragma omp for schedule(dynamic, 1)
      for (int64_t tile = 0; tile < num_tiles; ++tile) {
        const int64_t e = tile_expert[tile];
        const int64_t row_begin = tile_row_begin[tile];
        const int64_t rows = std::min(kMoeExpertTileRows, plan.offsets[e + 1] - row_begin);
        for (int64_t i = 0; i < rows; ++i)
          std::memcpy(gathered + i * Din, x + int64_t(plan.token[row_begin + i]) * Din,
                      size_t(Din) * sizeof(Real));
        if (saved_gate) {
          // Training: keep g/u (sorted-row order) for the backward; h goes to the scratch.
          Real* gate_kept = saved_gate + row_begin * F;
          Real* up_kept = saved_up + row_begin * F;
          expert_linear(gate_kept, gathered, ew.gate + e * F * Din, rows, Din, F);
          expert_linear(up_kept, gathered, ew.up + e * F * Din, rows, Din, F);
          glu_forward(gate_kept, up_kept, gate, rows * F, act);
        } else {
          expert_linear(gate, gathered, ew.gate + e * F * Din, rows, Din, F);
          expert_linear(up, gathered, ew.up + e * F * Din, rows, Din, F);
          glu_forward(gate, up, gate, rows * F, act);
        }
        // The tile's sorted rows are contiguous, so the down GEMM writes its final place.
        expert_linear(expert_out + row_begin * Din, gate, ew.down + e * Din * F, rows, F, Din);
      }
    }
  }

  // Combine per token in slot order: each y row has one writer (race-free) and the summation
  // order is fixed (no dependence on which thread ran which tile).
#pragma omp parallel for schedule(static) if (N * k * Din >= (1 << 15))
  for (int64_t t = 0; t < N; ++t) {
    Real* y_row = y + t * Din;
    {
      const Real weight = w[t * k];
      const Real* src = expert_out + sorted_row_of_pair[t * k] * Din;
      for (int64_t d = 0; d < Din; ++d) y_row[d] = weight * src[d];
    }
    for (int s = 1; s < k; ++s) {
      const Real weight = w[t * k + s];
      const Real* src = expert_out + sorted_row_of_pair[t * k + s] * Din;
      for (int64_t d = 0; d < Din; ++d) y_row[d] += weight * src[d];
    }
  }
}

void moe_experts_reference(const float* x, const int32_t* idx, const float* w, int64_t N, int k,
                           const ExpertWeights& ew, const GluActivation& act, float* y) {
  const int64_t Din = ew.Din, F = ew.F;
  std::vector<double> h(static_cast<size_t>(F)), y_acc(static_cast<size_t>(Din));
  for (int64_t t = 0; t < N; ++t) {
    const float* x_row = x + t * Din;
    std::fill(y_acc.begin(), y_acc.end(), 0.0);
    for (int s = 0; s < k; ++s) {
      const int64_t e = idx[t * k + s];
      DM_CHECK(e >= 0 && e < ew.E, "moe_experts_reference: expert id ", e, " out of range");
      const float* gate_w = ew.gate + e * F * Din;  // [F,Din]
      const float* up_w = ew.up + e * F * Din;      // [F,Din]
      const float* down_w = ew.down + e * Din * F;  // [Din,F]
      for (int64_t f = 0; f < F; ++f) {
        double g = 0, u = 0;
        for (int64_t d = 0; d < Din; ++d) {
          g += double(gate_w[f * Din + d]) * double(x_row[d]);
          u += double(up_w[f * Din + d]) * double(x_row[d]);
        }
        h[f] = glu_reference(g, u, act);
      }
      const double weight = w[t * k + s];
      for (int64_t d = 0; d < Din; ++d) {
        double acc = 0;
        for (int64_t f = 0; f < F; ++f) acc += double(down_w[d * F + f]) * h[f];
        y_acc[d] += weight * acc;
      }
    }
    for (int64_t d = 0; d < Din; ++d) y[t * Din + d] = float(y_acc[d]);
  }
}

#define DM_MOE_FORWARD_INSTANTIATE(Real)                                                      \
  template void moe_route<Real>(const Real*, const Real*, int64_t, const RouterParams&, Real*, \
                                int32_t*, Real*, Real*);                                      \
  template void moe_experts_forward<Real>(const Real*, const MoePlan&, const Real*,           \
                                          const ExpertWeightsT<Real>&, const GluActivation&,  \
                                          Real*, Arena&, Real*, Real*);
DM_MOE_FORWARD_INSTANTIATE(float)
DM_MOE_FORWARD_INSTANTIATE(double)
#undef DM_MOE_FORWARD_INSTANTIATE

}  // namespace dm
