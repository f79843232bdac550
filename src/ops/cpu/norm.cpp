#include "ops/cpu/norm.h"

namespace dm {

void rmsnorm_forward(const float* x, const float* w, float* y, int64_t N, int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (N * D > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * D;
    float* yr = y + n * D;
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * xr[i];
    const float r = 1.0f / std::sqrt(float(ss / D) + eps);
    for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * r * w[i];
  }
}

void rmsnorm_gated_forward(const float* x, const float* w, const float* gate, float* y, int64_t N,
                           int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (N * D > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * D;
    const float* gr = gate + n * D;
    float* yr = y + n * D;
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * xr[i];
    const float r = 1.0f / std::sqrt(float(ss / D) + eps);
    for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * r * w[i] * sigmoidf_stable(gr[i]);
  }
}

void sigmoid_inplace(float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) x[i] = sigmoidf_stable(x[i]);
}

void add_inplace(float* y, const float* b, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] += b[i];
}

}  // namespace dm
