#include "ops/cpu/kda_prep.h"

#include <cmath>

#include "ops/cpu/norm.h"

namespace dm {

void short_conv_silu_forward(const float* x, const float* w, const float* tail, float* y, int64_t B,
                             int64_t T, int64_t C, int Kc) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      float* yr = y + (b * T + t) * C;
      for (int64_t c = 0; c < C; ++c) {
        float acc = 0;
        for (int j = 0; j < Kc; ++j) {
          const int64_t src = t - (Kc - 1) + j;
          float xv;
          if (src >= 0) xv = x[(b * T + src) * C + c];
          else if (tail) xv = tail[(b * (Kc - 1) + (Kc - 1 + src)) * C + c];
          else continue;
          acc += w[c * Kc + j] * xv;
        }
        yr[c] = siluf(acc);
      }
    }
}

void kda_gate_forward(const float* f, const float* A_log, const float* dt_bias, float* g, int64_t N,
                      int64_t H, int64_t K, KdaGateKind kind, float lower_bound) {
#pragma omp parallel for schedule(static) if (N * H * K > 65536)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      const float a = std::exp(A_log[h]);
      for (int64_t i = 0; i < K; ++i) {
        const int64_t c = h * K + i;
        const float z = f[n * H * K + c] + dt_bias[c];
        g[n * H * K + c] = kind == KdaGateKind::Softplus ? -a * softplusf(z)
                                                         : lower_bound * sigmoidf_stable(a * z);
      }
    }
}

}  // namespace dm
