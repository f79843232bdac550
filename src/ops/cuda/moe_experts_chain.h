// The expert chain shared by the MoE forward (moe.cpp) and the backward's recompute
// (moe_backward.cpp): x_sorted → gate, up (GEMMs per expert) → h = act(gate, up) → out = h·downᵀ,
// on either GEMM path. Internal to src/ops/cuda/moe*.
#pragma once
#include "ops/cpu/ffn.h"  // GluActivation
#include "ops/cuda/moe.h"
#include "ops/cuda/moe_kernels.h"

namespace dm::cuda::moe_detail {

// b: weights, x_sorted [R, Din], gate_out / up_out [R, F], expert_out [R, Din] and (Grouped) the
// pointer arrays; h [R, F] receives the GLU (may be b.gate_out: in place, as the forward does;
// the recompute keeps g intact for the GLU backward). R = the plan's N·k rows.
void run_expert_chain(GemmContext& gemm, ExpertGemmBuffers b, const MoeDispatchPlan& plan,
                      const GluActivation& act, uint16_t* h, MoeGemmPath path,
                      CUstream_st* stream);

}  // namespace dm::cuda::moe_detail
