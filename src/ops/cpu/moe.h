// Mixture-of-experts routing and grouped expert compute (CPU, fp32). SPEC §1.5, §1.6.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/arena.h"
#include "ops/cpu/ffn.h"

namespace dm {

struct RouterParams {
  int num_experts = 0, top_k = 0;
  int n_group = 1, topk_group = 1;  // DeepSeek groups: a group scores the sum of its top-2 biased scores
  bool renormalize = true;
  float scaling = 1.0f;
};

// logits [N,E] (router GEMM output) → s = sigmoid(logits) (written to scores [N,E]);
// selection = top_k of (s + bias) within the topk_group best groups; weights p_j = s_j /
// Σ_{r∈T} s_r (if renormalize; +1e-20 in the denominator) × scaling.
//   idx [N,k] sorted by expert id ascending, w [N,k] in the same order.
//   cutoff (optional) [N]: the (k+1)-th largest biased score of the token among the experts
//   eligible after group selection (QB, SPEC §1.6); -inf when fewer than k+1 are eligible.
//   Experts of dropped groups are not selectable at all (the HF reference fills them with 0.0,
//   which differs only when kept biased scores are negative; see moe.cpp). Ties → lower index.
//   bias may be nullptr (all zero). Limits: top_k ≤ kMoeRouteMaxTopK, n_group ≤ kMoeRouteMaxGroups.
void moe_route(const float* logits, const float* bias, int64_t N, const RouterParams& p,
               float* scores, int32_t* idx, float* w, float* cutoff);
inline constexpr int kMoeRouteMaxTopK = 63;     // top-(k+1) buffer lives on the stack
inline constexpr int kMoeRouteMaxGroups = 256;

// Token→expert dispatch plan: the N·k (token, slot) pairs sorted by expert.
//   offsets[E+1]: rows of expert e are [offsets[e], offsets[e+1]) in the sorted order;
//   token[N·k], slot[N·k]: which token / which of its k slots each sorted row came from.
struct MoePlan {
  int64_t N = 0;
  int k = 0, E = 0;
  int64_t* offsets = nullptr;
  int32_t* token = nullptr;
  int32_t* slot = nullptr;
};
// Allocates the plan's arrays from `a` (persistent for as long as the caller keeps them).
void moe_plan_build(const int32_t* idx, int64_t N, int k, int E, MoePlan* plan, Arena& a);

// Expert weights stacked per expert: gate, up [E, F, Din]; down [E, Din, F].
struct ExpertWeights {
  const float* gate = nullptr;
  const float* up = nullptr;
  const float* down = nullptr;
  int64_t E = 0, Din = 0, F = 0;
};

// y[N,Din] = Σ_{j∈T(t)} w[t,slot] · E_j(x[t]) (y is overwritten). Grouped: rows gathered per
// expert, three GEMMs per expert with ≥1 row, scatter-add; no dense masked product.
//   x [N,Din], w [N,k] (slot order of the plan's idx), y [N,Din].
void moe_experts_forward(const float* x, const MoePlan& plan, const float* w,
                         const ExpertWeights& ew, const GluActivation& act, float* y, Arena& ws);
// Upper bound of the scratch moe_experts_forward takes from ws (released before it returns) when
// run with `threads` OpenMP threads (num_threads() at the call). Independent of the routing.
size_t moe_experts_forward_workspace_bytes(int64_t N, int k, const ExpertWeights& ew, int threads);
// Rows per GEMM tile of one expert: bounds per-thread scratch and load-balances big experts.
inline constexpr int64_t kMoeExpertTileRows = 256;

// Naive per-token loop (tests): same result as moe_experts_forward.
void moe_experts_reference(const float* x, const int32_t* idx, const float* w, int64_t N, int k,
                           const ExpertWeights& ew, const GluActivation& act, float* y);

}  // namespace dm
