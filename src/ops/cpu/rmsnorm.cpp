// RMSNorm forward/backward (see rmsnorm.h for the formulas).
#include "ops/cpu/rmsnorm.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace dm {

namespace {

// r = 1 / sqrt(mean(x²) + eps): the sum of squares in double (rows of 7168 fp32 values lose
// ~4 digits summed in float), the final rsqrt in Real as the reference checkpoints do in fp32.
template <typename Real>
Real rmsnorm_inverse_rms(const Real* x_row, int64_t D, double eps) {
  double sum_of_squares = 0;
  for (int64_t i = 0; i < D; ++i) sum_of_squares += double(x_row[i]) * double(x_row[i]);
  return Real(1) / std::sqrt(Real(sum_of_squares / double(D)) + Real(eps));
}

// Rows per dw pass: small enough for the per-row scale to live on the stack, large enough that
// the column-parallel dw pass amortises its fork.
constexpr int64_t kRmsnormBackwardRowGroup = 256;
// Columns per dw task: contiguous in memory for every row of the group.
constexpr int64_t kRmsnormBackwardColumnChunk = 256;

}  // namespace

template <typename Real>
void rmsnorm_forward(const Real* x, const Real* w, Real* y, int64_t N, int64_t D, double eps) {
  DM_CHECK(N >= 0 && D > 0, "rmsnorm: bad shape N=", N, " D=", D);
#pragma omp parallel for schedule(static) if (N * D > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const Real* x_row = x + n * D;
    Real* y_row = y + n * D;
    const Real inverse_rms = rmsnorm_inverse_rms(x_row, D, eps);
    for (int64_t i = 0; i < D; ++i) y_row[i] = x_row[i] * inverse_rms * w[i];
  }
}

template <typename Real>
void rmsnorm_backward(const Real* x, const Real* w, const Real* dy, Real* dx, Real* dw, int64_t N,
                      int64_t D, double eps) {
  DM_CHECK(N >= 0 && D > 0, "rmsnorm backward: bad shape N=", N, " D=", D);
  Real inverse_rms_of_group[kRmsnormBackwardRowGroup];
  const int64_t num_column_chunks = (D + kRmsnormBackwardColumnChunk - 1) /
                                    kRmsnormBackwardColumnChunk;

  for (int64_t group_start = 0; group_start < N; group_start += kRmsnormBackwardRowGroup) {
    const int64_t group_rows = std::min(kRmsnormBackwardRowGroup, N - group_start);
#pragma omp parallel if (group_rows * D > 16384)
    {
      // dx, row-parallel: d(x·r)/dx contributes r·(w⊙dy) minus the projection on x through r.
#pragma omp for schedule(static)
      for (int64_t g = 0; g < group_rows; ++g) {
        const int64_t n = group_start + g;
        const Real* x_row = x + n * D;
        const Real* dy_row = dy + n * D;
        Real* dx_row = dx + n * D;
        const Real inverse_rms = rmsnorm_inverse_rms(x_row, D, eps);
        inverse_rms_of_group[g] = inverse_rms;
        double weighted_dot = 0;  // Σ_k dy_k w_k x_k
        for (int64_t i = 0; i < D; ++i)
          weighted_dot += double(dy_row[i]) * double(w[i]) * double(x_row[i]);
        const Real projection =
            Real(weighted_dot / double(D)) * inverse_rms * inverse_rms * inverse_rms;
        for (int64_t i = 0; i < D; ++i)
          dx_row[i] += inverse_rms * w[i] * dy_row[i] - x_row[i] * projection;
      }
      // (implicit barrier: the dw pass reads every r of the group)
      // dw, column-parallel: each dw[i] sums the group's rows in row order.
#pragma omp for schedule(static)
      for (int64_t chunk = 0; chunk < num_column_chunks; ++chunk) {
        const int64_t column_start = chunk * kRmsnormBackwardColumnChunk;
        const int64_t column_end = std::min(D, column_start + kRmsnormBackwardColumnChunk);
        for (int64_t g = 0; g < group_rows; ++g) {
          const int64_t n = group_start + g;
          const Real* x_row = x + n * D;
          const Real* dy_row = dy + n * D;
          const Real inverse_rms = inverse_rms_of_group[g];
          for (int64_t i = column_start; i < column_end; ++i)
            dw[i] += dy_row[i] * x_row[i] * inverse_rms;
        }
      }
    }
  }
}

template void rmsnorm_forward<float>(const float*, const float*, float*, int64_t, int64_t, double);
template void rmsnorm_forward<double>(const double*, const double*, double*, int64_t, int64_t,
                                      double);
template void rmsnorm_backward<float>(const float*, const float*, const float*, float*, float*,
                                      int64_t, int64_t, double);
template void rmsnorm_backward<double>(const double*, const double*, const double*, double*,
                                       double*, int64_t, int64_t, double);

}  // namespace dm
