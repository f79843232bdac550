// Tests for the gated FFN (SwiGLU / SiTU-GLU) and the MoE router, dispatch plan and grouped expert
// compute, forward and backward (finite differences in double, docs/backward.md). SPEC §1.4–1.6.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "core/arena.h"
#include "core/gemm.h"
#include "ops/cpu/ffn.h"
#include "ops/cpu/moe.h"
#include "test_util.h"

namespace dm {
namespace {

GluActivation swiglu() { return GluActivation{Activation::SwiGLU, 4.0f, 25.0f}; }
GluActivation situ() { return GluActivation{Activation::SiTU, 4.0f, 25.0f}; }

// SiTU closed form evaluated the naive way in long double (no stable-sigmoid trick): an
// independent check of both glu_forward and glu_reference. expl(1e6) = inf gives σ = 0 exactly.
long double situ_closed_form(long double g, long double u, long double beta1, long double beta2) {
  const long double sigmoid_g = 1.0L / (1.0L + std::exp(-g));
  return beta1 * std::tanh(g / beta1) * sigmoid_g * beta2 * std::tanh(u / beta2);
}

std::vector<float> random_vector(size_t n, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

double sigmoid_double(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// ---------------------------------------------------------------------------------------------
// GLU activations

TEST(SituTest, ExtremeInputsAreFiniteBoundedAndMatchReference) {
  const std::vector<float> values = {1e4f, -1e4f, 1e6f, -1e6f, 0.0f, 1e-3f, -1e-3f, 3.0f, -3.0f};
  const GluActivation a = situ();
  std::vector<float> g, u;
  for (float gv : values)
    for (float uv : values) {
      g.push_back(gv);
      u.push_back(uv);
    }
  std::vector<float> h(g.size()), dg(g.size()), du(g.size()), dh(g.size(), 1.0f);
  glu_forward(g.data(), u.data(), h.data(), int64_t(g.size()), a);
  glu_backward(g.data(), u.data(), dh.data(), dg.data(), du.data(), int64_t(g.size()), a);
  const double bound = double(a.beta1) * double(a.beta2);
  double max_abs_err = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "g=" << g[i] << " u=" << u[i]);
    ASSERT_TRUE(std::isfinite(h[i]));
    ASSERT_TRUE(std::isfinite(dg[i]) && std::isfinite(du[i]));
    EXPECT_LE(std::fabs(h[i]), bound);
    const double ref = glu_reference(g[i], u[i], a);
    const long double closed = situ_closed_form(g[i], u[i], a.beta1, a.beta2);
    ASSERT_TRUE(std::isfinite(ref));
    EXPECT_LE(std::fabs(ref), bound);
    EXPECT_NEAR(ref, double(closed), 1e-12 * (1.0 + std::fabs(double(closed))));
    // fp32 result: relative 1e-6 of the value, plus an absolute floor for tiny products.
    EXPECT_NEAR(h[i], ref, 1e-6 * std::fabs(ref) + 1e-12);
    max_abs_err = std::max(max_abs_err, std::fabs(h[i] - ref));
  }
  RecordProperty("situ_extreme_max_abs_err", testing::PrintToString(max_abs_err));
  // Saturation: g, u → +∞ gives β1·β2; g → −∞ gives 0 whatever u.
  EXPECT_FLOAT_EQ(float(glu_reference(1e6, 1e6, a)), 100.0f);
  EXPECT_EQ(glu_reference(-1e6, 1e6, a), 0.0);
}

TEST(SituTest, SwigluIsFiniteForLargeNegativeGate) {
  const GluActivation a = swiglu();
  const std::vector<float> g = {-1e4f, -1e6f, -3e38f, 1e4f, 0.0f};
  const std::vector<float> u = {1e4f, -1e6f, 1.0f, -2.0f, 5.0f};
  std::vector<float> h(g.size()), dg(g.size()), du(g.size()), dh(g.size(), 1.0f);
  glu_forward(g.data(), u.data(), h.data(), int64_t(g.size()), a);
  glu_backward(g.data(), u.data(), dh.data(), dg.data(), du.data(), int64_t(g.size()), a);
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_TRUE(std::isfinite(h[i]) && std::isfinite(dg[i]) && std::isfinite(du[i])) << i;
    EXPECT_NEAR(h[i], glu_reference(g[i], u[i], a), 1e-6 * std::fabs(glu_reference(g[i], u[i], a)));
  }
  EXPECT_EQ(h[0], 0.0f);
  EXPECT_FLOAT_EQ(h[3], -2e4f);
}

TEST(SituTest, EqualsSwigluToFirstOrderNearZero) {
  const GluActivation a_situ = situ(), a_swiglu = swiglu();
  const std::vector<double> magnitudes = {1e-2, -1e-2, 7e-3, -5e-3};
  double max_rel_diff = 0;
  for (double g : magnitudes)
    for (double u : magnitudes) {
      const double s = glu_reference(g, u, a_situ), w = glu_reference(g, u, a_swiglu);
      const double rel = std::fabs(s - w) / std::fabs(w);
      max_rel_diff = std::max(max_rel_diff, rel);
      EXPECT_LT(rel, 1e-3) << "g=" << g << " u=" << u;
      // The difference is third order: SiTU/SwiGLU − 1 = −g²/(3β1²) − u²/(3β2²) + O(4th order).
      const double predicted = -g * g / (3.0 * 16.0) - u * u / (3.0 * 625.0);
      EXPECT_NEAR(s / w - 1.0, predicted, 1e-8) << "g=" << g << " u=" << u;
      // fp32 forward agrees with the same statement.
      const float gf = float(g), uf = float(u);
      float hs, hw;
      glu_forward(&gf, &uf, &hs, 1, a_situ);
      glu_forward(&gf, &uf, &hw, 1, a_swiglu);
      EXPECT_LT(std::fabs(double(hs) - double(hw)) / std::fabs(double(hw)), 1e-3);
    }
  RecordProperty("situ_vs_swiglu_max_rel_diff", testing::PrintToString(max_rel_diff));
  EXPECT_LT(max_rel_diff, 1e-5);  // ≈ 2e-6 at 1e-2: far below the 1e-3 requirement
}

TEST(SituTest, BackwardMatchesFiniteDifferencesOfReference) {
  std::mt19937 rng(7);
  for (const GluActivation& a : {swiglu(), situ()}) {
    std::vector<float> g = random_vector(64, 3.0f, rng), u = random_vector(64, 10.0f, rng);
    std::vector<float> dh = random_vector(64, 1.0f, rng), dg(64), du(64);
    glu_backward(g.data(), u.data(), dh.data(), dg.data(), du.data(), 64, a);
    for (int i = 0; i < 64; ++i) {
      const double step = 1e-5;
      const double fd_g =
          (glu_reference(g[i] + step, u[i], a) - glu_reference(g[i] - step, u[i], a)) / (2 * step) *
          dh[i];
      const double fd_u =
          (glu_reference(g[i], u[i] + step, a) - glu_reference(g[i], u[i] - step, a)) / (2 * step) *
          dh[i];
      EXPECT_NEAR(dg[i], fd_g, 1e-4 * (1.0 + std::fabs(fd_g))) << i;
      EXPECT_NEAR(du[i], fd_u, 1e-4 * (1.0 + std::fabs(fd_u))) << i;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Dense FFN

TEST(FfnTest, ForwardMatchesNaiveLoop) {
  const int64_t N = 13, d = 24, F = 40;
  std::mt19937 rng(11);
  const std::vector<float> x = random_vector(N * d, 1.0f, rng);
  const std::vector<float> w_gate = random_vector(F * d, 0.3f, rng);
  const std::vector<float> w_up = random_vector(F * d, 0.3f, rng);
  const std::vector<float> w_down = random_vector(d * F, 0.2f, rng);
  Arena ws(ffn_forward_workspace_bytes(N, F), "ffn-ws");
  for (const GluActivation& a : {swiglu(), situ()}) {
    std::vector<float> y(N * d), y_ref(N * d);
    ffn_forward(x.data(), w_gate.data(), w_up.data(), w_down.data(), y.data(), N, d, F, a, ws);
    EXPECT_EQ(ws.used(), 0u);  // scratch released
    for (int64_t t = 0; t < N; ++t) {
      std::vector<double> h(F);
      for (int64_t f = 0; f < F; ++f) {
        double g = 0, u = 0;
        for (int64_t j = 0; j < d; ++j) {
          g += double(w_gate[f * d + j]) * x[t * d + j];
          u += double(w_up[f * d + j]) * x[t * d + j];
        }
        h[f] = glu_reference(g, u, a);
      }
      for (int64_t j = 0; j < d; ++j) {
        double acc = 0;
        for (int64_t f = 0; f < F; ++f) acc += double(w_down[j * F + f]) * h[f];
        y_ref[t * d + j] = float(acc);
      }
    }
    const double err = test::rel_rms(y.data(), y_ref.data(), y.size());
    RecordProperty(a.kind == Activation::SiTU ? "ffn_situ_rel_rms" : "ffn_swiglu_rel_rms",
                   testing::PrintToString(err));
    EXPECT_LE(err, 1e-5);
  }
}

// ---------------------------------------------------------------------------------------------
// Router

struct RouteResult {
  std::vector<float> scores, w, cutoff;
  std::vector<int32_t> idx;
};

RouteResult route(const std::vector<float>& logits, const std::vector<float>* bias, int64_t N,
                  const RouterParams& p) {
  RouteResult r;
  r.scores.resize(N * p.num_experts);
  r.idx.resize(N * p.top_k);
  r.w.resize(N * p.top_k);
  r.cutoff.resize(N);
  moe_route(logits.data(), bias ? bias->data() : nullptr, N, p, r.scores.data(), r.idx.data(),
            r.w.data(), r.cutoff.data());
  return r;
}

TEST(MoeRouteTest, HandBuiltTopKBiasChangesSelectionNotWeights) {
  RouterParams p;
  p.num_experts = 6;
  p.top_k = 2;
  const std::vector<float> logits = {2.0f, 1.0f, 0.0f, -1.0f, 3.0f, -2.0f};

  // No bias: s = σ(logits); top-2 = experts 4 (σ(3)) and 0 (σ(2)); cutoff = σ(1).
  RouteResult r = route(logits, nullptr, 1, p);
  for (int e = 0; e < 6; ++e) EXPECT_NEAR(r.scores[e], sigmoid_double(logits[e]), 1e-7);
  EXPECT_EQ(r.idx, (std::vector<int32_t>{0, 4}));
  const double s0 = sigmoid_double(2), s4 = sigmoid_double(3), s3 = sigmoid_double(-1);
  EXPECT_NEAR(r.w[0], s0 / (s0 + s4), 1e-6);
  EXPECT_NEAR(r.w[1], s4 / (s0 + s4), 1e-6);
  EXPECT_NEAR(r.cutoff[0], sigmoid_double(1), 1e-6);

  // Bias +0.9 on expert 3 lifts it to σ(−1) + 0.9 ≈ 1.169, above σ(3): selection {3, 4}; the
  // weights still come from the unbiased σ(−1), σ(3); the cutoff is the biased 3rd value σ(2).
  const std::vector<float> bias = {0.0f, 0.0f, 0.0f, 0.9f, 0.0f, 0.0f};
  r = route(logits, &bias, 1, p);
  EXPECT_EQ(r.idx, (std::vector<int32_t>{3, 4}));
  EXPECT_NEAR(r.w[0], s3 / (s3 + s4), 1e-6);
  EXPECT_NEAR(r.w[1], s4 / (s3 + s4), 1e-6);
  EXPECT_NEAR(r.cutoff[0], s0, 1e-6);
  for (int e = 0; e < 6; ++e) EXPECT_NEAR(r.scores[e], sigmoid_double(logits[e]), 1e-7);

  // Ties go to the lower expert index.
  const std::vector<float> tied = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  r = route(tied, nullptr, 1, p);
  EXPECT_EQ(r.idx, (std::vector<int32_t>{0, 1}));
}

TEST(MoeRouteTest, GroupWithWeakSecondBestIsDropped) {
  RouterParams p;
  p.num_experts = 16;
  p.top_k = 2;
  p.n_group = 4;
  p.topk_group = 2;
  // Group 0 holds the single best expert (1, logit 5) but a weak rest: score σ(5)+σ(−5) = 1.0.
  // Group 1: σ(2)+σ(1.8) ≈ 1.74, group 2: 2σ(1.5) ≈ 1.64, group 3: 2σ(−1) ≈ 0.54.
  const std::vector<float> logits = {-5,   5,  -5,   -5, 2,  1.8f, -4, -4,
                                     1.5f, -4, 1.5f, -4, -1, -1,   -3, -3};
  RouteResult r = route(logits, nullptr, 1, p);
  EXPECT_EQ(r.idx, (std::vector<int32_t>{4, 5}));
  EXPECT_NEAR(r.cutoff[0], sigmoid_double(1.5), 1e-6);  // from a kept group, not σ(5)
  for (int32_t e : r.idx) EXPECT_NE(e, 1);

  // Without groups the lone best expert wins.
  RouterParams flat = p;
  flat.n_group = 1;
  flat.topk_group = 1;
  r = route(logits, nullptr, 1, flat);
  EXPECT_EQ(r.idx, (std::vector<int32_t>{1, 4}));

  // Group scores use biased values: lifting expert 0 by 1.0 makes group 0 score ≈ 2.0 → kept.
  std::vector<float> bias(16, 0.0f);
  bias[0] = 1.0f;
  r = route(logits, &bias, 1, p);
  EXPECT_EQ(r.idx, (std::vector<int32_t>{0, 1}));

  // Excluded experts are never selectable even when all kept biased values are negative
  // (the HF reference's 0.0 mask fill would pick a dropped-group expert here).
  std::vector<float> negative_bias(16, -2.0f);
  r = route(logits, &negative_bias, 1, p);
  EXPECT_EQ(r.idx, (std::vector<int32_t>{4, 5}));
}

TEST(MoeRouteTest, RenormaliseAndScaling) {
  RouterParams p;
  p.num_experts = 8;
  p.top_k = 3;
  p.scaling = 2.5f;
  std::mt19937 rng(3);
  const int64_t N = 20;
  const std::vector<float> logits = random_vector(N * 8, 1.5f, rng);
  RouteResult r = route(logits, nullptr, N, p);
  p.renormalize = false;
  RouteResult raw = route(logits, nullptr, N, p);
  for (int64_t t = 0; t < N; ++t) {
    double sum = 0;
    for (int i = 0; i < 3; ++i) {
      sum += r.w[t * 3 + i];
      EXPECT_EQ(r.idx[t * 3 + i], raw.idx[t * 3 + i]);
      EXPECT_NEAR(raw.w[t * 3 + i], 2.5 * sigmoid_double(logits[t * 8 + raw.idx[t * 3 + i]]), 1e-6);
      if (i > 0) {
        EXPECT_LT(r.idx[t * 3 + i - 1], r.idx[t * 3 + i]);
      }
    }
    EXPECT_NEAR(sum, 2.5, 1e-5);
  }
  // Cutoff is −inf when fewer than k+1 experts are eligible.
  RouterParams all;
  all.num_experts = 4;
  all.top_k = 4;
  r = route(std::vector<float>{0.1f, 0.2f, 0.3f, 0.4f}, nullptr, 1, all);
  EXPECT_EQ(r.cutoff[0], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(r.idx, (std::vector<int32_t>{0, 1, 2, 3}));
}

// Brute force: sort everything, no incremental top lists. Returns the selection in biased order.
std::vector<int> brute_force_select(const float* biased, const RouterParams& p, float* cutoff) {
  const int E = p.num_experts, group_size = E / p.n_group;
  std::vector<bool> eligible(E, true);
  if (p.n_group > 1) {
    std::vector<std::pair<float, int>> groups;
    for (int g = 0; g < p.n_group; ++g) {
      std::vector<float> v(biased + g * group_size, biased + (g + 1) * group_size);
      std::sort(v.rbegin(), v.rend());
      groups.push_back({v[0] + v[1], g});
    }
    std::stable_sort(groups.begin(), groups.end(),
                     [](auto& a, auto& b) { return a.first > b.first; });
    for (int e = 0; e < E; ++e) eligible[e] = false;
    for (int i = 0; i < p.topk_group; ++i)
      for (int j = 0; j < group_size; ++j) eligible[groups[i].second * group_size + j] = true;
  }
  std::vector<int> order;
  for (int e = 0; e < E; ++e)
    if (eligible[e]) order.push_back(e);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return biased[a] > biased[b]; });
  *cutoff = int(order.size()) > p.top_k ? biased[order[p.top_k]]
                                        : -std::numeric_limits<float>::infinity();
  order.resize(p.top_k);
  return order;
}

TEST(MoeRouteTest, RandomTokensMatchBruteForce) {
  RouterParams p;
  p.num_experts = 16;
  p.top_k = 4;
  p.n_group = 4;
  p.topk_group = 2;
  p.scaling = 1.7f;
  std::mt19937 rng(5);
  const int64_t N = 2000;  // N·E above the parallel threshold
  const std::vector<float> logits = random_vector(N * 16, 2.0f, rng);
  const std::vector<float> bias = random_vector(16, 0.3f, rng);
  RouteResult r = route(logits, &bias, N, p);
  for (int64_t t = 0; t < N; ++t) {
    std::vector<float> biased(16);
    for (int e = 0; e < 16; ++e) biased[e] = r.scores[t * 16 + e] + bias[e];
    float cutoff;
    std::vector<int> sel = brute_force_select(biased.data(), p, &cutoff);
    std::sort(sel.begin(), sel.end());
    double sum = 0;
    for (int e : sel) sum += r.scores[t * 16 + e];
    for (int i = 0; i < 4; ++i) {
      ASSERT_EQ(r.idx[t * 4 + i], sel[i]) << "token " << t;
      EXPECT_NEAR(r.w[t * 4 + i], 1.7 * r.scores[t * 16 + sel[i]] / sum, 1e-6);
    }
    EXPECT_EQ(r.cutoff[t], cutoff);
  }
}

TEST(MoeRouteTest, RejectsBadParams) {
  RouterParams p;
  p.num_experts = 16;
  p.top_k = 4;
  p.n_group = 4;
  p.topk_group = 1;  // one group of 4 experts can supply top_k = 4
  std::vector<float> logits(16, 0.0f), scores(16), w(4);
  std::vector<int32_t> idx(4);
  EXPECT_NO_THROW(
      moe_route(logits.data(), nullptr, 1, p, scores.data(), idx.data(), w.data(), nullptr));
  p.top_k = 5;  // … but not 5
  EXPECT_THROW(
      moe_route(logits.data(), nullptr, 1, p, scores.data(), idx.data(), w.data(), nullptr), Error);
  p.top_k = 2;
  p.n_group = 3;  // 16 not divisible by 3
  EXPECT_THROW(
      moe_route(logits.data(), nullptr, 1, p, scores.data(), idx.data(), w.data(), nullptr), Error);
}

// ---------------------------------------------------------------------------------------------
// Dispatch plan and grouped experts

// Random routing: k distinct experts per token drawn from `allowed` (all experts if too few).
std::vector<int32_t> random_routing(int64_t N, int k, int E, const std::vector<int>& allowed,
                                    std::mt19937& rng) {
  std::vector<int> pool;
  for (int e : allowed)
    if (e < E) pool.push_back(e);
  if (int(pool.size()) < k) {
    pool.resize(E);
    std::iota(pool.begin(), pool.end(), 0);
  }
  std::vector<int32_t> idx(N * k);
  for (int64_t t = 0; t < N; ++t) {
    std::shuffle(pool.begin(), pool.end(), rng);
    std::vector<int32_t> chosen(pool.begin(), pool.begin() + k);
    std::sort(chosen.begin(), chosen.end());
    std::copy(chosen.begin(), chosen.end(), idx.begin() + t * k);
  }
  return idx;
}

void check_plan(const MoePlan& plan, const std::vector<int32_t>& idx, int64_t N, int k, int E) {
  ASSERT_EQ(plan.offsets[0], 0);
  ASSERT_EQ(plan.offsets[E], N * k);
  std::vector<int> seen(N * k, 0);
  for (int e = 0; e < E; ++e) {
    ASSERT_LE(plan.offsets[e], plan.offsets[e + 1]);
    for (int64_t r = plan.offsets[e]; r < plan.offsets[e + 1]; ++r) {
      const int32_t t = plan.token[r], s = plan.slot[r];
      ASSERT_TRUE(t >= 0 && t < N && s >= 0 && s < k);
      EXPECT_EQ(idx[t * k + s], e);
      ++seen[t * k + s];
      if (r > plan.offsets[e]) {
        EXPECT_LT(plan.token[r - 1], t);  // stable: token order within an expert
      }
    }
  }
  for (int c : seen) ASSERT_EQ(c, 1);
}

TEST(MoePlanTest, OffsetsCoverAllRowsAndEachPairOnce) {
  std::mt19937 rng(9);
  for (int E : {4, 16})
    for (int k : {1, 2, 4})
      for (int64_t N : {int64_t(0), int64_t(1), int64_t(7), int64_t(200)}) {
        SCOPED_TRACE(testing::Message() << "E=" << E << " k=" << k << " N=" << N);
        const std::vector<int32_t> idx = random_routing(N, k, E, {0, 2, 3, 5, 7}, rng);
        Arena a(1 << 16, "plan");
        MoePlan plan;
        moe_plan_build(idx.data(), N, k, E, &plan, a);
        check_plan(plan, idx, N, k, E);
      }
  std::vector<int32_t> bad = {0, 4};
  Arena a(1 << 12, "plan");
  MoePlan plan;
  EXPECT_THROW(moe_plan_build(bad.data(), 1, 2, 4, &plan, a), Error);
}

struct ExpertCase {
  int64_t N;
  int E, k;
};

void run_expert_case(const ExpertCase& c, const GluActivation& act, std::mt19937& rng,
                     double* worst_err, bool* had_empty_expert) {
  const int64_t Din = 24, F = 40;
  const std::vector<float> gate = random_vector(c.E * F * Din, 0.3f, rng);
  const std::vector<float> up = random_vector(c.E * F * Din, 0.3f, rng);
  const std::vector<float> down = random_vector(c.E * Din * F, 0.2f, rng);
  const std::vector<float> x = random_vector(c.N * Din, 1.0f, rng);
  ExpertWeights ew{gate.data(), up.data(), down.data(), c.E, Din, F};
  // Restricting tokens to a subset leaves some experts without rows (no GEMM for them).
  std::vector<int> allowed;
  for (int e = 0; e < c.E; ++e)
    if (e % 3 != 1) allowed.push_back(e);
  const std::vector<int32_t> idx = random_routing(c.N, c.k, c.E, allowed, rng);
  std::uniform_real_distribution<float> wdist(0.1f, 1.0f);
  std::vector<float> w(c.N * c.k);
  for (float& v : w) v = wdist(rng);

  Arena plan_arena(1 << 20, "plan");
  MoePlan plan;
  moe_plan_build(idx.data(), c.N, c.k, c.E, &plan, plan_arena);
  check_plan(plan, idx, c.N, c.k, c.E);
  for (int e = 0; e < c.E; ++e)
    if (plan.offsets[e + 1] == plan.offsets[e]) *had_empty_expert = true;

  // Sized by the published bound: must be enough (the arena throws when exhausted).
  Arena ws(moe_experts_forward_workspace_bytes(c.N, c.k, ew, num_threads()), "moe-ws");
  std::vector<float> y(c.N * Din, 123.0f), y_ref(c.N * Din);
  moe_experts_forward(x.data(), plan, w.data(), ew, act, y.data(), ws);
  EXPECT_EQ(ws.used(), 0u);
  moe_experts_reference(x.data(), idx.data(), w.data(), c.N, c.k, ew, act, y_ref.data());
  const double err = test::rel_rms(y.data(), y_ref.data(), y.size());
  EXPECT_LE(err, 1e-5);
  *worst_err = std::max(*worst_err, err);
}

TEST(MoeExpertsTest, GroupedForwardMatchesReference) {
  std::mt19937 rng(13);
  double worst_err = 0;
  bool had_empty_expert = false;
  for (const GluActivation& act : {swiglu(), situ()})
    for (int E : {4, 16})
      for (int k : {1, 2, 4})
        for (int64_t N : {int64_t(1), int64_t(7), int64_t(200)}) {
          SCOPED_TRACE(testing::Message()
                       << "act=" << int(act.kind) << " E=" << E << " k=" << k << " N=" << N);
          run_expert_case({N, E, k}, act, rng, &worst_err, &had_empty_expert);
        }
  // An expert with more than one tile of rows (700·2/4 ≈ 350 > kMoeExpertTileRows).
  run_expert_case({700, 4, 2}, situ(), rng, &worst_err, &had_empty_expert);
  EXPECT_TRUE(had_empty_expert);
  RecordProperty("moe_experts_worst_rel_rms", testing::PrintToString(worst_err));
  std::printf("[          ] moe_experts_forward vs reference: worst rel RMS %.3g\n", worst_err);
}

TEST(MoeExpertsTest, ResultIndependentOfThreadCount) {
  std::mt19937 rng(17);
  const int64_t N = 300, Din = 32, F = 48;
  const int E = 8, k = 2;
  const std::vector<float> gate = random_vector(E * F * Din, 0.3f, rng);
  const std::vector<float> up = random_vector(E * F * Din, 0.3f, rng);
  const std::vector<float> down = random_vector(E * Din * F, 0.2f, rng);
  const std::vector<float> x = random_vector(N * Din, 1.0f, rng);
  ExpertWeights ew{gate.data(), up.data(), down.data(), E, Din, F};
  const std::vector<int32_t> idx = random_routing(N, k, E, {}, rng);
  std::vector<float> w(N * k, 0.5f);
  Arena plan_arena(1 << 20, "plan");
  MoePlan plan;
  moe_plan_build(idx.data(), N, k, E, &plan, plan_arena);
  const int threads_before = num_threads();
  Arena ws(moe_experts_forward_workspace_bytes(N, k, ew, std::max(threads_before, 4)), "moe-ws");
  std::vector<float> y_many(N * Din), y_one(N * Din);
  set_num_threads(std::max(threads_before, 4));
  moe_experts_forward(x.data(), plan, w.data(), ew, situ(), y_many.data(), ws);
  set_num_threads(1);
  moe_experts_forward(x.data(), plan, w.data(), ew, situ(), y_one.data(), ws);
  set_num_threads(threads_before);
  // Each tile's GEMMs see the same rows whatever thread runs them, and the combine order is fixed.
  EXPECT_EQ(y_many, y_one);
}

// ---------------------------------------------------------------------------------------------
// Backward: finite differences in double (docs/backward.md)

std::vector<double> random_doubles(size_t n, double stddev, std::mt19937& rng) {
  std::normal_distribution<double> dist(0.0, stddev);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central difference of loss() in `param` with a step relative to its magnitude.
template <typename Loss>
double central_difference(double& param, Loss&& loss) {
  const double saved = param, step = 1e-6 * std::max(1.0, std::fabs(saved));
  param = saved + step;
  const double plus = loss();
  param = saved - step;
  const double minus = loss();
  param = saved;
  return (plus - minus) / (2 * step);
}

// Compares the analytic gradient of every entry of `param` (or `max_entries` random ones) with
// central differences; returns max |fd − analytic| / max(max |analytic|, 1e-6) over the entries
// checked (the floor makes an identically zero gradient, e.g. k = 1 renormalised weights, an
// absolute check instead of 0/0).
template <typename Loss>
double fd_check_tensor(std::vector<double>& param, const std::vector<double>& analytic,
                       Loss&& loss, std::mt19937& rng, size_t max_entries = 1u << 30) {
  std::vector<size_t> entries(param.size());
  std::iota(entries.begin(), entries.end(), size_t(0));
  if (entries.size() > max_entries) {
    std::shuffle(entries.begin(), entries.end(), rng);
    entries.resize(max_entries);
  }
  double max_diff = 0, max_analytic = 1e-6;
  for (size_t i : entries) {
    const double fd = central_difference(param[i], loss);
    max_diff = std::max(max_diff, std::fabs(fd - analytic[i]));
    max_analytic = std::max(max_analytic, std::fabs(analytic[i]));
  }
  return max_diff / max_analytic;
}

TEST(SituTest, GluBackwardAtExtremeInputsIsFiniteAndMatchesFiniteDifferences) {
  const std::vector<double> values = {1e4, -1e4, 1e3, -1e3, 50.0, -50.0, 3.0, -3.0, 1e-3, 0.0};
  double worst = 0;
  for (const GluActivation& a : {swiglu(), situ()})
    for (double g : values)
      for (double u : values) {
        SCOPED_TRACE(testing::Message() << "act=" << int(a.kind) << " g=" << g << " u=" << u);
        const double dh = 1.0;
        double dg = 0, du = 0;
        glu_backward(&g, &u, &dh, &dg, &du, 1, a);
        ASSERT_TRUE(std::isfinite(dg) && std::isfinite(du));
        const float gf = float(g), uf = float(u), dhf = 1.0f;
        float dgf = 0, duf = 0;
        glu_backward(&gf, &uf, &dhf, &dgf, &duf, 1, a);
        ASSERT_TRUE(std::isfinite(dgf) && std::isfinite(duf));
        double gv = g, uv = u;
        const double fd_g = central_difference(gv, [&] { return glu_reference(gv, u, a); });
        const double fd_u = central_difference(uv, [&] { return glu_reference(g, uv, a); });
        const double err_g = std::fabs(dg - fd_g) / (1.0 + std::fabs(fd_g));
        const double err_u = std::fabs(du - fd_u) / (1.0 + std::fabs(fd_u));
        EXPECT_LE(err_g, 1e-6);
        EXPECT_LE(err_u, 1e-6);
        worst = std::max({worst, err_g, err_u});
      }
  RecordProperty("glu_backward_extreme_worst_err", testing::PrintToString(worst));
  std::printf("[          ] glu_backward at |g|,|u| up to 1e4 vs FD: worst rel err %.3g\n", worst);
}

TEST(FfnTest, BackwardMatchesFiniteDifferencesInDouble) {
  const int64_t N = 5, d = 6, F = 7;
  std::mt19937 rng(21);
  double worst = 0;
  for (const GluActivation& a : {swiglu(), situ()}) {
    std::vector<double> x = random_doubles(N * d, 1.0, rng);
    std::vector<double> wg = random_doubles(F * d, 0.6, rng), wu = random_doubles(F * d, 0.6, rng);
    std::vector<double> wd = random_doubles(d * F, 0.5, rng);
    const std::vector<double> R = random_doubles(N * d, 1.0, rng);
    Arena ws(ffn_backward_workspace_bytes(N, F, sizeof(double)) +
                 ffn_forward_workspace_bytes(N, F, sizeof(double)),
             "ffn-ws");
    auto loss = [&] {
      std::vector<double> y(N * d);
      ffn_forward(x.data(), wg.data(), wu.data(), wd.data(), y.data(), N, d, F, a, ws);
      return dot(y, R);
    };
    // Analytic, recomputing g/u.
    std::vector<double> dx(N * d, 0.0), dwg(F * d, 0.0), dwu(F * d, 0.0), dwd(d * F, 0.0);
    ffn_backward(x.data(), wg.data(), wu.data(), wd.data(), nullptr, nullptr, R.data(), dx.data(),
                 dwg.data(), dwu.data(), dwd.data(), N, d, F, a, ws);
    EXPECT_EQ(ws.used(), 0u);
    // Same with the forward's saved g/u; accumulating on top doubles every gradient.
    std::vector<double> saved_gate(N * F), saved_up(N * F), y(N * d);
    ffn_forward(x.data(), wg.data(), wu.data(), wd.data(), y.data(), N, d, F, a, ws,
                saved_gate.data(), saved_up.data());
    EXPECT_NEAR(dot(y, R), loss(), 1e-12 * std::fabs(loss()));
    std::vector<double> dx2 = dx, dwg2 = dwg, dwu2 = dwu, dwd2 = dwd;
    ffn_backward(x.data(), wg.data(), wu.data(), wd.data(), saved_gate.data(), saved_up.data(),
                 R.data(), dx2.data(), dwg2.data(), dwu2.data(), dwd2.data(), N, d, F, a, ws);
    for (size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx2[i], 2 * dx[i], 1e-12);
    for (size_t i = 0; i < dwg.size(); ++i) EXPECT_NEAR(dwg2[i], 2 * dwg[i], 1e-12);
    for (size_t i = 0; i < dwd.size(); ++i) EXPECT_NEAR(dwd2[i], 2 * dwd[i], 1e-12);

    const double err_x = fd_check_tensor(x, dx, loss, rng);
    const double err_g = fd_check_tensor(wg, dwg, loss, rng);
    const double err_u = fd_check_tensor(wu, dwu, loss, rng);
    const double err_d = fd_check_tensor(wd, dwd, loss, rng);
    std::printf("[          ] ffn_backward %s FD rel err: x %.2g gate %.2g up %.2g down %.2g\n",
                a.kind == Activation::SiTU ? "SiTU" : "SwiGLU", err_x, err_g, err_u, err_d);
    for (double e : {err_x, err_g, err_u, err_d}) {
      EXPECT_LE(e, 1e-7);
      worst = std::max(worst, e);
    }
  }
  RecordProperty("ffn_backward_fd_worst_rel_err", testing::PrintToString(worst));
}

struct RouteBackwardCase {
  int E, k, n_group, topk_group;
  bool renormalize;
  float scaling;
};

TEST(MoeRouteBackwardTest, MatchesFiniteDifferencesWithSelectionFixed) {
  std::mt19937 rng(23);
  const int64_t N = 6;
  double worst = 0;
  for (const RouteBackwardCase& c : {RouteBackwardCase{8, 3, 1, 1, true, 2.5f},
                                     RouteBackwardCase{8, 2, 1, 1, false, 1.7f},
                                     RouteBackwardCase{16, 2, 4, 2, true, 1.0f},
                                     RouteBackwardCase{6, 1, 1, 1, true, 1.0f}}) {
    SCOPED_TRACE(testing::Message() << "E=" << c.E << " k=" << c.k << " groups=" << c.n_group
                                    << " renorm=" << c.renormalize);
    RouterParams p;
    p.num_experts = c.E;
    p.top_k = c.k;
    p.n_group = c.n_group;
    p.topk_group = c.topk_group;
    p.renormalize = c.renormalize;
    p.scaling = c.scaling;
    std::vector<double> logits = random_doubles(N * c.E, 1.5, rng);
    const std::vector<double> bias = random_doubles(c.E, 0.1, rng);
    const std::vector<double> R = random_doubles(N * c.k, 1.0, rng);
    std::vector<double> scores(N * c.E), w(N * c.k), cutoff(N);
    std::vector<int32_t> idx(N * c.k), base_idx(N * c.k);
    moe_route(logits.data(), bias.data(), N, p, scores.data(), base_idx.data(), w.data(),
              cutoff.data());
    bool selection_changed = false;
    auto loss = [&] {
      moe_route(logits.data(), bias.data(), N, p, scores.data(), idx.data(), w.data(), nullptr);
      selection_changed |= idx != base_idx;
      return dot(w, R);
    };
    loss();
    std::vector<double> dlogits(N * c.E, 0.0);
    moe_route_backward(scores.data(), base_idx.data(), R.data(), N, p, dlogits.data());
    // Only selected experts receive gradient: the bias and the unselected scores do not enter p.
    for (int64_t t = 0; t < N; ++t)
      for (int e = 0; e < c.E; ++e)
        if (std::find(base_idx.begin() + t * c.k, base_idx.begin() + (t + 1) * c.k, e) ==
            base_idx.begin() + (t + 1) * c.k) {
          EXPECT_EQ(dlogits[t * c.E + e], 0.0);
        }
    const double err = fd_check_tensor(logits, dlogits, loss, rng);
    EXPECT_FALSE(selection_changed) << "a perturbation flipped the selection; widen the margins";
    EXPECT_LE(err, 1e-7);
    worst = std::max(worst, err);
  }
  RecordProperty("moe_route_backward_fd_worst_rel_err", testing::PrintToString(worst));
  std::printf("[          ] moe_route_backward FD: worst rel err %.3g\n", worst);
}

// Experts in double: y = Σ_slot w·E_j(x); FD for x, every expert weight and the routing weights.
TEST(MoeExpertsBackwardTest, MatchesFiniteDifferencesInDouble) {
  std::mt19937 rng(29);
  const int64_t N = 9, Din = 5, F = 6;
  const int E = 4, k = 2;
  double worst = 0;
  for (const GluActivation& act : {swiglu(), situ()}) {
    std::vector<double> x = random_doubles(N * Din, 1.0, rng);
    std::vector<double> gate = random_doubles(E * F * Din, 0.6, rng);
    std::vector<double> up = random_doubles(E * F * Din, 0.6, rng);
    std::vector<double> down = random_doubles(E * Din * F, 0.5, rng);
    std::vector<double> w = random_doubles(N * k, 0.7, rng);
    const std::vector<double> R = random_doubles(N * Din, 1.0, rng);
    // Expert 3 gets no rows: its gradient must stay exactly zero.
    const std::vector<int32_t> idx = random_routing(N, k, E, {0, 1, 2}, rng);
    Arena plan_arena(1 << 16, "plan");
    MoePlan plan;
    moe_plan_build(idx.data(), N, k, E, &plan, plan_arena);
    const ExpertWeightsT<double> ew{gate.data(), up.data(), down.data(), E, Din, F};
    const ExpertWeights ew_shape{nullptr, nullptr, nullptr, E, Din, F};
    Arena ws(std::max(moe_experts_forward_workspace_bytes(N, k, ew_shape, num_threads(), 8),
                      moe_experts_backward_workspace_bytes(N, k, ew_shape, num_threads(), 8)),
             "moe-ws");
    auto loss = [&] {
      std::vector<double> y(N * Din);
      moe_experts_forward(x.data(), plan, w.data(), ew, act, y.data(), ws);
      return dot(y, R);
    };
    std::vector<double> dx(N * Din, 0.0), dw(N * k, 0.0), dgate(gate.size(), 0.0),
        dup(up.size(), 0.0), ddown(down.size(), 0.0);
    moe_experts_backward(x.data(), plan, w.data(), ew, act, nullptr, nullptr, R.data(), dx.data(),
                         dw.data(), ExpertGradsT<double>{dgate.data(), dup.data(), ddown.data()},
                         ws);
    EXPECT_EQ(ws.used(), 0u);
    for (int64_t i = 3 * F * Din; i < 4 * F * Din; ++i) EXPECT_EQ(dgate[i], 0.0);

    // Saved g/u give the same gradients (up to GEMM vs GEMV rounding).
    std::vector<double> saved_gate(N * k * F), saved_up(N * k * F), y(N * Din);
    moe_experts_forward(x.data(), plan, w.data(), ew, act, y.data(), ws, saved_gate.data(),
                        saved_up.data());
    std::vector<double> dx_saved(N * Din, 0.0), dw_saved(N * k, 0.0), ddown_saved(down.size(), 0.0);
    moe_experts_backward(x.data(), plan, w.data(), ew, act, saved_gate.data(), saved_up.data(),
                         R.data(), dx_saved.data(), dw_saved.data(),
                         ExpertGradsT<double>{nullptr, nullptr, ddown_saved.data()}, ws);
    EXPECT_LE(test::rel_rms(dx_saved.data(), dx.data(), dx.size()), 1e-13);
    EXPECT_LE(test::rel_rms(dw_saved.data(), dw.data(), dw.size()), 1e-13);
    EXPECT_LE(test::rel_rms(ddown_saved.data(), ddown.data(), ddown.size()), 1e-13);

    const double err_x = fd_check_tensor(x, dx, loss, rng);
    const double err_w = fd_check_tensor(w, dw, loss, rng);
    const double err_g = fd_check_tensor(gate, dgate, loss, rng);
    const double err_u = fd_check_tensor(up, dup, loss, rng);
    const double err_d = fd_check_tensor(down, ddown, loss, rng);
    std::printf("[          ] moe_experts_backward %s FD rel err: x %.2g weights %.2g gate %.2g "
                "up %.2g down %.2g\n",
                act.kind == Activation::SiTU ? "SiTU" : "SwiGLU", err_x, err_w, err_g, err_u, err_d);
    for (double e : {err_x, err_w, err_g, err_u, err_d}) {
      EXPECT_LE(e, 1e-7);
      worst = std::max(worst, e);
    }
  }
  RecordProperty("moe_experts_backward_fd_worst_rel_err", testing::PrintToString(worst));
}

}  // namespace
}  // namespace dm
