// Templated RMSNorm (ops/cpu/rmsnorm.h): finite differences of the backward in double, the
// accumulate convention, the float forward against the formula (and in place), and float vs double on
// shapes that cross the backward's row-group and column-chunk boundaries.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "ops/cpu/rmsnorm.h"
#include "test_util.h"

namespace dm {
namespace {

template <typename Real>
std::vector<Real> random_values(size_t n, uint32_t seed, double mean = 0.0, double stddev = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(mean, stddev);
  std::vector<Real> out(n);
  for (auto& x : out) x = Real(normal(rng));
  return out;
}

TEST(RmsNormBackward, FiniteDifferencesInDouble) {
  const int64_t N = 5, D = 7;
  const double eps = 1e-6;
  std::vector<double> x = random_values<double>(size_t(N * D), 1u);
  std::vector<double> w = random_values<double>(size_t(D), 2u, 1.0, 0.3);
  const std::vector<double> R = random_values<double>(size_t(N * D), 3u);
  x[3] = 1e-3;  // a small entry and a tiny-norm row exercise the eps term
  for (int64_t i = 0; i < D; ++i) x[4 * D + i] *= 1e-3;

  std::vector<double> dx(x.size(), 0.0), dw(w.size(), 0.0);
  rmsnorm_backward(x.data(), w.data(), R.data(), dx.data(), dw.data(), N, D, eps);

  std::vector<double> y(x.size());
  auto loss = [&]() {
    rmsnorm_forward(x.data(), w.data(), y.data(), N, D, eps);
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += y[i] * R[i];
    return l;
  };
  auto check = [&](std::vector<double>& input, const std::vector<double>& gradient,
                   const char* name) {
    double max_relative_error = 0;
    for (size_t i = 0; i < input.size(); ++i) {
      const double saved = input[i], h = 1e-6 * std::max(1e-3, std::abs(saved));
      input[i] = saved + h;
      const double plus = loss();
      input[i] = saved - h;
      const double minus = loss();
      input[i] = saved;
      const double numeric = (plus - minus) / (2 * h);
      max_relative_error = std::max(
          max_relative_error, std::abs(numeric - gradient[i]) / std::max(1.0, std::abs(numeric)));
    }
    std::printf("  rmsnorm FD d%s: max rel error %.3g\n", name, max_relative_error);
    EXPECT_LE(max_relative_error, 1e-6) << name;
  };
  check(x, dx, "x");
  check(w, dw, "w");

  // Accumulation: a second call adds the same amounts again.
  std::vector<double> dx2 = dx, dw2 = dw;
  rmsnorm_backward(x.data(), w.data(), R.data(), dx2.data(), dw2.data(), N, D, eps);
  for (size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx2[i], 2 * dx[i], 1e-14 * (1 + std::abs(dx[i])));
  for (size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw2[i], 2 * dw[i], 1e-14 * (1 + std::abs(dw[i])));
}

TEST(RmsNormForward, FloatMatchesFormulaAndMayAlias) {
  const int64_t N = 33, D = 300;
  const std::vector<float> x = random_values<float>(size_t(N * D), 5u);
  const std::vector<float> w = random_values<float>(size_t(D), 6u, 1.0, 0.2);
  std::vector<float> expected(x.size());
  for (int64_t n = 0; n < N; ++n) {  // y = x · rsqrt(mean(x²) + eps) · w, in double
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(x[size_t(n * D + i)]) * x[size_t(n * D + i)];
    const double r = 1.0 / std::sqrt(ss / double(D) + 1e-5);
    for (int64_t i = 0; i < D; ++i) expected[size_t(n * D + i)] = float(x[size_t(n * D + i)] * r * w[size_t(i)]);
  }
  std::vector<float> ours(x.size());
  dm::rmsnorm_forward<float>(x.data(), w.data(), ours.data(), N, D, 1e-5f);
  EXPECT_LE(dm::test::rel_rms(ours.data(), expected.data(), ours.size()), 1e-6);
  expected = ours;
  std::vector<float> in_place = x;
  dm::rmsnorm_forward<float>(in_place.data(), w.data(), in_place.data(), N, D, 1e-5f);
  EXPECT_EQ(in_place, expected);
}

TEST(RmsNormBackward, FloatMatchesDoubleAcrossRowGroupsAndColumnChunks) {
  // N = 600 spans three row groups of 256, D = 700 three column chunks of 256.
  const int64_t N = 600, D = 700;
  const double eps = 1e-6;
  const std::vector<double> x = random_values<double>(size_t(N * D), 7u);
  const std::vector<double> w = random_values<double>(size_t(D), 8u, 1.0, 0.2);
  const std::vector<double> dy = random_values<double>(size_t(N * D), 9u);
  std::vector<double> dx(x.size(), 0.0), dw(w.size(), 0.0);
  rmsnorm_backward(x.data(), w.data(), dy.data(), dx.data(), dw.data(), N, D, eps);

  const std::vector<float> xf(x.begin(), x.end()), wf(w.begin(), w.end()), dyf(dy.begin(), dy.end());
  std::vector<float> dxf(x.size(), 0.0f), dwf(w.size(), 0.0f);
  rmsnorm_backward(xf.data(), wf.data(), dyf.data(), dxf.data(), dwf.data(), N, D, eps);
  const std::vector<double> dxf_double(dxf.begin(), dxf.end()), dwf_double(dwf.begin(), dwf.end());
  const double err_dx = test::rel_rms(dxf_double.data(), dx.data(), dx.size());
  const double err_dw = test::rel_rms(dwf_double.data(), dw.data(), dw.size());
  std::printf("  rmsnorm float vs double: dx %.3g dw %.3g\n", err_dx, err_dw);
  EXPECT_LE(err_dx, 1e-5);
  EXPECT_LE(err_dw, 1e-5);

  // Reference dw straight from the formula (row-group bookkeeping must not drop rows).
  std::vector<double> dw_expected(size_t(D), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += x[n * D + i] * x[n * D + i];
    const double r = 1.0 / std::sqrt(ss / D + eps);
    for (int64_t i = 0; i < D; ++i) dw_expected[i] += dy[n * D + i] * x[n * D + i] * r;
  }
  EXPECT_LE(test::rel_rms(dw.data(), dw_expected.data(), dw.size()), 1e-13);
}

}  // namespace
}  // namespace dm
