// GEMM through OpenBLAS (cblas). Row-major everywhere.
//   gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc):  C[M,N] = alpha·op(A)·op(B) + beta·C
//   linear(y, x, W, N, in, out):                                 y[N,out] = x[N,in] · W[out,in]ᵀ
//   linear_acc: same but y += ... (backward accumulation, residual adds)
#pragma once
#include <cstdint>

#include "core/threading.h"

namespace dm {

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, double alpha,
          const double* A, int64_t lda, const double* B, int64_t ldb, double beta, double* C,
          int64_t ldc);

// y[N,out] = x[N,in] · W[out,in]ᵀ
inline void linear(float* y, const float* x, const float* W, int64_t N, int64_t in, int64_t out) {
  gemm(false, true, N, out, in, 1.0f, x, in, W, in, 0.0f, y, out);
}
// y[N,out] += x[N,in] · W[out,in]ᵀ
inline void linear_acc(float* y, const float* x, const float* W, int64_t N, int64_t in,
                       int64_t out) {
  gemm(false, true, N, out, in, 1.0f, x, in, W, in, 1.0f, y, out);
}

// Pins OpenBLAS to one thread while it lives (when `active`), restoring the caller's count after.
// Used around OpenMP regions whose threads each issue small GEMMs: a threaded OpenBLAS (pthread
// build) would split every small GEMM over its own pool from all threads at once
// (oversubscription; measured ~20× slower on the KDA chunk loop).
class BlasSingleThreadScope {
 public:
  explicit BlasSingleThreadScope(bool active = true);
  ~BlasSingleThreadScope();
  BlasSingleThreadScope(const BlasSingleThreadScope&) = delete;
  BlasSingleThreadScope& operator=(const BlasSingleThreadScope&) = delete;

 private:
  int saved_ = 1;
};

// Number of threads the engine uses: num_threads() (core/threading.h); set_num_threads also caps
// OpenBLAS.
void set_num_threads(int n);

}  // namespace dm

namespace dm {
// OpenBLAS (0.3.21, DYNAMIC_ARCH) falls back to its SSE3 "Prescott" kernels on CPUs whose model it
// cannot name (common on cloud VMs), halving GEMM speed. If that happened and the CPU has AVX2,
// re-executes the program with OPENBLAS_CORETYPE set (the variable is read when the library
// loads, before main). Call first thing in main; returns normally when nothing needs doing.
void blas_ensure_fast_kernels(int argc, char** argv);
// Name of the kernel set OpenBLAS uses ("Haswell", "SkylakeX", ...).
const char* blas_core_name();
}  // namespace dm
