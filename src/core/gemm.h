// GEMM through OpenBLAS (cblas). Row-major everywhere.
//   gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc):  C[M,N] = alpha·op(A)·op(B) + beta·C
//   linear(y, x, W, N, in, out):                                 y[N,out] = x[N,in] · W[out,in]ᵀ
//   linear_acc: same but y += ... (backward accumulation, residual adds)
#pragma once
#include <cstdint>

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

// Number of threads the engine uses (OpenMP); set_num_threads also caps OpenBLAS.
int num_threads();
void set_num_threads(int n);

}  // namespace dm
