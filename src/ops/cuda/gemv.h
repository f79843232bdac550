// Matrix-vector products for the few-row GEMMs of decoding: y[M, N] = alpha·x[M, K]·W[N, K]ᵀ
// + beta·y with M ≤ kGemvMaxRows (bf16 x and W, fp32 accumulate, bf16 or fp32 y), row-major
// like gemm.h. At batch 1 every linear layer of a decode step is such a product: it reads the
// whole weight once and does 2 FLOP per weight, so it is bound by HBM bandwidth alone. cuBLASLt's
// heuristic picks tensor-core tiles for these shapes that reach 0.4–2.7 TB/s of the H200's
// ~4.2 (measured under ncu, Kimi-Linear-48B shapes). Here a block owns two (or four) outputs,
// its warps split K, and every 16-byte load of the weight rows is issued at once; K ≤ 256 has
// its own kernel (a row per K/8 lanes). Sums: warp shuffles, then
// shared memory in a fixed order, so results are deterministic. A decode step at 1 × 32K took
// 3.85 ms with it against 4.7 ms with cuBLASLt (docs/benchmarks.md).
// GemmContext::gemm_bf16 routes here by itself (gemv_applies), unless DM_GEMV=cublas.
// Launched with PDL (pdl.h): a block loads its weight rows before it waits for the kernel before
// it, so W must not be written by a PDL kernel launched just before (every caller passes weights,
// which the optimizer writes in kernels launched without PDL).
// Plain C++ (no CUDA headers); implemented in gemv.cu.
#pragma once
#include <cstdint>

#include "ops/cuda/gemm.h"

struct CUstream_st;

namespace dm::cuda {

constexpr int64_t kGemvMaxRows = 4;

// Whether launch_gemv_bf16 takes this product: M in [1, kGemvMaxRows], K a multiple of 8, the
// leading dimensions multiples of 8 (elements) and x, W 16-byte aligned; and DM_GEMV is not
// "cublas" (read once).
bool gemv_applies(int64_t M, int64_t K, const uint16_t* x, int64_t ldx, const uint16_t* W,
                  int64_t ldw);

// y[m, n] = alpha·Σ_k x[m·ldx + k]·W[n·ldw + k] + beta·y[m·ldy + n]  (beta = 0: y is not read).
// Preconditions: gemv_applies(M, K, x, ldx, W, ldw).
void launch_gemv_bf16(int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* x,
                      int64_t ldx, const uint16_t* W, int64_t ldw, float beta, void* y,
                      GemmOutType y_type, int64_t ldy, CUstream_st* stream);

// Several weights applied to the same x in one launch (a decode layer's input projections: one
// kernel instead of up to six, and the small ones' load latency hidden behind the large ones').
constexpr int kGemvMaxOutputs = 8;
struct GemvOutput {
  const uint16_t* W;  // [N, ldw] bf16
  int64_t ldw, N;
  void* y;            // [M, ldy], bf16 or fp32 per y_type
  GemmOutType y_type;
  int64_t ldy;
};
// y_i = alpha·x·W_iᵀ + beta·y_i for i < count ≤ kGemvMaxOutputs, all of width K.
// Preconditions: gemv_applies(M, K, x, ldx, W_i, ldw_i) for every i.
void launch_gemv_bf16_many(int64_t M, int64_t K, const uint16_t* x, int64_t ldx,
                           const GemvOutput* outputs, int count, CUstream_st* stream,
                           float alpha = 1.0f, float beta = 0.0f);

// The kernel launch_gemv_bf16_many picks for these products (tests and benchmarks): 0 = the
// small-K kernel, else the split-K kernel's outputs per block (2 or 4).
int gemv_columns_per_block(int64_t M, int64_t K, const GemvOutput* outputs, int count);

}  // namespace dm::cuda
