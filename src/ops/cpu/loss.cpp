#include "ops/cpu/loss.h"

#include <cmath>
#include <limits>

namespace dm {

template <typename Real>
CrossEntropyResult cross_entropy_forward_backward(const Real* logits, const int64_t* targets,
                                                  Real* dlogits, int64_t N, int64_t V, double scale) {
  double loss = 0;
  int64_t count = 0, correct = 0;
#pragma omp parallel for schedule(static) reduction(+ : loss, count, correct) if (N * V > 65536)
  for (int64_t n = 0; n < N; ++n) {
    const Real* z = logits + n * V;
    const int64_t y = targets[n];
    if (y < 0 || y >= V) {
      if (dlogits)
        for (int64_t v = 0; v < V; ++v) dlogits[n * V + v] = Real(0);
      continue;
    }
    double mx = -std::numeric_limits<double>::infinity();
    int64_t arg = 0;
    for (int64_t v = 0; v < V; ++v)
      if (double(z[v]) > mx) mx = double(z[v]), arg = v;
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(z[v]) - mx);
    const double lse = mx + std::log(sum);
    loss += lse - double(z[y]);
    count += 1;
    correct += arg == y;
    if (dlogits) {
      Real* dz = dlogits + n * V;
      for (int64_t v = 0; v < V; ++v) dz[v] = Real(std::exp(double(z[v]) - lse) * scale);
      dz[y] -= Real(scale);
    }
  }
  return {loss, count, correct};
}

template CrossEntropyResult cross_entropy_forward_backward<float>(const float*, const int64_t*,
                                                                  float*, int64_t, int64_t, double);
template CrossEntropyResult cross_entropy_forward_backward<double>(const double*, const int64_t*,
                                                                   double*, int64_t, int64_t, double);

}  // namespace dm
