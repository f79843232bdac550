// Mixture-of-experts on the GPU (SPEC §1.5, §1.6): the twins of ops/cpu/moe.h (router, dispatch
// plan, grouped experts) and of the QB histogram statistics of train/balance.h. Plain C++ (no
// CUDA headers); entry points in moe.cpp, kernels in moe.cu.
//
// Every pointer is a DEVICE pointer unless its comment says host; bf16 is its uint16_t bit
// pattern. Flow of one MoE forward (dropless):
//   moe_route            logits [N,E] fp32 → scores, idx [N,k], w [N,k], cutoff [N]
//   moe_dispatch_plan_build   idx → rows sorted by expert (offsets, token, slot, row_of_pair);
//                        for the cuBLAS paths it copies the E+1 offsets to the host (one stream
//                        synchronisation: their launches need the per-expert row counts there);
//                        our grouped kernels (GroupedOwn) read the device offsets and need none
//   moe_experts_forward  gather x rows → grouped gate/up GEMMs → GLU → grouped down GEMM →
//                        weighted combine per token into y
// QB after the step: qb_histogram_accumulate + qb_raw_bias_from_histogram (or the one-call
// quantile_balance_update_device).
#pragma once
#include <cstddef>
#include <cstdint>

#include "ops/cuda/gemm.h"

struct CUstream_st;

namespace dm {
struct RouterParams;      // ops/cpu/moe.h
struct GluActivation;     // ops/cpu/ffn.h
struct QbHistogramRange;  // train/balance.h
struct BalanceOptions;
struct BalanceLayerState;
}  // namespace dm

namespace dm::cuda {

class DeviceArena;

// ---- Router (ops/cpu/moe.h moe_route): sigmoid scores, DeepSeek groups, top-(k+1) on s + bias,
// idx ascending, w = s / Σ_T s × scaling, cutoff = the (k+1)-th biased score (−inf if none).
// Ties go to the lower expert index. logits, bias (nullable) [E], scores [N,E], w, cutoff
// (nullable) fp32; idx int32. k ≤ 63, n_group ≤ 256.
void moe_route(const float* logits, const float* bias, int64_t N, const RouterParams& p,
               float* scores, int32_t* idx, float* w, float* cutoff,
               CUstream_st* stream = nullptr);

// ---- QB statistics (train/balance.h), bit-compatible with the CPU histogram estimator -------
// counts [E, range.bins] int64 += histogram of r_ij = cutoff_i − s_ij (rows with a non-finite
// cutoff skipped). Counts of several micro-batches / ranks add.
void qb_histogram_accumulate(const float* scores, const float* cutoff, int64_t N, int E,
                             const QbHistogramRange& range, int64_t* counts,
                             CUstream_st* stream = nullptr);
// raw_bias [E] fp64 = the (q+1)-th smallest r of each expert estimated from counts (untouched
// when the histogram is empty).
void qb_raw_bias_from_histogram(const int64_t* counts, int E, int k,
                                const QbHistogramRange& range, double* raw_bias,
                                CUstream_st* stream = nullptr);
// loads [E] int64 += the number of (token, slot) pairs of idx [N, k] routed to each expert (ids
// outside [0, E) skipped; the twin of train/balance.h expert_loads, which overwrites). E ≤ 8192.
void expert_loads_accumulate(const int32_t* idx, int64_t N, int k, int E, int64_t* loads,
                             CUstream_st* stream = nullptr);
// Device scratch of quantile_balance_update_device: counts [E, bins] and raw_bias [E].
size_t quantile_balance_workspace_bytes(int E, int bins);
// One-call QB update with the histogram estimator (train/balance.h quantile_balance_update):
// bias [E] fp32 (device) must be the bias the forward routed with; it is SET to the new bias.
// Synchronises the stream (the range comes from the bias, the mean subtraction and the optional
// EMA run on the host with the CPU code). Leaves bias unchanged when no cutoff is finite.
void quantile_balance_update_device(const float* scores, const float* cutoff, int64_t N, int E,
                                    int k, const BalanceOptions& options,
                                    BalanceLayerState* state, float* bias, void* workspace,
                                    CUstream_st* stream = nullptr);

// ---- Dispatch plan (ops/cpu/moe.h MoePlan): the N·k (token, slot) pairs sorted by expert,
// stable (rows of one expert in token order), identical to moe_plan_build.
struct MoeDispatchPlan {
  int64_t N = 0;
  int k = 0, E = 0;
  int64_t* offsets = nullptr;           // [E+1]: rows of expert e are [offsets[e], offsets[e+1])
  int32_t* token = nullptr;             // [N·k]
  int32_t* slot = nullptr;              // [N·k]
  int32_t* row_of_pair = nullptr;       // [N·k]: sorted row of (token t, slot s) at t·k + s
  const int64_t* host_offsets = nullptr;  // HOST copy of offsets (the caller's buffer), or
                                          // nullptr when built without one
};
// Device bytes moe_dispatch_plan_build takes from its arena (plan arrays + scratch).
size_t moe_dispatch_plan_bytes(int64_t N, int k, int E);
// idx [N,k] int32 → plan (arrays from `arena`, valid while the caller keeps them). E ≤ 8192.
// host_offsets: the caller's HOST buffer of E+1 int64, which the Grouped and Loop GEMM paths
// need: the call then synchronises the stream and throws dm::Error on an expert id outside
// [0, E). nullptr: nothing leaves the device (no synchronisation, capturable in a CUDA graph),
// and the ids are not checked: they must come from moe_route, whose ids are in range by
// construction; only the GroupedOwn path runs on such a plan.
void moe_dispatch_plan_build(const int32_t* idx, int64_t N, int k, int E, MoeDispatchPlan* plan,
                             DeviceArena& arena, int64_t* host_offsets,
                             CUstream_st* stream = nullptr);
// sorted[r, :] = x[token[r], :]   x [N, D], sorted [N·k, D] bf16, D % 8 == 0.
void moe_permute_rows(const uint16_t* x, const MoeDispatchPlan& plan, int64_t D, uint16_t* sorted,
                      CUstream_st* stream = nullptr);
// y[t, :] = Σ_s w[t,s]·sorted[row_of_pair[t,s], :] (fp32 sums in slot order; the inverse of the
// permutation weighted by the routing weights). w [N,k] fp32; y [N, D] fp32 or bf16 (written).
void moe_unpermute_rows(const uint16_t* sorted, const MoeDispatchPlan& plan, const float* w,
                        int64_t D, void* y, GemmOutType y_type, CUstream_st* stream = nullptr);

// fp32 twins (the fp32 GPU mode): fp32 rows, D any positive width.
void moe_permute_rows(const float* x, const MoeDispatchPlan& plan, int64_t D, float* sorted,
                      CUstream_st* stream = nullptr);
void moe_unpermute_rows(const float* sorted, const MoeDispatchPlan& plan, const float* w, int64_t D,
                        float* y, CUstream_st* stream = nullptr);

// ---- Grouped experts (ops/cpu/moe.h moe_experts_forward), bf16 weights stacked per expert:
// gate, up [E, F, Din]; down [E, Din, F].
struct ExpertWeightsBf16 {
  const uint16_t* gate = nullptr;
  const uint16_t* up = nullptr;
  const uint16_t* down = nullptr;
  int64_t E = 0, Din = 0, F = 0;
};
// Grouped: two cublasGemmGroupedBatchedEx calls (gate+up, down) over the non-empty experts.
// Loop: one cuBLASLt GEMM per non-empty expert and projection (the reference path).
// GroupedOwn: every product as a launch of our grouped kernels (moe_kernels.h
// launch_grouped_rows_nk_bf16 in the forward, launch_grouped_rows_bf16 for the backward's dh,
// every expert in one grid each): they read the plan's device offsets only, so the plan needs
// no host copy and the MoE layer no synchronisation.
// Never a dense masked product. Intermediates are bf16 (fp32 accumulate inside each GEMM).
enum class MoeGemmPath : uint8_t { Grouped, Loop, GroupedOwn };
// GroupedOwn's forward products below this many rows per expert on average (N·k < 16·E: the
// decoder's batches) run on a weight-streaming kernel (weights as the MMA's M operand, tokens as
// its N) instead of 128-row tiles, which would multiply mostly zero rows there.
constexpr int64_t kMoeFewRowsPerExpert = 16;
// GroupedOwn's forward products above the few-rows regime through the warpgroup-MMA (wgmma)
// version of the grouped kernel (the default) or the mma.sync one (env DM_MOE_WGMMA=0). On an
// H200 (gpu_1b, B 1, T 4096, recompute off) wgmma takes the step from 119.1/119.5 to
// 117.9/117.9 ms (two rounds). Process-wide; the setter is for tests and benchmarks.
bool moe_grouped_wgmma();
void moe_set_grouped_wgmma(bool on);
// The backward's grouped products (dh, the dx rows and the expert weight gradients, in both
// grouped paths) through warpgroup MMA (moe_grouped_gemm_wgmma_backward.cu; the default) or the
// mma.sync kernels (env DM_MOE_WGMMA_BACKWARD=0). H200, 24576 rows over 32 experts, Din 512,
// F 1024 (bench_cuda_moe_gemm), µs: dh 126 → 99, dx 210 → 132, dW 115 → 92; gpu_1b step
// 115.3 → 113.8 ms against wgmma rows with mma.sync weight gradients. Process-wide; the setter is
// for tests and benchmarks.
bool moe_grouped_wgmma_backward();
void moe_set_grouped_wgmma_backward(bool on);
// The wgmma grouped kernels' schedule (forward and backward): false (the default) waits for step
// t − 1's MMAs, refills their stage, then issues step t's; true (env DM_MOE_WGMMA_OVERLAP=1)
// issues step t's first, so the tensor cores have the next batch queued while the refill waits
// (one more barrier a step). Written 2026-11-30 after the device budget ran out: NOT YET RUN ON
// A GPU. bench_cuda_moe_gemm times both.
bool moe_wgmma_overlap();
void moe_set_wgmma_overlap(bool on);
// The wgmma grouped kernels' row outputs (the forward's Y, the backward's dh and dx): true (the
// default) stages the output tile through shared memory and writes whole rows, 16 bytes a lane;
// false (env DM_MOE_WGMMA_STAGED=0) stores straight from the MMA fragments. Same values either
// way. On an H200 (gpu_1b layer, bench_cuda_moe_gemm) staging took the forward gate product from
// 92.8 to 73.4 us and down from 76.9 to 66.9 us.
bool moe_wgmma_staged_output();
void moe_set_wgmma_staged_output(bool on);
// The forward's wgmma expert products with 128 × 256 tiles at one CTA per SM
// (launch_grouped_rows_nk_bf16_wgmma_wide) instead of 128 × 128 at two: 85 instead of 64 MMA
// flops per operand byte loaded. Env DM_MOE_WGMMA_WIDE (0 / 1, default 0); same output bits
// either way. Off: on an H200 (bench_cuda_moe_gemm, 24576 rows) it moved the gate product 73.4 ->
// 70.7 us and down 66.2 -> 63.4 only with the overlapped schedule (78.9 / 74.2 without), and the
// gpu_1b train step not at all (88.4-88.6 ms either way): the operand bytes are not the limit.
bool moe_wgmma_wide();
void moe_set_wgmma_wide(bool on);
// The wgmma expert products warp-specialized on the TMA: a producer thread feeds the
// shared-memory ring through tensor maps and mbarriers and the two warpgroups only multiply,
// instead of every thread copying with cp.async (the forward's products:
// launch_grouped_rows_nk_bf16_tma, 128 × 256 tiles where moe_wgmma_wide(); the backward's dh,
// dx and weight gradients: the same launchers, moe_grouped_gemm_wgmma_backward.cu). Env
// DM_MOE_TMA (0 / 1, default 1); same output bits either way. On an H200 (bench_cuda_moe_gemm,
// 24576 rows, 32 experts, Din 512, F 1024; µs cp.async → TMA): gate 73.9 → 72.3, down 65.7 →
// 66.4, dh 82.7 → 74.4, dx 132.3 → 123.6, dW_gate 93.3 → 85.3, dW_down 94.6 → 86.8; gpu_1b
// train step (B 1, T 4096, recompute off) 88.2-88.7 → 87.6 / 87.6 ms.
bool moe_wgmma_tma();
void moe_set_wgmma_tma(bool on);
// The GLU inside the wgmma expert products (off by default; env DM_MOE_GLU_FUSED=1 turns it on):
// the forward's gate and up products as one kernel whose epilogue writes h = act(g, u), and the
// backward's dh product whose epilogue applies the GLU backward (moe_kernels.h
// launch_grouped_gate_up_glu_wgmma, launch_grouped_rows_glu_backward_wgmma), instead of the
// separate element-wise GLU passes. Same values bitwise. Off because it did not pay on an H200
// (gpu_1b layer, 24576 rows, 32 experts, bench_cuda_moe_gemm --only GLU): forward 186.2 -> 180.7
// us, but backward 145.5 -> 159.4 us (the GLU epilogue does not overlap the MMAs at 2 CTAs/SM),
// and the gpu_1b train step 88.3-88.9 ms separate vs 88.6-89.2 ms fused. Process-wide; the setter
// is for tests and benchmarks.
bool moe_wgmma_fused_glu();
void moe_set_wgmma_fused_glu(bool on);
// The forward's expert products on the persistent pingpong kernel (moe_kernels.h
// launch_grouped_rows_nk_bf16_pingpong) where the TMA path applies: env DM_MOE_PINGPONG (0 / 1,
// default 1). With DM_MOE_PINGPONG_GLU (0 / 1, default 1) as well, the gate and up products and
// the GLU run as one such kernel (launch_grouped_gate_up_glu_pingpong), whose GLU epilogue one
// consumer runs while the other multiplies. Same output bits either way. On an H200
// (bench_cuda_moe_gemm, 24576 rows, 32 experts, Din 512, F 1024; µs, TMA-fed → pingpong): gate
// 66.0 → 65.5, down 64.1 → 60.6, gate + up + GLU 169.8 (products and the GLU pass) → 146.2 (one
// kernel); the gpu_1b train step 85.9-86.1 ms → 85.8-86.1 (no change beyond the noise).
// Process-wide; the setters are for tests and benchmarks.
bool moe_wgmma_pingpong();
void moe_set_wgmma_pingpong(bool on);
bool moe_wgmma_pingpong_glu();
void moe_set_wgmma_pingpong_glu(bool on);
// The backward's expert weight gradients on the pingpong kernel (moe_kernels.h
// launch_grouped_weight_grad_pingpong) where it applies, under moe_wgmma_pingpong(): env
// DM_MOE_PINGPONG_WEIGHT_GRAD (0 / 1, default 1). Same output bits either way. On an H200
// (bench_cuda_moe_gemm, accumulating; µs, TMA-fed → pingpong): dW_gate 85.5 → 78.3, dW_down
// 83.9 → 76.3; gpu_1b train step 85.8-85.9 ms with it off, 85.7 / 85.7 on (85.7-86.5 with no
// pingpong kernel at all).
bool moe_wgmma_pingpong_weight_grad();
void moe_set_wgmma_pingpong_weight_grad(bool on);
// The backward's row products dh and dx on the pingpong kernel (moe_kernels.h
// launch_grouped_rows_backward_pingpong) where it applies, under moe_wgmma_pingpong(): env
// DM_MOE_PINGPONG_ROWS_BACKWARD (0 / 1, default 1). Same output bits. On an H200
// (bench_cuda_moe_gemm; µs, TMA-fed → pingpong): dx 120.4 → 111.2, dh 65.6 → 64.7. Its GLU
// backward epilogue (dh, then dg and du from the kept g and u) is not used: 162.3 µs against
// 129.3 for the dh product and the separate GLU pass, 138.8 for the wgmma kernel's fused
// epilogue (DM_MOE_GLU_FUSED=1): reading g and u back takes longer than the other consumer's
// K loop, so it is not hidden, and one CTA an SM keeps too few of those loads in flight.
bool moe_wgmma_pingpong_rows_backward();
void moe_set_wgmma_pingpong_rows_backward(bool on);
// Test of the wgmma conventions alone (wgmma.cuh: descriptors, swizzle, accumulator layout):
// C [64][128] fp32 = A·Bᵀ for A [64][64] and B [128][64] bf16 row-major (device pointers), one
// warpgroup, one tile; transposed: 0 = both operands K-major in shared memory, 1 = B MN-major,
// 2 = both MN-major. Synchronous with respect to the default stream.
void moe_wgmma_tile_check(const uint16_t* A, const uint16_t* B, float* C, int transposed = 0);
// The path the model layers use: env DM_MOE_GEMM = own (default: GroupedOwn) | cublas
// (Grouped) | loop, read once. Ours and cuBLAS' time the same in training (gpu_1b step 118.5 vs
// 118.4 ms on an H200); ours needs no host synchronisation.
MoeGemmPath moe_gemm_default_path();
// Device scratch: gathered x [N·k, Din], gate/h and up [N·k, F], expert outputs [N·k, Din] (bf16)
// and the grouped GEMM pointer arrays.
size_t moe_experts_forward_workspace_bytes(int64_t N, int k, const ExpertWeightsBf16& ew);
// y[N, Din] = Σ_{j∈T(t)} w[t,slot]·E_j(x[t]) (written, fp32 or bf16); x [N, Din] bf16;
// w [N,k] fp32 in the slot order of the plan's idx. `gemm` supplies the cuBLAS handles.
void moe_experts_forward(GemmContext& gemm, const uint16_t* x, const MoeDispatchPlan& plan,
                         const float* w, const ExpertWeightsBf16& ew, const GluActivation& act,
                         void* y, GemmOutType y_type, void* workspace,
                         MoeGemmPath path = MoeGemmPath::Grouped, CUstream_st* stream = nullptr);

// ---- fp32 experts (the fp32 GPU mode): the same chain with fp32 weights, rows and
// intermediates, one cuBLAS fp32 GEMM per non-empty expert and projection (GemmContext::gemm_f32,
// no TF32). The plan must have been built with host_offsets (the per-expert launches need the
// row counts on the host).
struct ExpertWeightsF32 {
  const float* gate = nullptr;  // [E, F, Din]
  const float* up = nullptr;    // [E, F, Din]
  const float* down = nullptr;  // [E, Din, F]
  int64_t E = 0, Din = 0, F = 0;
};
// Device scratch: sorted x [N·k, Din], gate/h and up [N·k, F], expert outputs [N·k, Din] fp32.
size_t moe_experts_forward_workspace_bytes(int64_t N, int k, const ExpertWeightsF32& ew);
// y[N, Din] = Σ_{j∈T(t)} w[t,slot]·E_j(x[t]) (written, fp32); x [N, Din] fp32.
void moe_experts_forward(GemmContext& gemm, const float* x, const MoeDispatchPlan& plan,
                         const float* w, const ExpertWeightsF32& ew, const GluActivation& act,
                         float* y, void* workspace, CUstream_st* stream = nullptr);

}  // namespace dm::cuda
