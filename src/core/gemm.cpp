#include "core/gemm.h"

#include <cblas.h>

#include <cstdlib>
#include <string>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace dm {

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              int(M), int(N), int(K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
          int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              int(M), int(N), int(K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

BlasSingleThreadScope::BlasSingleThreadScope(bool active) {
  if (!active) return;
  saved_ = openblas_get_num_threads();
  if (saved_ > 1) openblas_set_num_threads(1);
}

BlasSingleThreadScope::~BlasSingleThreadScope() {
  if (saved_ > 1) openblas_set_num_threads(saved_);
}

int num_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void set_num_threads(int n) {
  if (n <= 0) return;
#ifdef _OPENMP
  omp_set_num_threads(n);
#endif
  openblas_set_num_threads(n);
}

}  // namespace dm

extern "C" char* openblas_get_corename(void);

namespace dm {

const char* blas_core_name() { return openblas_get_corename(); }

void blas_ensure_fast_kernels(int argc, char** argv) {
  (void)argc;
  if (std::getenv("OPENBLAS_CORETYPE") || std::getenv("DM_NO_BLAS_REEXEC")) return;
  const std::string core = openblas_get_corename();
  if (core != "Prescott" && core != "Core2" && core != "Nehalem" && core != "Atom") return;
  __builtin_cpu_init();
  const char* want = __builtin_cpu_supports("avx512f") ? "SkylakeX"
                     : __builtin_cpu_supports("avx2") ? "Haswell" : nullptr;
  if (!want) return;
  setenv("OPENBLAS_CORETYPE", want, 1);
  execv("/proc/self/exe", argv);  // only returns on failure: keep running with the slow kernels
}

}  // namespace dm
