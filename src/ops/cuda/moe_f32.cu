// fp32 mixture-of-experts (the fp32 GPU mode, moe.h): checked entry points of the fp32 row
// permutation (kernels in moe.cu) and the fp32 expert chain
//   x [N, Din] → sorted rows [N·k, Din] → gate, up [N·k, F] → h = act(gate, up) (in place)
//   → expert outputs [N·k, Din] → y[t] = Σ_s w[t, s]·out[row_of_pair[t, s]]
// with one cuBLASLt fp32 GEMM (GemmContext::gemm_f32: full-precision multiplies, no TF32) per
// non-empty expert and projection, as the bf16 MoeGemmPath::Loop does (moe.cpp run_expert_chain).
// Nothing is rounded below fp32, so the result is the CPU float moe_experts_forward up to the
// summation order inside each GEMM. Host code only; it lives in a .cu file because it needs no
// CPU struct (the GluActivation is passed through to glu_forward by reference).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "core/error.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/moe_kernels.h"

namespace dm::cuda {

namespace {

size_t round_up_256(size_t bytes) { return (bytes + 255) & ~size_t(255); }

// The plan's device arrays exist and (with a host copy) cover N·k rows.
void check_plan(const char* who, const MoeDispatchPlan& plan) {
  DM_CHECK(plan.offsets && plan.row_of_pair && plan.token, who, ": dispatch plan not built");
  DM_CHECK(!plan.host_offsets || plan.host_offsets[plan.E] == plan.N * plan.k, who,
           ": plan covers ", plan.host_offsets ? plan.host_offsets[plan.E] : 0,
           " rows, expected N·k = ", plan.N * plan.k);
}

}  // namespace

void moe_permute_rows(const float* x, const MoeDispatchPlan& plan, int64_t D, float* sorted,
                      CUstream_st* stream) {
  const char* who = "moe_permute_rows (fp32)";
  check_plan(who, plan);
  DM_CHECK(D > 0, who, ": D must be positive, got ", D);
  const int64_t rows = plan.N * plan.k;
  if (rows == 0) return;
  DM_CHECK(x && sorted, who, ": null argument");
  moe_detail::launch_permute_rows(x, plan.token, rows, D, sorted, stream);
}

void moe_unpermute_rows(const float* sorted, const MoeDispatchPlan& plan, const float* w, int64_t D,
                        float* y, CUstream_st* stream) {
  const char* who = "moe_unpermute_rows (fp32)";
  check_plan(who, plan);
  DM_CHECK(D > 0, who, ": D must be positive, got ", D);
  if (plan.N == 0) return;
  DM_CHECK(sorted && w && y, who, ": null argument");
  moe_detail::launch_unpermute_rows(sorted, plan.row_of_pair, w, plan.N, plan.k, D, y, stream);
}

size_t moe_experts_forward_workspace_bytes(int64_t N, int k, const ExpertWeightsF32& ew) {
  const size_t rows = size_t(std::max<int64_t>(N * k, 1));
  return 2 * round_up_256(rows * size_t(ew.Din) * sizeof(float)) +
         2 * round_up_256(rows * size_t(ew.F) * sizeof(float));
}

void moe_experts_forward(GemmContext& gemm, const float* x, const MoeDispatchPlan& plan,
                         const float* w, const ExpertWeightsF32& ew, const GluActivation& act,
                         float* y, void* workspace, CUstream_st* stream) {
  const char* who = "moe_experts_forward (cuda, fp32)";
  check_plan(who, plan);
  // The loop below launches one GEMM per non-empty expert, so it needs the row counts on the host.
  DM_CHECK(plan.host_offsets, who,
           ": the per-expert fp32 GEMMs need the plan's host offsets (moe_dispatch_plan_build "
           "with a host buffer)");
  DM_CHECK(plan.E == ew.E, who, ": plan has ", plan.E, " experts, weights have ", ew.E);
  DM_CHECK(ew.Din > 0 && ew.F > 0, who, ": Din and F must be positive, got Din=", ew.Din,
           " F=", ew.F);
  DM_CHECK(ew.Din <= std::numeric_limits<int32_t>::max() / 2 &&
               ew.F <= std::numeric_limits<int32_t>::max() / 2,
           who, ": expert dims exceed int32");
  DM_CHECK(ew.gate && ew.up && ew.down && x && w && y && workspace, who, ": null argument");
  if (plan.N == 0) return;
  const int64_t rows = plan.N * plan.k, Din = ew.Din, F = ew.F;
  // Workspace, each region 256-byte aligned: sorted x [rows, Din], gate (then h) [rows, F],
  // up [rows, F], expert outputs [rows, Din].
  char* cursor = static_cast<char*>(workspace);
  auto take = [&](int64_t elements) {
    float* p = reinterpret_cast<float*>(cursor);
    cursor += round_up_256(size_t(elements) * sizeof(float));
    return p;
  };
  float* x_sorted = take(rows * Din);
  float* gate_out = take(rows * F);
  float* up_out = take(rows * F);
  float* expert_out = take(rows * Din);

  moe_permute_rows(x, plan, Din, x_sorted, stream);
  // Rows [begin, begin + n) of expert e: gate/up[n, F] = x_sorted[n, Din]·W_e[F, Din]ᵀ.
  for (int64_t e = 0; e < ew.E; ++e) {
    const int64_t begin = plan.host_offsets[e], n = plan.host_offsets[e + 1] - begin;
    if (n == 0) continue;
    gemm.gemm_f32(false, true, n, F, Din, 1.0f, x_sorted + begin * Din, Din, ew.gate + e * F * Din,
                  Din, 0.0f, gate_out + begin * F, F, stream);
    gemm.gemm_f32(false, true, n, F, Din, 1.0f, x_sorted + begin * Din, Din, ew.up + e * F * Din,
                  Din, 0.0f, up_out + begin * F, F, stream);
  }
  // One element-wise pass over every row (empty experts own no rows): h overwrites gate.
  glu_forward(gate_out, up_out, gate_out, rows * F, act, stream);
  // expert_out[n, Din] = h[n, F]·down_e[Din, F]ᵀ.
  for (int64_t e = 0; e < ew.E; ++e) {
    const int64_t begin = plan.host_offsets[e], n = plan.host_offsets[e + 1] - begin;
    if (n == 0) continue;
    gemm.gemm_f32(false, true, n, Din, F, 1.0f, gate_out + begin * F, F, ew.down + e * Din * F, F,
                  0.0f, expert_out + begin * Din, Din, stream);
  }
  moe_unpermute_rows(expert_out, plan, w, Din, y, stream);
}

}  // namespace dm::cuda
