// Dense GEMM on the GPU through cuBLASLt: bf16 A and B, fp32 accumulate, bf16 or fp32 C.
// Plain C++ (no CUDA headers); implemented in gemm.cu.
//
// Conventions match core/gemm.h (row-major everywhere):
//   gemm_bf16(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc):
//       C[M,N] = alpha·op(A)·op(B) + beta·C
//   A is [M,K] (or [K,M] when ta), B is [K,N] (or [N,K] when tb), leading dimensions in elements.
//   linear:  y[N,out] = x[N,in]·W[out,in]ᵀ  is gemm_bf16(false, true, N, out, in, ...).
//
// One GemmContext per device stream owner: it creates the cuBLASLt handle, the cuBLAS handle (for
// the grouped expert GEMMs in moe.cu) and one workspace allocation once; calls never allocate
// device memory (tuning aside, below). Matmul descriptors live on the stack (cublasLt*Init), and
// the algorithm chosen by the heuristic is cached per (shape, leading dims, alignment, C type,
// beta≠0), so a steady state call is one cublasLtMatmul.
//
// Tuning (opt-in: set_tuning or DM_GEMM_TUNE=1|accumulating): a cache miss outside graph capture
// times the heuristic's top 8 algorithms on the call's operands and caches the fastest, keeping C
// (beta ≠ 0) in a scratch allocated on such first calls only. `accumulating` tunes only the
// products that read C (beta ≠ 0: the residual adds, the accumulating input and weight
// gradients), where the heuristic's first pick measured up to 30% slower than a later candidate
// on the H200 (o_proj + fp32 residual at 16384 × 2048 × 2048: 277 against 209 µs); the plain
// products' picks were already within ~3%. DM_GEMM_TUNE_LOG=1 logs each tuned key.
#pragma once
#include <cstddef>
#include <cstdint>

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace dm::cuda {

// Element type of a GEMM output (A and B are always bf16).
enum class GemmOutType : uint8_t { Bf16, F32 };
// Which cache misses are tuned (file comment): none, the products with beta ≠ 0, or all.
enum class GemmTuning : uint8_t { Off, Accumulating, All };

class GemmContext {
 public:
  // workspace_bytes is split evenly between cuBLASLt and cuBLAS (32 MiB each is what cuBLAS
  // recommends on Hopper).
  explicit GemmContext(size_t workspace_bytes = size_t(64) << 20);
  ~GemmContext();
  GemmContext(const GemmContext&) = delete;
  GemmContext& operator=(const GemmContext&) = delete;

  // C[M,N] = alpha·op(A)·op(B) + beta·C (row-major). A, B: bf16 device pointers; C: bf16 or
  // fp32 device pointer per c_type. M, N or K = 0 is allowed (K = 0 scales C by beta).
  // c_in (nullable): the beta term reads c_in (same type and ldc) instead of C, and C is only
  // written — a residual add in the product's epilogue instead of a pass of its own.
  // Throws dm::Error on a bad argument or a cuBLAS failure.
  void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                 const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                 void* C, GemmOutType c_type, int64_t ldc, CUstream_st* stream = nullptr,
                 const void* c_in = nullptr);

  // The same product in fp32: A, B, C fp32, fp32 accumulation with full-precision multiplies
  // (CUBLAS_COMPUTE_32F: no TF32), for the fp32 GPU mode. Same conventions and cache.
  void gemm_f32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                int64_t ldc, CUstream_st* stream = nullptr);

  // `batch` independent GEMMs of one shape in one call: product i reads A + i·stride_a,
  // B + i·stride_b and writes C + i·stride_c (strides in elements; 0 = the same matrix each time).
  // K = 0 is not supported here. Same algorithm cache as gemm_bf16.
  void gemm_bf16_strided_batched(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                                 float alpha, const uint16_t* A, int64_t lda, int64_t stride_a,
                                 const uint16_t* B, int64_t ldb, int64_t stride_b, float beta,
                                 void* C, GemmOutType c_type, int64_t ldc, int64_t stride_c,
                                 int64_t batch, CUstream_st* stream = nullptr,
                                 const void* c_in = nullptr);
  // cublasHandle_t (legacy cuBLAS, with this context's workspace attached) for callers that need
  // the grouped batched API; the stream is set by the caller before each use.
  void* cublas_handle() const { return cublas_; }
  // Host scratch for callers that build per-call host arrays (grouped GEMM descriptors); fixed
  // size, allocated once.
  void* host_scratch(size_t bytes);

  // Number of cached algorithms (tests: steady state must not grow it).
  int cached_algorithms() const { return cache_used_; }

  // Timed algorithm choice on cache misses (see above); affects only keys not yet cached.
  void set_tuning(bool on) { tuning_ = on ? GemmTuning::All : GemmTuning::Off; }
  void set_tuning(GemmTuning t) { tuning_ = t; }
  GemmTuning tuning() const { return tuning_; }

 private:
  struct AlgoCacheEntry;
  void* lt_ = nullptr;      // cublasLtHandle_t
  void* cublas_ = nullptr;  // cublasHandle_t
  void* workspace_ = nullptr;
  size_t lt_workspace_bytes_ = 0;
  AlgoCacheEntry* cache_ = nullptr;
  int cache_used_ = 0, cache_next_ = 0;
  void* host_scratch_ = nullptr;
  size_t host_scratch_bytes_ = 0;
  GemmTuning tuning_ = GemmTuning::Off;
  bool tuning_log_ = false;
  struct ShapeLog;  // DM_GEMM_SHAPES=FILE (gemm.cu); null when unset
  ShapeLog* shape_log_ = nullptr;
  // Device copy of C while a beta ≠ 0 product is tuned; grown on first calls per key only.
  void* tune_scratch_ = nullptr;
  size_t tune_scratch_bytes_ = 0;
};

}  // namespace dm::cuda
