// Internal interface between the checked MoE entry points (moe.cpp, C++20, sees the CPU structs)
// and the kernel launchers in moe.cu (nvcc, C++17). Plain C++17; not for use outside
// src/ops/cuda/moe*. All pointers are device pointers unless marked host.
#pragma once
#include <cstddef>
#include <cstdint>

struct CUstream_st;

namespace dm::cuda {
struct GluKernelParams;  // elementwise.h
}

namespace dm::cuda::moe_detail {

struct RouteProblem {
  int64_t N = 0;
  int E = 0, k = 0, n_group = 1, topk_group = 1;
  bool renormalize = true;
  float scaling = 1.0f;
};
// Largest k + 1 / group count the route kernel holds per warp in shared memory.
constexpr int kRouteMaxPicks = 64, kRouteMaxGroups = 256;
void launch_route(const RouteProblem& p, const float* logits, const float* bias, float* scores,
                  int32_t* idx, float* w, float* cutoff, CUstream_st* stream);

// counts[E, bins] += histogram of r = cutoff_i − s_ij (double), bin = floor((r − low)·inv_width)
// clamped to the edges; rows with a non-finite cutoff skipped (train/balance.h).
// loads[e] += #{p < pairs : idx[p] == e} (expert_loads_accumulate).
void launch_expert_loads(const int32_t* idx, int64_t pairs, int E, int64_t* loads,
                         CUstream_st* stream);
void launch_qb_histogram(const float* scores, const float* cutoff, int64_t N, int E, double low,
                         double inverse_width, int bins, int64_t* counts, CUstream_st* stream);
// raw_bias[j] = interpolated value at 0-based position q = n·k/E of expert j's histogram
// (qb_raw_bias_from_histogram); untouched when the histogram is empty.
void launch_qb_raw_bias(const int64_t* counts, int E, int k, int bins, double low, double width,
                        double* raw_bias, CUstream_st* stream);

// Dispatch plan: stable counting sort of the N·k (token, slot) pairs by expert.
constexpr int kDispatchChunkTokens = 256;
constexpr int kDispatchMaxExperts = 8192;
size_t dispatch_scratch_bytes(int64_t N, int E);
// Writes offsets [E+1], token / slot / row_of_pair [N·k]; sets *error_flag (device int32, zeroed
// by the caller) when an expert id is outside [0, E).
void launch_dispatch_plan(const int32_t* idx, int64_t N, int k, int E, int64_t* offsets,
                          int32_t* token, int32_t* slot, int32_t* row_of_pair, void* scratch,
                          int32_t* error_flag, CUstream_st* stream);
// rows[r, :] = x[token[r], :] (bf16, D % 8 == 0).
void launch_permute_rows(const uint16_t* x, const int32_t* token, int64_t rows, int64_t D,
                         uint16_t* sorted, CUstream_st* stream);
// y[t, :] = Σ_s w[t, s]·sorted[row_of_pair[t·k + s], :] (fp32 sums in slot order); y fp32 or bf16.
void launch_unpermute_rows(const uint16_t* sorted, const int32_t* row_of_pair, const float* w,
                           int64_t N, int k, int64_t D, void* y, bool y_f32,
                           CUstream_st* stream);
// fp32 twins (the fp32 GPU mode; entry points in moe.cpp): any D ≥ 1, 16-byte accesses when
// D % 4 == 0 and the row arrays are 16-byte aligned, scalar ones otherwise (the same sums).
void launch_permute_rows(const float* x, const int32_t* token, int64_t rows, int64_t D,
                         float* sorted, CUstream_st* stream);
void launch_unpermute_rows(const float* sorted, const int32_t* row_of_pair, const float* w,
                           int64_t N, int k, int64_t D, float* y, CUstream_st* stream);

// Expert weight gradients for every expert in one launch (moe_grouped_gemm.cu):
//   C_e [M, N] fp32 += A_eᵀ·B_e,  A_e = rows [offsets[e], offsets[e+1]) of A [R, M] bf16 (row
//   stride lda), B_e the same rows of B [R, N] bf16 (row stride ldb), C_e = C + e·M·N row-major.
// offsets: the plan's DEVICE offsets [E+1] (no host copy needed). M, N, lda, ldb multiples of 8,
// A and B 16-byte aligned. Deterministic: each C element has one writer, no atomics.
void launch_grouped_weight_grad(const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                                const int64_t* offsets, int E, int64_t M, int64_t N, float* C,
                                CUstream_st* stream);
// Per-expert products over each expert's rows in one launch (moe_grouped_gemm.cu), WRITTEN:
//   Y[r, :] = A1[r, :]·B1_e (+ A2[r, :]·B2_e)  for r in [offsets[e], offsets[e+1]),
// A1, A2 [R, K] bf16 (row stride K), B1_e = B1 + e·K·N, B2_e likewise, [K, N] bf16 row-major,
// Y [R, N] fp32 (row stride N). A2 / B2 nullptr: one product. offsets: the plan's DEVICE offsets
// [E+1] with offsets[E] = R. K, N multiples of 8; pointers 16-byte aligned. Deterministic.
void launch_grouped_rows_f32(const uint16_t* A1, const uint16_t* B1, const uint16_t* A2,
                             const uint16_t* B2, const int64_t* offsets, int E, int64_t R,
                             int64_t K, int64_t N, float* Y, CUstream_st* stream);
// The same with one product (A2 = B2 = nullptr) and Y [R, N] bf16 (fp32 accumulation, one
// rounding): the backward's dh = dout_e·W_down_e rows. Deterministic.
void launch_grouped_rows_bf16(const uint16_t* A, const uint16_t* B, const int64_t* offsets, int E,
                              int64_t R, int64_t K, int64_t N, uint16_t* Y, CUstream_st* stream);
// The forward's per-expert products in one launch (moe_grouped_gemm.cu), WRITTEN, bf16:
//   Y[r, :] = A[r, :]·W_eᵀ  for r in [offsets[e], offsets[e+1]),
// A [R, K] bf16 (row stride K), W_e = W + e·N·K [N, K] bf16 row-major (the expert weights'
// layout), Y [R, N] bf16; fp32 accumulation. offsets: DEVICE [E+1] with offsets[E] = R (no host
// copy needed). K, N multiples of 8; pointers 16-byte aligned. Deterministic.
void launch_grouped_rows_nk_bf16(const uint16_t* A, const uint16_t* W, const int64_t* offsets,
                                 int E, int64_t R, int64_t K, int64_t N, uint16_t* Y,
                                 CUstream_st* stream);

// The same product on Hopper's warpgroup MMA (moe_grouped_gemm_wgmma.cu): same grid, tiling,
// contract and output; the default (moe_grouped_wgmma(), moe.h).
void launch_grouped_rows_nk_bf16_wgmma(const uint16_t* A, const uint16_t* W,
                                       const int64_t* offsets, int E, int64_t R, int64_t K,
                                       int64_t N, uint16_t* Y, CUstream_st* stream);
// The same product with 128 × 256 tiles, one CTA per SM (moe_wgmma_wide(), moe.h): same
// contract and output bits; needs grouped_rows_wide_applies (N % 8 == 0, Y 16-byte aligned);
// grid (ceil(N / 256), the row tiles).
bool grouped_rows_wide_applies(int64_t N, const void* Y);
void launch_grouped_rows_nk_bf16_wgmma_wide(const uint16_t* A, const uint16_t* W,
                                            const int64_t* offsets, int E, int64_t R, int64_t K,
                                            int64_t N, uint16_t* Y, CUstream_st* stream);
// The same product warp-specialized on the TMA (moe_grouped_gemm_tma.cu; moe_wgmma_tma(),
// moe.h): a producer thread streams A's and W_e's tiles into the shared-memory ring, two
// warpgroups multiply. Same contract and output bits as launch_grouped_rows_nk_bf16_wgmma;
// wide: 128 × 256 tiles (one CTA per SM) instead of 128 × 128 (two). Needs
// grouped_rows_tma_applies (K and N multiples of 8, A, W and Y 16-byte aligned).
bool grouped_rows_tma_applies(const void* A, const void* W, int64_t K, int64_t N, const void* Y);
void launch_grouped_rows_nk_bf16_tma(const uint16_t* A, const uint16_t* W, const int64_t* offsets,
                                     int E, int64_t R, int64_t K, int64_t N, uint16_t* Y, bool wide,
                                     CUstream_st* stream);
// The same product as a persistent, warp-specialized "pingpong" kernel
// (moe_grouped_gemm_pingpong.cu; moe_wgmma_pingpong(), moe.h): one CTA per SM walks the 128 × 128
// tiles, a producer warpgroup streams every tile's k steps through one TMA ring and two consumer
// warpgroups take the tiles in turn, so one stores its tile while the other multiplies. Same
// contract, preconditions (grouped_rows_tma_applies) and output bits as
// launch_grouped_rows_nk_bf16_wgmma.
void launch_grouped_rows_nk_bf16_pingpong(const uint16_t* A, const uint16_t* W,
                                          const int64_t* offsets, int E, int64_t R, int64_t K,
                                          int64_t N, uint16_t* Y, CUstream_st* stream);
// The gate and up products with the GLU in the epilogue on that kernel: the contract and bits of
// launch_grouped_gate_up_glu_wgmma (64 columns of F a tile, g and u side by side); also needs the
// TMA's alignment of A, W_gate, W_up (K a multiple of 8, 16-byte aligned): all of it is
// grouped_gate_up_glu_pingpong_applies.
bool grouped_gate_up_glu_pingpong_applies(const void* A, const void* W_gate, const void* W_up,
                                          int64_t K, int64_t F, const void* gate_out,
                                          const void* up_out, const void* h);
void launch_grouped_gate_up_glu_pingpong(const uint16_t* A, const uint16_t* W_gate,
                                         const uint16_t* W_up, const int64_t* offsets, int E,
                                         int64_t R, int64_t K, int64_t F, uint16_t* gate_out,
                                         uint16_t* up_out, uint16_t* h, const GluKernelParams& act,
                                         CUstream_st* stream);
// The backward's products on warpgroup MMA (moe_grouped_gemm_wgmma_backward.cu): the same
// contracts, grids and outputs as launch_grouped_rows_f32, launch_grouped_rows_bf16 and
// launch_grouped_weight_grad.
void launch_grouped_rows_f32_wgmma(const uint16_t* A1, const uint16_t* B1, const uint16_t* A2,
                                   const uint16_t* B2, const int64_t* offsets, int E, int64_t R,
                                   int64_t K, int64_t N, float* Y, CUstream_st* stream);
void launch_grouped_rows_bf16_wgmma(const uint16_t* A, const uint16_t* B, const int64_t* offsets,
                                    int E, int64_t R, int64_t K, int64_t N, uint16_t* Y,
                                    CUstream_st* stream);
// The backward's row products (dx: two products, fp32 out; dh: one, bf16 out, with the GLU
// backward in the epilogue where gate != nullptr: Y = dg, up overwritten by du) as a persistent
// pingpong kernel (moe_grouped_rows_backward_pingpong.cu; moe_wgmma_pingpong_rows_backward(),
// moe.h). Same contracts and output bits as launch_grouped_rows_f32_wgmma,
// launch_grouped_rows_bf16_wgmma and launch_grouped_rows_glu_backward_wgmma; needs
// grouped_rows_backward_pingpong_applies (K, N multiples of 8, 16-byte aligned operands and Y).
bool grouped_rows_backward_pingpong_applies(const void* A1, const void* B1, const void* A2,
                                            const void* B2, int64_t R, int64_t K, int64_t N,
                                            const void* Y);
void launch_grouped_rows_backward_pingpong(const uint16_t* A1, const uint16_t* B1,
                                           const uint16_t* A2, const uint16_t* B2,
                                           const int64_t* offsets, int E, int64_t R, int64_t K,
                                           int64_t N, void* Y, bool y_f32, const uint16_t* gate,
                                           uint16_t* up, const GluKernelParams* glu,
                                           CUstream_st* stream);
// The forward's gate and up products with the GLU in their epilogue (moe_grouped_gemm_wgmma.cu):
// g = A·W_gate_eᵀ and u = A·W_up_eᵀ rounded to bf16 as launch_grouped_rows_nk_bf16_wgmma stores
// them, h = act(g, u) (glu.cuh) [R, F] bf16; gate_out / up_out receive g and u where not nullptr
// (the backward keeps them), h must not alias them. Needs grouped_gate_up_glu_applies (F a
// multiple of 8, 16-byte aligned outputs); grid (ceil(F / 64), the row tiles).
bool grouped_gate_up_glu_applies(int64_t F, const void* gate_out, const void* up_out,
                                 const void* h);
void launch_grouped_gate_up_glu_wgmma(const uint16_t* A, const uint16_t* W_gate,
                                      const uint16_t* W_up, const int64_t* offsets, int E,
                                      int64_t R, int64_t K, int64_t F, uint16_t* gate_out,
                                      uint16_t* up_out, uint16_t* h, const GluKernelParams& act,
                                      CUstream_st* stream);
// The backward's dh product with the GLU backward in its epilogue: dh = A_e·B_e as
// launch_grouped_rows_bf16_wgmma (rounded to bf16), then (dg, du) = glu_backward(g, u, dh):
// dg [R, N] written to dg, du over up. Needs grouped_rows_glu_backward_applies.
bool grouped_rows_glu_backward_applies(int64_t N, const void* Y, const void* gate, const void* up);
void launch_grouped_rows_glu_backward_wgmma(const uint16_t* A, const uint16_t* B,
                                            const int64_t* offsets, int E, int64_t R, int64_t K,
                                            int64_t N, const uint16_t* gate, uint16_t* up,
                                            uint16_t* dg, const GluKernelParams& act,
                                            CUstream_st* stream);
// store (weight gradient only): C_e = A_eᵀ·B_e instead of +=, C not read, and an expert without
// rows gets C_e = 0: the first product into gradients the step has not zeroed (DeviceParamArena
// store-first ranges).
// R: the rows of A and B (offsets[E]; the TMA-fed kernel's tensor maps end there).
void launch_grouped_weight_grad_wgmma(const uint16_t* A, int64_t lda, const uint16_t* B,
                                      int64_t ldb, const int64_t* offsets, int E, int64_t R,
                                      int64_t M, int64_t N, float* C, CUstream_st* stream,
                                      bool store = false);
// The same weight gradients as a persistent pingpong kernel (moe_grouped_weight_grad_pingpong.cu;
// moe_wgmma_pingpong_weight_grad(), moe.h): one CTA per SM walks the (expert, 128 × 128) tiles,
// a TMA producer warpgroup feeds two consumer warpgroups that take tiles in turn, so one's fp32
// epilogue runs under the other's MMAs. Same contract and output bits as
// launch_grouped_weight_grad_wgmma; needs grouped_weight_grad_pingpong_applies (row strides
// multiples of 8 with lda ≥ M, ldb ≥ N, N % 4 == 0, 16-byte aligned A, B, C; R < 2^31).
bool grouped_weight_grad_pingpong_applies(const void* A, int64_t lda, const void* B, int64_t ldb,
                                          int64_t R, int64_t M, int64_t N, const void* C);
void launch_grouped_weight_grad_pingpong(const uint16_t* A, int64_t lda, const uint16_t* B,
                                         int64_t ldb, const int64_t* offsets, int E, int64_t R,
                                         int64_t M, int64_t N, float* C, CUstream_st* stream,
                                         bool store = false);
// The same product for few rows per expert (moe_grouped_few_rows.cu): weights as the MMA's
// M operand, tokens as its N, each expert's W streamed once into registers; one CTA per
// (128 weight rows, expert), grid (ceil(N / 128), E). R = offsets[E] (the host's N·k) sets the
// rows per pass. Any row count works (further passes per expert), but it pays off below
// kMoeFewRowsPerExpert (moe.h) rows per expert on average. Deterministic; K multiple of 8, pointers
// 16-byte aligned.
void launch_grouped_few_rows_nk_bf16(const uint16_t* A, const uint16_t* W, const int64_t* offsets,
                                     int E, int64_t R, int64_t K, int64_t N, uint16_t* Y,
                                     CUstream_st* stream);
// Grouped expert GEMMs over the non-empty experts (host_offsets [E+1] is the host copy of the
// plan's offsets, device_offsets the device one), bf16 in and out, fp32 accumulate:
//   gate_out[r] = x_sorted[r]·gate_eᵀ, up_out[r] = x_sorted[r]·up_eᵀ   (rows r of expert e) ...
//   ... then (after the caller's GLU into gate_out) expert_out[r] = gate_out[r]·down_eᵀ.
struct ExpertGemmBuffers {
  const uint16_t* gate_w;    // [E, F, Din]
  const uint16_t* up_w;      // [E, F, Din]
  const uint16_t* down_w;    // [E, Din, F]
  const uint16_t* x_sorted;  // [R, Din]
  uint16_t* gate_out;        // [R, F] (also h after the GLU)
  uint16_t* up_out;          // [R, F]
  uint16_t* expert_out;      // [R, Din]
  const void** pointer_arrays;  // device, 9·E entries (cuBLAS grouped A/B/C arrays)
  int E;
  int64_t Din, F;
  // Input [R, F] of the down projection; nullptr = gate_out (the forward's GLU runs in place).
  // The backward's recompute keeps g intact for the GLU backward and writes h elsewhere.
  const uint16_t* down_in = nullptr;
};
size_t expert_pointer_array_bytes(int E);
// Phase 0: gate and up projections; phase 1: down projection. cublas_handle: cublasHandle_t;
// host_scratch: ≥ expert_grouped_host_bytes(E) bytes of host memory.
size_t expert_grouped_host_bytes(int E);
void run_expert_gemms_grouped(void* cublas_handle, const ExpertGemmBuffers& b,
                              const int64_t* host_offsets, const int64_t* device_offsets,
                              int phase, void* host_scratch, CUstream_st* stream);

// ---- Backward (moe_backward.cu; checked entry points in moe_backward.cpp) ----------------------
// dlogits[t, :] = 0 except dlogits[t, idx[t,i]] = c·(dw_i − Σ_j dw_j·s_j/(S+ε))·s_i(1 − s_i) with
// S = Σ_j s_idx[t,j], c = scaling/(S+ε) (renormalize) else c = scaling and no correction term
// (WRITTEN, [N, E] fp32). One warp per token.
void launch_route_backward(const float* scores, const int32_t* idx, const float* dweights,
                           int64_t N, int E, int k, bool renormalize, float scaling,
                           float* dlogits, CUstream_st* stream);
// dweights[t·k + s] = Σ_c dy[t, c]·out[row_of_pair[t·k + s], c]  (WRITTEN; fp32 dy [N, D],
// bf16 out [N·k, D]). One warp per (token, slot), fixed summation order.
void launch_expert_weight_grads(const float* dy, const uint16_t* out, const int32_t* row_of_pair,
                                int64_t N, int k, int64_t D, float* dweights,
                                CUstream_st* stream);
// dout[r, :] = bf16(w[token[r]·k + slot[r]]·dy[token[r], :])  (fp32 dy [N, D], bf16 dout
// [rows, D], D % 4 == 0).
void launch_scale_permute_rows(const float* dy, const int32_t* token, const int32_t* slot,
                               const float* w, int64_t rows, int k, int64_t D, uint16_t* dout,
                               CUstream_st* stream);
// dx[t, :] (+)= Σ_s sorted[row_of_pair[t·k + s], :] in slot order (fp32 both, D % 4 == 0);
// accumulate = false writes.
void launch_unpermute_sum_rows(const float* sorted, const int32_t* row_of_pair, int64_t N, int k,
                               int64_t D, float* dx, bool accumulate, CUstream_st* stream);

// Stream-ordered helpers: async copy device → host of each (dst, src, bytes) pair, then one
// stream synchronisation; async memset.
void copy_to_host_and_wait(void* dst0, const void* src0, size_t bytes0, void* dst1,
                           const void* src1, size_t bytes1, CUstream_st* stream);
void copy_to_device_async(void* dst, const void* src, size_t bytes, CUstream_st* stream);
void memset_async(void* dst, int value, size_t bytes, CUstream_st* stream);

}  // namespace dm::cuda::moe_detail
