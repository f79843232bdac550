#include "ops/cpu/attnres.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include <vector>

namespace dm {

void attnres_forward(const float* const* src, int S, const float* query, const float* norm_w,
                     float* out, float* weights, int64_t N, int64_t D, float eps) {
  constexpr int kMaxSources = 256;  // blocks + 1; the full model has 93/12 + 2
  DM_CHECK(S >= 1 && S <= kMaxSources, "attnres: ", S, " sources (1..", kMaxSources, " supported)");
#pragma omp parallel for schedule(static) if (N * D * S > 65536)
  for (int64_t n = 0; n < N; ++n) {
    float logit[kMaxSources];
    float mx = -INFINITY;
    for (int j = 0; j < S; ++j) {
      const float* v = src[j] + n * D;
      double ss = 0, dot = 0;
      for (int64_t d = 0; d < D; ++d) {
        ss += double(v[d]) * v[d];
        dot += double(v[d]) * norm_w[d] * query[d];
      }
      logit[j] = float(dot / std::sqrt(ss / D + eps));
      mx = std::max(mx, logit[j]);
    }
    float den = 0;
    for (int j = 0; j < S; ++j) den += (logit[j] = std::exp(logit[j] - mx));
    for (int j = 0; j < S; ++j) logit[j] /= den;
    float* o = out + n * D;
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0;
      for (int j = 0; j < S; ++j) acc += logit[j] * src[j][n * D + d];
      o[d] = acc;
    }
    if (weights)
      for (int j = 0; j < S; ++j) weights[n * S + j] = logit[j];
  }
}

}  // namespace dm
