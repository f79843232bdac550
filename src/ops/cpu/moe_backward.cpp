// Mixture-of-experts backward (CPU; float engine, double for finite-difference checks):
// router weights → logits with the selection fixed, and the grouped routed experts. SPEC §1.5.
// Conventions (docs/backward.md): every gradient is accumulated into, never overwritten.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/gemm.h"
#include "ops/cpu/moe.h"

namespace dm {
namespace {

// Below this many (token, expert) pairs the router backward is not worth a parallel region.
constexpr int64_t kRouteBackwardParallelMinPairs = 1 << 14;

// Elements of per-thread scratch for one backward tile: gathered x [T,Din], gathered dy [T,Din],
// g [T,F], u [T,F], h [T,F], dh (→ dg) [T,F], du [T,F]; whole cache lines per thread.
int64_t expert_backward_tile_scratch_elements(int64_t Din, int64_t F, size_t elem_bytes) {
  const int64_t elements = kMoeExpertTileRows * (2 * Din + 5 * F);
  const int64_t per_line = int64_t(Arena::kAlign / elem_bytes);
  return (elements + per_line - 1) / per_line * per_line;
}

}  // namespace

template <typename Real>
void moe_route_backward(const Real* scores, const int32_t* idx, const Real* dweights, int64_t N,
                        const RouterParams& p, Real* dlogits) {
  const int E = p.num_experts, k = p.top_k;
  DM_CHECK(E > 0 && k >= 1 && k <= E && N >= 0, "moe_route_backward: bad shape N=", N, " E=", E,
           " k=", k);
  const Real scaling = p.scaling;
  const bool parallel = N * E >= kRouteBackwardParallelMinPairs;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < N; ++t) {
    const Real* score_row = scores + t * E;
    const int32_t* idx_row = idx + t * k;
    const Real* dw_row = dweights + t * k;
    Real* dlogit_row = dlogits + t * E;
    // w_i = s_i·c with c = scaling / (S + ε), S = Σ_{r∈T} s_r (renormalised) or c = scaling:
    //   ∂w_i/∂s_j = δ_ij·c − s_i·scaling/(S + ε)²   (j ∈ T)
    //   ⇒ ds_j = c·(dw_j − Σ_i dw_i·s_i / (S + ε)).
    Real correction = 0;
    Real scale = scaling;
    if (p.renormalize) {
      Real score_sum = 0, weighted_sum = 0;
      for (int i = 0; i < k; ++i) {
        const Real s = score_row[idx_row[i]];
        score_sum += s;
        weighted_sum += dw_row[i] * s;
      }
      const Real denominator = score_sum + Real(1e-20);  // the forward's ε
      scale = scaling / denominator;
      correction = weighted_sum / denominator;
    }
    for (int i = 0; i < k; ++i) {
      const int32_t e = idx_row[i];
      const Real s = score_row[e];
      const Real dscore = scale * (dw_row[i] - correction);
      // s = σ(logit) ⇒ ds/dlogit = s·(1 − s).
      dlogit_row[e] += dscore * s * (Real(1) - s);
    }
  }
}

size_t moe_experts_backward_workspace_bytes(int64_t N, int k, const ExpertWeights& ew,
                                            int threads, size_t elem_bytes) {
  const size_t rows = size_t(std::max<int64_t>(N * k, 1));
  size_t bytes = 0;
  bytes += Arena::round_up(size_t(std::max<int64_t>(ew.E, 1)) * sizeof(int32_t));  // expert order
  bytes += Arena::round_up(rows * sizeof(int64_t));                 // sorted_row_of_pair
  bytes += Arena::round_up(rows * size_t(ew.Din) * elem_bytes);     // dx per sorted row
  bytes += Arena::round_up(rows * elem_bytes);                      // dweight per sorted row
  bytes += Arena::round_up(size_t(std::max(threads, 1)) *
                           size_t(expert_backward_tile_scratch_elements(ew.Din, ew.F, elem_bytes)) *
                           elem_bytes);
  return bytes;
}

template <typename Real>
void moe_experts_backward(const Real* x, const MoePlan& plan, const Real* w,
                          const ExpertWeightsT<Real>& ew, const GluActivation& act,
                          const std::type_identity_t<Real>* saved_gate,
                          const std::type_identity_t<Real>* saved_up, const Real* dy,
                          std::type_identity_t<Real>* dx, std::type_identity_t<Real>* dweights,
                          const ExpertGradsT<Real>& grads, Arena& ws) {
  moe_check_expert_args("moe_experts_backward", plan, ew.E, ew.Din, ew.F, saved_gate != nullptr,
                        saved_up != nullptr);
  const int64_t N = plan.N, Din = ew.Din, F = ew.F, E = ew.E;
  const int k = plan.k;
  const int64_t total_rows = N * k;
  if (N == 0) return;
  DM_CHECK(plan.offsets[E] == total_rows, "moe_experts_backward: plan covers ", plan.offsets[E],
           " rows, expected N·k = ", total_rows);
  ArenaScope scope(ws);

  // Work items are whole experts (not tiles): an expert's weight gradient then has exactly one
  // writer that adds its tiles in row order, which is race-free and bit-reproducible without a
  // per-tile dW buffer (E·3·F·Din extra memory). Largest experts first (LPT) for balance.
  int32_t* expert_order = ws.alloc<int32_t>(size_t(std::max<int64_t>(E, 1)));
  int64_t active_experts = 0;
  for (int64_t e = 0; e < E; ++e)
    if (plan.offsets[e + 1] > plan.offsets[e]) expert_order[active_experts++] = int32_t(e);
  std::stable_sort(expert_order, expert_order + active_experts, [&](int32_t a, int32_t b) {
    return plan.offsets[a + 1] - plan.offsets[a] > plan.offsets[b + 1] - plan.offsets[b];
  });

  int64_t* sorted_row_of_pair = ws.alloc<int64_t>(size_t(total_rows));
  for (int64_t r = 0; r < total_rows; ++r)
    sorted_row_of_pair[int64_t(plan.token[r]) * k + plan.slot[r]] = r;
  // Per sorted row: its contribution to dx of its token [N·k, Din] and its dweight [N·k]; summed
  // per token afterwards in slot order (deterministic, one writer per token).
  Real* dx_sorted = dx ? ws.alloc<Real>(size_t(total_rows) * size_t(Din)) : nullptr;
  Real* dweight_sorted = ws.alloc<Real>(size_t(total_rows));
  const int threads = std::max(1, num_threads());
  const int64_t scratch_elements = expert_backward_tile_scratch_elements(Din, F, sizeof(Real));
  Real* thread_scratch = ws.alloc<Real>(size_t(threads) * size_t(scratch_elements));

  {
    // Same trade-off as the forward: expert-parallel with single-threaded BLAS once the experts
    // can keep about half the threads busy, else experts in sequence with threaded BLAS.
    const bool expert_parallel = threads > 1 && 2 * active_experts >= threads;
    BlasSingleThreadScope blas_single_thread(expert_parallel);
#pragma omp parallel num_threads(threads) if (expert_parallel)
    {
      const int thread_id = thread_index();
      const int64_t T = kMoeExpertTileRows;
      Real* x_gathered = thread_scratch + int64_t(thread_id) * scratch_elements;  // [T,Din]
      Real* dy_gathered = x_gathered + T * Din;                                  // [T,Din]
      Real* gate_buf = dy_gathered + T * Din;                                    // [T,F]
      Real* up_buf = gate_buf + T * F;                                           // [T,F]
      Real* h = up_buf + T * F;                                                  // [T,F]
      Real* dh = h + T * F;                                                      // [T,F] → dg
      Real* du = dh + T * F;                                                     // [T,F]
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < active_experts; ++item) {
        const int64_t e = expert_order[item];
        const Real* w_gate = ew.gate + e * F * Din;  // [F,Din]
        const Real* w_up = ew.up + e * F * Din;      // [F,Din]
        const Real* w_down = ew.down + e * Din * F;  // [Din,F]
        for (int64_t row_begin = plan.offsets[e]; row_begin < plan.offsets[e + 1];
             row_begin += T) {
          const int64_t rows = std::min(T, plan.offsets[e + 1] - row_begin);
          for (int64_t i = 0; i < rows; ++i) {
            const int64_t token = plan.token[row_begin + i];
            std::memcpy(x_gathered + i * Din, x + token * Din, size_t(Din) * sizeof(Real));
            std::memcpy(dy_gathered + i * Din, dy + token * Din, size_t(Din) * sizeof(Real));
          }
          const Real* gate = saved_gate ? saved_gate + row_begin * F : gate_buf;  // [rows,F]
          const Real* up = saved_up ? saved_up + row_begin * F : up_buf;          // [rows,F]
          if (!saved_gate) {
            gemm(false, true, rows, F, Din, Real(1), x_gathered, Din, w_gate, Din, Real(0),
                 gate_buf, F);
            gemm(false, true, rows, F, Din, Real(1), x_gathered, Din, w_up, Din, Real(0), up_buf,
                 F);
          }
          glu_forward(gate, up, h, rows * F, act);
          // Unweighted dh₀ = dy·W_down [rows,F]. Since E_j(x) = W_down·h, the weight gradient
          // dy·E_j(x) = dh₀·h: a row dot product instead of a second down GEMM.
          gemm(false, false, rows, F, Din, Real(1), dy_gathered, Din, w_down, F, Real(0), dh, F);
          for (int64_t i = 0; i < rows; ++i) {
            const int64_t r = row_begin + i;
            const Real weight = w[int64_t(plan.token[r]) * k + plan.slot[r]];
            Real* dh_row = dh + i * F;
            const Real* h_row = h + i * F;
            Real dot = 0;
            for (int64_t f = 0; f < F; ++f) dot += dh_row[f] * h_row[f];
            dweight_sorted[r] = dot;
            // The expert's output enters y scaled by its routing weight: the rest of the chain
            // sees weight·dy. Scaling the gathered dy row covers both dh and dW_down.
            for (int64_t f = 0; f < F; ++f) dh_row[f] *= weight;
            Real* dy_row = dy_gathered + i * Din;
            for (int64_t c = 0; c < Din; ++c) dy_row[c] *= weight;
          }
          // dW_down[Din,F] += (weight·dy)ᵀ[Din,rows] · h[rows,F]
          if (grads.down)
            gemm(true, false, Din, F, rows, Real(1), dy_gathered, Din, h, F, Real(1),
                 grads.down + e * Din * F, F);
          glu_backward(gate, up, dh, /*dg=*/dh, du, rows * F, act);
          const Real* dg = dh;
          // dW_gate[F,Din] += dgᵀ[F,rows]·x[rows,Din]; dW_up likewise with du.
          if (grads.gate)
            gemm(true, false, F, Din, rows, Real(1), dg, F, x_gathered, Din, Real(1),
                 grads.gate + e * F * Din, Din);
          if (grads.up)
            gemm(true, false, F, Din, rows, Real(1), du, F, x_gathered, Din, Real(1),
                 grads.up + e * F * Din, Din);
          // dx rows [rows,Din] = dg·W_gate + du·W_up, written to the rows' own sorted place.
          if (dx_sorted) {
            Real* dx_rows = dx_sorted + row_begin * Din;
            gemm(false, false, rows, Din, F, Real(1), dg, F, w_gate, Din, Real(0), dx_rows, Din);
            gemm(false, false, rows, Din, F, Real(1), du, F, w_up, Din, Real(1), dx_rows, Din);
          }
        }
      }
    }
  }

  // Per-token sums in slot order: one writer per token, order independent of the schedule.
#pragma omp parallel for schedule(static) if (N * k * Din >= (1 << 15))
  for (int64_t t = 0; t < N; ++t) {
    for (int s = 0; s < k; ++s) {
      const int64_t r = sorted_row_of_pair[t * k + s];
      if (dweights) dweights[t * k + s] += dweight_sorted[r];
      if (dx_sorted) {
        Real* dx_row = dx + t * Din;
        const Real* src = dx_sorted + r * Din;
        for (int64_t c = 0; c < Din; ++c) dx_row[c] += src[c];
      }
    }
  }
}

#define DM_MOE_BACKWARD_INSTANTIATE(Real)                                                       \
  template void moe_route_backward<Real>(const Real*, const int32_t*, const Real*, int64_t,     \
                                         const RouterParams&, Real*);                           \
  template void moe_experts_backward<Real>(const Real*, const MoePlan&, const Real*,            \
                                           const ExpertWeightsT<Real>&, const GluActivation&,   \
                                           const Real*, const Real*, const Real*, Real*, Real*, \
                                           const ExpertGradsT<Real>&, Arena&);
DM_MOE_BACKWARD_INSTANTIATE(float)
DM_MOE_BACKWARD_INSTANTIATE(double)
#undef DM_MOE_BACKWARD_INSTANTIATE

}  // namespace dm
