#include "ops/cpu/norm_gated.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/cpu/kda_prep.h"  // kda_sigmoid

namespace dm {
namespace {

// 1 / sqrt(mean(x²) + eps), the sum of squares in double as in norm.cpp.
template <typename Real>
Real rmsnorm_gated_inverse_rms(const Real* x, int64_t D, float eps) {
  double sum_squares = 0;
  for (int64_t i = 0; i < D; ++i) sum_squares += double(x[i]) * x[i];
  return Real(1) / std::sqrt(Real(sum_squares / double(D)) + Real(eps));
}

}  // namespace

template <typename Real>
void rmsnorm_gated_forward(const Real* x, const Real* w, const Real* gate, Real* y, int64_t N,
                           int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (N * D > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const Real* x_row = x + n * D;
    const Real* gate_row = gate + n * D;
    Real* y_row = y + n * D;
    const Real inverse_rms = rmsnorm_gated_inverse_rms(x_row, D, eps);
    for (int64_t i = 0; i < D; ++i)
      y_row[i] = x_row[i] * inverse_rms * w[i] * kda_sigmoid(gate_row[i]);
  }
}

template <typename Real>
void rmsnorm_gated_backward(const Real* x, const Real* w, const Real* gate, const Real* dy,
                            Real* dx, Real* dw, Real* dgate, int64_t N, int64_t D, float eps) {
  // Rows: with n = x·r (r = inverse RMS), s = σ(gate), y = n·w·s:
  //   dgate = dy·n·w·s(1−s);  dn = dy·w·s;  dx = r·(dn − n·mean(dn·n));  dw = Σ_rows dy·n·s.
  // dw is summed in double per block of kRowBlock rows (each block in row order), then the
  // blocks in order: the same bits for any thread count (an OpenMP array reduction adds the
  // threads' partials in whatever order they finish).
  constexpr int64_t kRowBlock = 256;
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  std::vector<double> dw_partial(size_t(blocks * D), 0.0);
#pragma omp parallel for schedule(static) if (N * D > 16384)
  for (int64_t block = 0; block < blocks; ++block) {
    double* dw_sum_data = dw_partial.data() + block * D;
    const int64_t row_end = std::min(N, (block + 1) * kRowBlock);
    for (int64_t row = block * kRowBlock; row < row_end; ++row) {
      const Real* x_row = x + row * D;
      const Real* gate_row = gate + row * D;
      const Real* dy_row = dy + row * D;
      const Real inverse_rms = rmsnorm_gated_inverse_rms(x_row, D, eps);
      double dot = 0;  // Σ dn·n
      for (int64_t i = 0; i < D; ++i) {
        const Real sig = kda_sigmoid(gate_row[i]);
        const Real normed = x_row[i] * inverse_rms;
        dgate[row * D + i] += dy_row[i] * normed * w[i] * sig * (Real(1) - sig);
        dot += double(dy_row[i] * w[i] * sig) * normed;
        dw_sum_data[i] += double(dy_row[i] * normed * sig);
      }
      const Real mean_dot = Real(dot / double(D));
      for (int64_t i = 0; i < D; ++i) {
        const Real sig = kda_sigmoid(gate_row[i]);
        const Real d_normed = dy_row[i] * w[i] * sig;
        dx[row * D + i] += inverse_rms * (d_normed - x_row[i] * inverse_rms * mean_dot);
      }
    }
  }
  for (int64_t i = 0; i < D; ++i) {
    double sum = 0;
    for (int64_t block = 0; block < blocks; ++block) sum += dw_partial[size_t(block * D + i)];
    dw[i] += Real(sum);
  }
}

template void rmsnorm_gated_forward<float>(const float*, const float*, const float*, float*,
                                           int64_t, int64_t, float);
template void rmsnorm_gated_forward<double>(const double*, const double*, const double*, double*,
                                            int64_t, int64_t, float);
template void rmsnorm_gated_backward<float>(const float*, const float*, const float*,
                                            const float*, float*, float*, float*, int64_t,
                                            int64_t, float);
template void rmsnorm_gated_backward<double>(const double*, const double*, const double*,
                                             const double*, double*, double*, double*, int64_t,
                                             int64_t, float);

}  // namespace dm
