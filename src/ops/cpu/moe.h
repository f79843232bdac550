// Mixture-of-experts routing and grouped expert compute (CPU). SPEC §1.5, §1.6.
// Templated on the scalar (float engine, double for finite-difference checks; docs/backward.md),
// explicitly instantiated for both. Forward in moe.cpp, backward in moe_backward.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>

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
//   bias may be nullptr (all zero); cutoff may be nullptr.
//   Limits: top_k ≤ kMoeRouteMaxTopK, n_group ≤ kMoeRouteMaxGroups.
template <typename Real>
void moe_route(const Real* logits, const std::type_identity_t<Real>* bias, int64_t N,
               const RouterParams& p, Real* scores, int32_t* idx, Real* w,
               std::type_identity_t<Real>* cutoff);
inline constexpr int kMoeRouteMaxTopK = 63;     // top-(k+1) buffer lives on the stack
inline constexpr int kMoeRouteMaxGroups = 256;

// Gradient of the routing weights w.r.t. the router logits with the selection idx held fixed
// (selection is piecewise constant, so this is the exact gradient almost everywhere). Goes
// through the scaling, the renormalisation over the selected experts and the sigmoid; the
// balancing bias only steers selection and gets no gradient. Accumulates:
//   dlogits[t,e] += Σ_slot dweights[t,slot]·∂w[t,slot]/∂logit[t,e]   (non-zero only for e ∈ T(t))
//   scores [N,E] and idx [N,k] as moe_route wrote them; dweights [N,k]; dlogits [N,E].
template <typename Real>
void moe_route_backward(const Real* scores, const int32_t* idx, const Real* dweights, int64_t N,
                        const RouterParams& p, Real* dlogits);

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
// Bytes moe_plan_build takes from its arena.
size_t moe_plan_bytes(int64_t N, int k, int E);
// Argument checks shared by the grouped expert forward and backward; `who` names the caller.
void moe_check_expert_args(const char* who, const MoePlan& plan, int64_t E, int64_t Din, int64_t F,
                           bool has_saved_gate, bool has_saved_up);

// Expert weights stacked per expert: gate, up [E, F, Din]; down [E, Din, F].
template <typename Real>
struct ExpertWeightsT {
  const Real* gate = nullptr;
  const Real* up = nullptr;
  const Real* down = nullptr;
  int64_t E = 0, Din = 0, F = 0;
};
using ExpertWeights = ExpertWeightsT<float>;
// Gradients of the stacked expert weights, same layout; a nullptr member is not computed.
template <typename Real>
struct ExpertGradsT {
  Real* gate = nullptr;
  Real* up = nullptr;
  Real* down = nullptr;
};

// y[N,Din] = Σ_{j∈T(t)} w[t,slot] · E_j(x[t]) (y is overwritten). Grouped: rows gathered per
// expert, three GEMMs per expert with ≥1 row, scatter-add; no dense masked product.
//   x [N,Din], w [N,k] (slot order of the plan's idx), y [N,Din].
//   saved_gate / saved_up (optional, both or neither) [N·k, F] in the plan's sorted-row order:
//   receive the pre-activations for moe_experts_backward (else it recomputes them per tile).
template <typename Real>
void moe_experts_forward(const Real* x, const MoePlan& plan, const Real* w,
                         const ExpertWeightsT<Real>& ew, const GluActivation& act, Real* y,
                         Arena& ws, std::type_identity_t<Real>* saved_gate = nullptr,
                         std::type_identity_t<Real>* saved_up = nullptr);
// Upper bound of the scratch moe_experts_forward takes from ws (released before it returns) when
// run with `threads` OpenMP threads (num_threads() at the call). Independent of the routing.
size_t moe_experts_forward_workspace_bytes(int64_t N, int k, const ExpertWeights& ew, int threads,
                                           size_t elem_bytes = sizeof(float));
// Rows per GEMM tile of one expert: bounds per-thread scratch and load-balances big experts.
inline constexpr int64_t kMoeExpertTileRows = 256;

// Backward of moe_experts_forward with the routing (plan, w) fixed. Accumulates:
//   dx[N,Din] += ∂L/∂x;  dweights[N,k] += dy_t · E_j(x_t) for slot (t, j);  grads.* += ∂L/∂W.
//   dy [N,Din] = ∂L/∂y. dx, dweights and any grads member may be nullptr (not wanted).
//   saved_gate / saved_up: from the forward, or nullptr (both) to recompute per tile.
// Grouped like the forward (gather an expert's rows, GEMMs per tile; no dense masked product).
// Each expert's weight gradient is accumulated by one thread over its tiles in order, and the
// per-token sums run in slot order, so the result does not depend on the thread schedule.
template <typename Real>
void moe_experts_backward(const Real* x, const MoePlan& plan, const Real* w,
                          const ExpertWeightsT<Real>& ew, const GluActivation& act,
                          const std::type_identity_t<Real>* saved_gate,
                          const std::type_identity_t<Real>* saved_up, const Real* dy,
                          std::type_identity_t<Real>* dx, std::type_identity_t<Real>* dweights,
                          const ExpertGradsT<Real>& grads, Arena& ws);
size_t moe_experts_backward_workspace_bytes(int64_t N, int k, const ExpertWeights& ew,
                                            int threads, size_t elem_bytes = sizeof(float));

// Naive per-token loop (tests): same result as moe_experts_forward.
void moe_experts_reference(const float* x, const int32_t* idx, const float* w, int64_t N, int k,
                           const ExpertWeights& ew, const GluActivation& act, float* y);

}  // namespace dm
