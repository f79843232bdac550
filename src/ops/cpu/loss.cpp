#include "ops/cpu/loss.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/fastmath.h"

namespace dm {

namespace {

// One row's log-sum-exp and gradient. `fast`: exps through core/fastmath.h in Real (vectorised;
// each z − max ≤ 0), the sum in double. The libm path (every exp in double) serves rows with a
// non-finite logit, so NaN and ∞ still reach the loss (fast_exp maps NaN to a finite value).
template <typename Real>
double row_lse(const Real* z, int64_t V, Real mx, bool fast) {
  double sum = 0;
  if (fast) {
#pragma omp simd reduction(+ : sum)
    for (int64_t v = 0; v < V; ++v) sum += double(fast_exp(Real(z[v] - mx)));
  } else {
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(z[v]) - double(mx));
  }
  return double(mx) + std::log(sum);
}

template <typename Real>
void row_softmax_gradient(const Real* z, int64_t V, double lse, double scale, bool fast, Real* dz) {
  if (fast) {
    const Real lse_r = Real(lse), scale_r = Real(scale);
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) dz[v] = fast_exp(Real(z[v] - lse_r)) * scale_r;
  } else {
    for (int64_t v = 0; v < V; ++v) dz[v] = Real(std::exp(double(z[v]) - lse) * scale);
  }
}

}  // namespace

template <typename Real>
CrossEntropyResult cross_entropy_forward_backward(const Real* logits, const int64_t* targets,
                                                  Real* dlogits, int64_t N, int64_t V, double scale) {
  // The loss in fixed blocks of rows, each summed in order, then the blocks in order: the same
  // bits for any thread count (OpenMP's reduction clause adds the threads' partials in whatever
  // order they finish, which moved the last bit of a resumed run's loss on a 16-core machine).
  // The counts are integers: exact in any order.
  constexpr int64_t kRowBlock = 64;
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  std::vector<double> block_loss(size_t(blocks), 0.0);
  int64_t count = 0, correct = 0;
#pragma omp parallel for schedule(static) reduction(+ : count, correct) if (N * V > 65536)
  for (int64_t block = 0; block < blocks; ++block) {
    for (int64_t n = block * kRowBlock; n < std::min(N, (block + 1) * kRowBlock); ++n) {
      const Real* z = logits + n * V;
      const int64_t y = targets[n];
      if (y < 0 || y >= V) {
        if (dlogits)
          for (int64_t v = 0; v < V; ++v) dlogits[n * V + v] = Real(0);
        continue;
      }
      Real mx = -std::numeric_limits<Real>::infinity();
      int64_t arg = 0;
      for (int64_t v = 0; v < V; ++v)
        if (z[v] > mx) mx = z[v], arg = v;
      double total = 0;  // finite iff every logit is
#pragma omp simd reduction(+ : total)
      for (int64_t v = 0; v < V; ++v) total += double(z[v]);
      const bool fast = std::isfinite(total) && std::isfinite(mx);
      const double lse = row_lse(z, V, mx, fast);
      block_loss[size_t(block)] += lse - double(z[y]);
      count += 1;
      correct += arg == y;
      if (dlogits) {
        Real* dz = dlogits + n * V;
        row_softmax_gradient(z, V, lse, scale, fast, dz);
        dz[y] -= Real(scale);
      }
    }
  }
  double loss = 0;
  for (const double block : block_loss) loss += block;
  return {loss, count, correct};
}

template CrossEntropyResult cross_entropy_forward_backward<float>(const float*, const int64_t*,
                                                                  float*, int64_t, int64_t, double);
template CrossEntropyResult cross_entropy_forward_backward<double>(const double*, const int64_t*,
                                                                   double*, int64_t, int64_t, double);

}  // namespace dm
