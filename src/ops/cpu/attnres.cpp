#include "ops/cpu/attnres.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/gemm.h"
#include "core/threading.h"

namespace dm {

namespace {
// Softmax weights a[S] and the per-source r_j, s_j = Σ_d V_jd γ_d w_d of token n.
template <typename Real>
void attnres_token_weights(const Real* const* src, int S, const Real* query, const Real* norm_w,
                           int64_t n, int64_t D, float eps, double* a, double* r, double* s) {
  double mx = -INFINITY;
  for (int j = 0; j < S; ++j) {
    const Real* v = src[j] + n * D;
    double ss = 0, dot = 0;
    // Vectorised reduction (lane-wise partial sums in double; the order differs from a serial
    // loop by rounding only).
#pragma omp simd reduction(+ : ss, dot)
    for (int64_t d = 0; d < D; ++d) {
      ss += double(v[d]) * v[d];
      dot += double(v[d]) * norm_w[d] * query[d];
    }
    r[j] = 1.0 / std::sqrt(ss / double(D) + eps);
    s[j] = dot;
    a[j] = r[j] * dot;
    mx = std::max(mx, a[j]);
  }
  double den = 0;
  for (int j = 0; j < S; ++j) den += (a[j] = std::exp(a[j] - mx));
  for (int j = 0; j < S; ++j) a[j] /= den;
}
}  // namespace

template <typename Real>
void attnres_forward(const Real* const* src, int S, const Real* query, const Real* norm_w, Real* out,
                     Real* weights, int64_t N, int64_t D, float eps) {
  DM_CHECK(S >= 1 && S <= kAttnResMaxSources, "attnres: ", S, " sources (1..", kAttnResMaxSources,
           " supported)");
#pragma omp parallel for schedule(static) if (N * D * S > 65536)
  for (int64_t n = 0; n < N; ++n) {
    double a[kAttnResMaxSources], r[kAttnResMaxSources], s[kAttnResMaxSources];
    attnres_token_weights(src, S, query, norm_w, n, D, eps, a, r, s);
    Real* o = out + n * D;  // may alias a source row: each d reads all sources before writing
    for (int64_t d = 0; d < D; ++d) {
      double acc = 0;
      for (int j = 0; j < S; ++j) acc += a[j] * double(src[j][n * D + d]);
      o[d] = Real(acc);
    }
    if (weights)
      for (int j = 0; j < S; ++j) weights[n * S + j] = Real(a[j]);
  }
}

size_t attnres_backward_workspace_bytes(int64_t D, size_t real_size) {
  return Arena::round_up(size_t(num_threads()) * size_t(D) * sizeof(double)) + 64;
}

template <typename Real>
void attnres_backward(const Real* const* src, int S, const Real* query, const Real* norm_w,
                      const Real* dout, Real* const* dsrc, Real* dquery, Real* dnorm_w, int64_t N,
                      int64_t D, float eps, Arena& ws) {
  DM_CHECK(S >= 1 && S <= kAttnResMaxSources, "attnres: ", S, " sources");
  ArenaScope scope(ws);
  const int threads = num_threads();
  // G_d = Σ_n Σ_j c_nj V_njd with c = dlogit·r: dw_d += G_d γ_d, dγ_d += G_d w_d. One partial per
  // thread, summed in thread order so the result does not depend on scheduling.
  double* partial = ws.alloc<double>(size_t(threads) * D);
  std::fill(partial, partial + size_t(threads) * D, 0.0);
#pragma omp parallel num_threads(threads) if (N * D * S > 65536)
  {
    double* G = partial + size_t(thread_index()) * D;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      double a[kAttnResMaxSources], r[kAttnResMaxSources], s[kAttnResMaxSources];
      double da[kAttnResMaxSources];
      attnres_token_weights(src, S, query, norm_w, n, D, eps, a, r, s);
      const Real* g = dout + n * D;
      double mean_da = 0;
      for (int j = 0; j < S; ++j) {
        const Real* v = src[j] + n * D;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += double(g[d]) * v[d];
        da[j] = dot;
        mean_da += a[j] * dot;
      }
      for (int j = 0; j < S; ++j) {
        const Real* v = src[j] + n * D;
        const double dl = a[j] * (da[j] - mean_da);  // softmax backward
        const double c = dl * r[j];
        const double c3 = dl * s[j] * r[j] * r[j] * r[j] / double(D);  // through r_j
        if (dsrc[j]) {
          Real* dv = dsrc[j] + n * D;
          for (int64_t d = 0; d < D; ++d)
            dv[d] += Real(a[j] * g[d] + c * double(norm_w[d]) * query[d] - c3 * v[d]);
        }
        for (int64_t d = 0; d < D; ++d) G[d] += c * v[d];
      }
    }
  }
  for (int t = 0; t < threads; ++t) {
    const double* G = partial + size_t(t) * D;
    for (int64_t d = 0; d < D; ++d) {
      if (dquery) dquery[d] += Real(G[d] * norm_w[d]);
      if (dnorm_w) dnorm_w[d] += Real(G[d] * query[d]);
    }
  }
}

template void attnres_forward<float>(const float* const*, int, const float*, const float*, float*,
                                     float*, int64_t, int64_t, float);
template void attnres_forward<double>(const double* const*, int, const double*, const double*,
                                      double*, double*, int64_t, int64_t, float);
template void attnres_backward<float>(const float* const*, int, const float*, const float*,
                                      const float*, float* const*, float*, float*, int64_t, int64_t,
                                      float, Arena&);
template void attnres_backward<double>(const double* const*, int, const double*, const double*,
                                       const double*, double* const*, double*, double*, int64_t,
                                       int64_t, float, Arena&);

}  // namespace dm
