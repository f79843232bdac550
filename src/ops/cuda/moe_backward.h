// Backward ops of the GPU MoE layer and the gated FFN (SPEC §1.4, §1.5): the twins of
// ops/cpu/moe.h moe_experts_backward / moe_route_backward and ops/cpu/ffn.h ffn_backward.
// Plain C++ (no CUDA headers); entry points in moe_backward.cpp, kernels in moe_backward.cu.
//
// Every pointer is a DEVICE pointer; bf16 is its uint16_t bit pattern. Conventions of
// docs/backward.md: weight gradients are fp32 and ACCUMULATED (+=, GEMMs with beta = 1); what an
// op says it WRITES is overwritten. GEMM operands are bf16 with fp32 accumulation; element-wise
// and router math is fp32. Nothing here synchronises the stream.
//
// Flow of the routed experts in one MoE backward (the plan and routing weights come from the
// forward's recompute, model/cuda/moe_gpu_backward.cpp):
//   moe_experts_recompute   x → sorted rows, g, u, h = act(g, u), out_r = E_j(x_t) per row,
//                           y = Σ w·out (the forward's combine, when the caller needs it)
//   moe_experts_backward    dy → dweights (= <dy_t, E_j(x_t)>), dout_r = w·dy_t, the down,
//                           GLU and gate/up backward per expert, dx = Σ_slots dx_r
// Both take the same workspace: the second reads what the first left there.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/env.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/moe.h"

struct CUstream_st;

namespace dm {
struct RouterParams;   // ops/cpu/moe.h
struct GluActivation;  // ops/cpu/ffn.h
}  // namespace dm

namespace dm::cuda {

// fp32 gradients of the stacked expert weights (layout of ExpertWeightsBf16: gate, up
// [E, F, Din]; down [E, Din, F]); a nullptr member is not computed.
struct ExpertGradsF32 {
  float* gate = nullptr;
  float* up = nullptr;
  float* down = nullptr;
  // The three hold no gradient yet (not zeroed this step): the backward stores into them
  // instead of accumulating (every expert's slice written; zeros where an expert got no row).
  bool store = false;
};

// Device scratch shared by moe_experts_recompute and moe_experts_backward (R = N·k rows):
// sorted x [R, Din], g, u, h [R, F] and out [R, Din] bf16, dx rows [R, Din] fp32, the grouped
// GEMM pointer arrays.
size_t moe_experts_backward_workspace_bytes(int64_t N, int k, const ExpertWeightsBf16& ew);

// The forward's expert computation, keeping its intermediates in `workspace` for the backward:
// same GEMMs, rounding and GLU as moe_experts_forward, but g survives (h is its own buffer).
// y [N, Din] fp32 (nullable: not wanted) is WRITTEN with Σ_s w[t,s]·out[row(t,s)].
void moe_experts_recompute(GemmContext& gemm, const uint16_t* x, const MoeDispatchPlan& plan,
                           const float* w, const ExpertWeightsBf16& ew, const GluActivation& act,
                           float* y, void* workspace, MoeGemmPath path = MoeGemmPath::Grouped,
                           CUstream_st* stream = nullptr);

// Backward of y = Σ_s w[t,s]·E_j(x_t) with the routing fixed, after moe_experts_recompute on the
// same (plan, w, ew, workspace):
//   dy [N, Din] fp32 = ∂L/∂y;
//   dweights [N, k] fp32 WRITTEN = <dy_t, E_j(x_t)> (the bf16 expert outputs the forward
//     combined), nullable;
//   dx [N, Din] fp32 = ∂L/∂x, ACCUMULATED when dx_accumulate, else WRITTEN; nullable;
//   grads.* += ∂L/∂W (fp32).
// GEMMs over the non-empty experts only, never over a dense mask:
//   Grouped: dh [rows_e, F] bf16 = dout_e·W_down_e is one cublasGemmGroupedBatchedEx call;
//     dW_down, dW_gate and dW_up (fp32 C, beta = 1) and the fp32 dx rows are one launch each of
//     our grouped kernels (moe_kernels.h launch_grouped_weight_grad, launch_grouped_rows_f32):
//     cuBLAS' grouped GEMM has no bf16 A/B → fp32 C form (cuBLAS 13.1 returns
//     CUBLAS_STATUS_NOT_SUPPORTED for it under CUBLAS_COMPUTE_32F). DM_MOE_GROUPED_F32=cublas
//     runs those as one cuBLASLt GEMM per expert instead (for A/B timing).
//   GroupedOwn: as Grouped with dh from our grouped kernel too (launch_grouped_rows_bf16):
//     only device offsets are read, so the plan may lack its host copy.
//   Loop: every GEMM per expert through cuBLAS (the reference path).
// The two paths differ in the dh GEMM's kernel (same bf16 rounding of an fp32 sum) and in the
// fp32 summation order of the weight gradients and dx rows.
// Overwrites the workspace's h and out buffers and its grouped-GEMM pointer arrays. `path` comes
// after `stream` so existing (…, workspace, stream) calls keep their meaning.
void moe_experts_backward(GemmContext& gemm, const MoeDispatchPlan& plan, const float* w,
                          const ExpertWeightsBf16& ew, const GluActivation& act, const float* dy,
                          float* dweights, float* dx, bool dx_accumulate,
                          const ExpertGradsF32& grads, void* workspace,
                          CUstream_st* stream = nullptr, MoeGemmPath path = MoeGemmPath::Grouped);

// Router backward with the selection fixed (ops/cpu/moe.h moe_route_backward): scores [N, E],
// idx [N, k] as moe_route wrote them, dweights [N, k] = ∂L/∂w; dlogits [N, E] fp32 WRITTEN
// (zero outside each token's selection). The balancing bias gets nothing.
void moe_route_backward(const float* scores, const int32_t* idx, const float* dweights,
                        int64_t N, const RouterParams& p, float* dlogits,
                        CUstream_st* stream = nullptr);

// ---- Gated FFN (dense FFN layer and the MoE's fused shared experts) ---------------------------
// W_gate [F, d] directly followed by W_up [F, d] (as weights.cpp lays them out): then the two
// act as one [2F, d] matrix, g and u come from one GEMM as [N, 2F] rows (g in columns [0, F), u in
// [F, 2F), elementwise.h GluRows) and their gradients go through one product each way.
// DM_GLU_ONE_GATE_UP=0 (read at each call; the A/B reference) treats them as apart.
inline bool glu_gate_up_adjacent(const uint16_t* w_gate, const uint16_t* w_up, int64_t F,
                                 int64_t d) {
  return w_up == w_gate + F * d && env_flag("DM_GLU_ONE_GATE_UP", true);
}
// Recomputes g = x·W_gateᵀ, u = x·W_upᵀ (bf16, as the forward) — or, with adjacent weights,
// reads them from kept_gate_up ([N, 2F] rows as the forward's one GEMM wrote them; not written;
// ignored when the weights are not adjacent) — and back-propagates dy [N, d] (bf16, the caller
// rounds ∂L/∂y once):
//   dW_down [d, F] += dyᵀ·h;  dh = dy·W_down;  (dg, du) = GLU backward;
//   dW_gate [F, d] += dgᵀ·x, dW_up += duᵀ·x;  dx [N, d] fp32 = dg·W_gate + du·W_up
//   (dx_beta = 0 writes dx, 1 accumulates; dx and every dW_* nullable). With adjacent weights
//   dx is one product over K = 2F, and the weight gradients one [2F, d] product when their slots
//   are adjacent too.
// workspace: glu_ffn_backward_workspace_bytes(N, F) bytes (g, u → dg, du; h → dh; [N, F] bf16
// each). dgu_out (adjacent weights only): dg | du go into its first 2F columns, rows ld_dgu
// apart, instead of the workspace, so that the caller can fold them into a wider input-gradient
// product of its own (then dx is nullptr).
size_t glu_ffn_backward_workspace_bytes(int64_t N, int64_t F);
void glu_ffn_backward(GemmContext& gemm, const uint16_t* x, const uint16_t* w_gate,
                      const uint16_t* w_up, const uint16_t* w_down, const uint16_t* dy, float* dx,
                      float dx_beta, float* dw_gate, float* dw_up, float* dw_down, int64_t N,
                      int64_t d, int64_t F, const GluActivation& act, void* workspace,
                      CUstream_st* stream = nullptr, const uint16_t* kept_gate_up = nullptr,
                      uint16_t* dgu_out = nullptr, int64_t ld_dgu = 0);

// ---- Internal: moe_backward.cpp → moe_backward.cu (not for use outside src/ops/cuda/moe*) -----
namespace moe_detail {
// Grouped dh GEMM of the down projection, one group per non-empty expert e (rows
// [begin_e, begin_e + n_e) of the plan's sorted order):
//   dh[begin_e : begin_e + n_e, :] [n_e, F] bf16 = dout[begin_e …] [n_e, Din] · W_down_e [Din, F]
// (fp32 accumulate, beta = 0). host_offsets / device_offsets: the plan's offsets [E+1] on the
// host and the device; host_scratch ≥ down_backward_grouped_host_bytes(E) bytes of host memory.
struct DownBackwardGemm {
  const uint16_t* dout;         // [R, Din] w·dy rows
  const uint16_t* down_w;       // [E, Din, F]
  uint16_t* dh;                 // [R, F]
  const void** pointer_arrays;  // device, ≥ 3·E entries (A, B, C arrays of the grouped call)
  int E = 0;
  int64_t Din = 0, F = 0;
};
size_t down_backward_grouped_host_bytes(int E);
void run_down_backward_grouped(void* cublas_handle, const DownBackwardGemm& g,
                               const int64_t* host_offsets, const int64_t* device_offsets,
                               void* host_scratch, CUstream_st* stream);
}  // namespace moe_detail

}  // namespace dm::cuda
