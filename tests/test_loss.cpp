// Fused softmax cross-entropy on the CPU (ops/cpu/loss.h): loss, gradient and counts against a
// long-double evaluation of the formula, in float and double, and non-finite logits reaching the
// loss (the fast exp path maps NaN to a finite value, so those rows must take the libm path).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "ops/cpu/loss.h"

namespace dm {
namespace {

struct Reference {
  long double loss = 0;
  std::vector<long double> dlogits;
  int64_t count = 0, correct = 0;
};

template <typename Real>
Reference reference(const std::vector<Real>& z, const std::vector<int64_t>& targets, int64_t V,
                    double scale) {
  const int64_t N = int64_t(targets.size());
  Reference r;
  r.dlogits.assign(z.size(), 0.0L);
  for (int64_t n = 0; n < N; ++n) {
    if (targets[n] < 0) continue;
    const Real* row = z.data() + n * V;
    long double mx = row[0];
    int64_t arg = 0;
    for (int64_t v = 1; v < V; ++v)
      if (row[v] > mx) mx = row[v], arg = v;
    long double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp((long double)row[v] - mx);
    const long double lse = mx + std::log(sum);
    r.loss += lse - row[targets[n]];
    r.count += 1;
    r.correct += arg == targets[n];
    for (int64_t v = 0; v < V; ++v)
      r.dlogits[size_t(n * V + v)] = std::exp((long double)row[v] - lse) * scale;
    r.dlogits[size_t(n * V + targets[n])] -= scale;
  }
  return r;
}

template <typename Real>
void check_against_reference(double loss_tol, double grad_tol) {
  const int64_t N = 6, V = 5003;
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 3.0);
  std::vector<Real> z(size_t(N * V));
  for (Real& x : z) x = Real(normal(rng));
  const std::vector<int64_t> targets = {0, 17, -1, V - 1, 4000, 2};
  const double scale = 1.0 / 5.0;
  std::vector<Real> dz(z.size(), Real(99));
  const CrossEntropyResult got = cross_entropy_forward_backward(z.data(), targets.data(),
                                                                dz.data(), N, V, scale);
  const Reference want = reference(z, targets, V, scale);
  EXPECT_EQ(got.count, want.count);
  EXPECT_EQ(got.correct, want.correct);
  EXPECT_NEAR(got.loss_sum, double(want.loss), loss_tol * double(std::fabs(want.loss)));
  double max_err = 0;
  for (size_t i = 0; i < dz.size(); ++i)
    max_err = std::max(max_err, double(std::fabs((long double)dz[i] - want.dlogits[i])));
  EXPECT_LE(max_err, grad_tol);
  for (int64_t v = 0; v < V; ++v) EXPECT_EQ(dz[size_t(2 * V + v)], Real(0)) << "ignored row";
}

TEST(CrossEntropy, FloatMatchesTheFormula) { check_against_reference<float>(1e-6, 1e-7); }
TEST(CrossEntropy, DoubleMatchesTheFormula) { check_against_reference<double>(1e-13, 1e-15); }

TEST(CrossEntropy, NonFiniteLogitsReachTheLoss) {
  const int64_t V = 64;
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity()}) {
    std::vector<float> z(size_t(2 * V), 0.5f);
    z[size_t(V + 9)] = bad;  // second row only
    const std::vector<int64_t> targets = {3, 3};
    std::vector<float> dz(z.size());
    const CrossEntropyResult r = cross_entropy_forward_backward(z.data(), targets.data(),
                                                                dz.data(), 2, V, 1.0);
    EXPECT_TRUE(std::isnan(r.loss_sum)) << "logit " << bad;
    EXPECT_FLOAT_EQ(dz[0], 1.0f / float(V)) << "the finite row is unaffected";
  }
}

}  // namespace
}  // namespace dm
