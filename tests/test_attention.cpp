// Tests for the CPU causal attention (flash-style vs double reference) and RoPE / YaRN tables.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>
#include <vector>

#include "core/arena.h"
#include "ops/cpu/attention.h"
#include "test_util.h"

namespace dm {
namespace {

std::vector<float> random_normal_vector(size_t n, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> out(n);
  for (auto& x : out) x = normal(rng);
  return out;
}

struct AttentionInputs {
  AttnShape shape;
  std::vector<float> q, k, v;
};

AttentionInputs make_attention_inputs(const AttnShape& shape, uint32_t seed,
                                      float qk_stddev = 1.0f) {
  AttentionInputs in;
  in.shape = shape;
  in.q = random_normal_vector(size_t(shape.B * shape.T * shape.H * shape.Dqk), seed, qk_stddev);
  in.k = random_normal_vector(size_t(shape.B * shape.T * shape.H * shape.Dqk), seed + 1,
                              qk_stddev);
  in.v = random_normal_vector(size_t(shape.B * shape.T * shape.H * shape.Dv), seed + 2);
  return in;
}

// lse [B, H, T] computed straight from the definition in double.
std::vector<double> direct_log_sum_exp(const AttentionInputs& in, double scale) {
  const AttnShape& s = in.shape;
  std::vector<double> lse(size_t(s.B * s.H * s.T));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t t = 0; t < s.T; ++t) {
        std::vector<double> scores;
        for (int64_t j = 0; j <= t; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < s.Dqk; ++d)
            dot += double(in.q[((b * s.T + t) * s.H + h) * s.Dqk + d]) *
                   double(in.k[((b * s.T + j) * s.H + h) * s.Dqk + d]);
          scores.push_back(scale * dot);
        }
        double mx = -INFINITY;
        for (double x : scores) mx = std::max(mx, x);
        double sum = 0;
        for (double x : scores) sum += std::exp(x - mx);
        lse[(b * s.H + h) * s.T + t] = mx + std::log(sum);
      }
  return lse;
}

struct AttentionCase {
  int64_t B, T, H, Dqk, Dv;
  int block;
};

class AttentionFlashVsReference : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(AttentionFlashVsReference, OutputAndLogSumExpMatch) {
  const AttentionCase c = GetParam();
  const AttnShape shape{c.B, c.T, c.H, c.Dqk, c.Dv};
  const AttentionInputs in = make_attention_inputs(shape, 1234u + uint32_t(c.T));
  const float scale = 1.0f / std::sqrt(float(c.Dqk));
  const size_t out_size = size_t(c.B * c.T * c.H * c.Dv);

  Arena ws(attention_causal_workspace_bytes(shape, c.block), "attn-test");
  std::vector<float> flash_out(out_size, NAN), ref_out(out_size, NAN);
  std::vector<float> flash_lse(size_t(c.B * c.H * c.T), NAN);
  attention_causal_forward(in.q.data(), in.k.data(), in.v.data(), flash_out.data(),
                           flash_lse.data(), shape, scale, ws, c.block);
  EXPECT_EQ(ws.used(), 0u) << "scratch must be released on return";
  attention_causal_reference(in.q.data(), in.k.data(), in.v.data(), ref_out.data(), shape, scale);

  const double err = test::rel_rms(flash_out.data(), ref_out.data(), out_size);
  std::printf("  attention B=%lld T=%lld H=%lld Dqk=%lld Dv=%lld block=%d: rel RMS %.3g\n",
              (long long)c.B, (long long)c.T, (long long)c.H, (long long)c.Dqk, (long long)c.Dv,
              c.block, err);
  EXPECT_LE(err, 1e-5);

  const std::vector<double> expected_lse = direct_log_sum_exp(in, scale);
  double max_lse_error = 0;
  for (size_t i = 0; i < expected_lse.size(); ++i)
    max_lse_error = std::max(max_lse_error, std::abs(double(flash_lse[i]) - expected_lse[i]));
  std::printf("  lse max abs error %.3g\n", max_lse_error);
  EXPECT_LE(max_lse_error, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    AttentionShapes, AttentionFlashVsReference,
    ::testing::Values(AttentionCase{1, 1, 1, 8, 8, 16}, AttentionCase{1, 1, 1, 8, 8, 64},
                      AttentionCase{2, 100, 3, 48, 32, 16}, AttentionCase{2, 100, 3, 48, 32, 64},
                      AttentionCase{1, 257, 2, 192, 128, 16},
                      AttentionCase{1, 257, 2, 192, 128, 64},
                      // block not dividing T, block of 1 (every tile is a diagonal/full tile)
                      AttentionCase{1, 37, 2, 16, 24, 7}, AttentionCase{1, 9, 1, 4, 4, 1}));

TEST(AttentionCausal, FirstRowCopiesFirstValue) {
  // Causality: token 0 sees only itself, so o[0] = v[0] whatever the scores are.
  const AttnShape shape{1, 50, 2, 8, 8};
  const AttentionInputs in = make_attention_inputs(shape, 7u);
  Arena ws(attention_causal_workspace_bytes(shape, 16), "attn-test");
  std::vector<float> out(in.v.size());
  attention_causal_forward(in.q.data(), in.k.data(), in.v.data(), out.data(), nullptr, shape,
                           0.3f, ws, 16);
  for (int64_t h = 0; h < shape.H; ++h)
    for (int64_t d = 0; d < shape.Dv; ++d)
      EXPECT_FLOAT_EQ(out[h * shape.Dv + d], in.v[h * shape.Dv + d]);
}

TEST(AttentionCausal, LargeMagnitudeScoresStayFinite) {
  // q, k entries ~N(0, 10²) with Dqk 16 and scale 1: scores have std ~400, peaks above 1e3.
  // Naive exp would overflow at 88; the running max must keep everything finite.
  const AttnShape shape{1, 150, 2, 16, 16};
  const AttentionInputs in = make_attention_inputs(shape, 99u, 10.0f);
  const float scale = 1.0f;
  double max_abs_score = 0;
  for (int64_t t = 0; t < shape.T; ++t)
    for (int64_t j = 0; j <= t; ++j) {
      double dot = 0;
      for (int64_t d = 0; d < shape.Dqk; ++d)
        dot += in.q[(t * shape.H) * shape.Dqk + d] * in.k[(j * shape.H) * shape.Dqk + d];
      max_abs_score = std::max(max_abs_score, std::abs(dot));
    }
  ASSERT_GT(max_abs_score, 1e3);

  Arena ws(attention_causal_workspace_bytes(shape, 32), "attn-test");
  std::vector<float> flash_out(in.v.size()), ref_out(in.v.size());
  std::vector<float> lse(size_t(shape.H * shape.T));
  attention_causal_forward(in.q.data(), in.k.data(), in.v.data(), flash_out.data(), lse.data(),
                           shape, scale, ws, 32);
  attention_causal_reference(in.q.data(), in.k.data(), in.v.data(), ref_out.data(), shape, scale);
  for (float x : flash_out) ASSERT_TRUE(std::isfinite(x));
  for (float x : lse) ASSERT_TRUE(std::isfinite(x));
  // Scores of magnitude 1e3 carry fp32 rounding ~1e-4 absolute, i.e. relative error of that
  // order in individual softmax weights; averaged over the output it measures ~2e-6, so the
  // bound is looser than the O(1)-score case.
  const double err = test::rel_rms(flash_out.data(), ref_out.data(), flash_out.size());
  std::printf("  large-magnitude rel RMS %.3g\n", err);
  EXPECT_LE(err, 2e-5);
}

TEST(AttentionCausal, WorkspaceTooSmallThrows) {
  const AttnShape shape{1, 64, 1, 8, 8};
  const AttentionInputs in = make_attention_inputs(shape, 3u);
  Arena ws(64, "tiny");
  std::vector<float> out(in.v.size());
  EXPECT_THROW(attention_causal_forward(in.q.data(), in.k.data(), in.v.data(), out.data(),
                                        nullptr, shape, 1.0f, ws, 16),
               Error);
}

// ---------------------------------------------------------------------------------------------
// RoPE

struct RopeTables {
  std::vector<float> cos, sin;
};
RopeTables build_tables(const RopeParams& p, int64_t positions) {
  RopeTables t;
  t.cos.resize(size_t(positions * p.dim / 2));
  t.sin.resize(size_t(positions * p.dim / 2));
  rope_build_tables(p, positions, t.cos.data(), t.sin.data());
  return t;
}

TEST(RopeInterleaved, RotationPreservesPairNormsAndLeavesOtherDims) {
  RopeParams p;
  p.dim = 64;
  const int64_t positions = 5000, rows = 40, stride = 200, offset = 128;
  const RopeTables tables = build_tables(p, positions);
  std::vector<float> x = random_normal_vector(size_t(rows * stride), 11u);
  const std::vector<float> original = x;
  std::vector<int64_t> pos(rows);
  std::mt19937 rng(5);
  for (auto& q : pos) q = int64_t(rng() % positions);
  rope_apply_interleaved(x.data(), rows, stride, offset, p.dim, pos.data(), tables.cos.data(),
                         tables.sin.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < stride; ++c)
      if (c < offset || c >= offset + p.dim) EXPECT_EQ(x[r * stride + c], original[r * stride + c]);
    for (int i = 0; i < p.dim / 2; ++i) {
      const float* a = &original[r * stride + offset + 2 * i];
      const float* b = &x[r * stride + offset + 2 * i];
      const double norm_before = std::hypot(double(a[0]), double(a[1]));
      const double norm_after = std::hypot(double(b[0]), double(b[1]));
      EXPECT_NEAR(norm_after, norm_before, 1e-5 * (1 + norm_before));
    }
  }
}

double dot_product(const float* a, const float* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += double(a[i]) * double(b[i]);
  return s;
}

TEST(RopeInterleaved, DotProductDependsOnlyOnPositionDifference) {
  for (bool yarn : {false, true}) {
    RopeParams p;
    p.dim = 64;
    p.yarn = yarn;
    p.factor = 40;
    const int64_t positions = 9000;
    const RopeTables tables = build_tables(p, positions);
    const std::vector<float> q = random_normal_vector(size_t(p.dim), 21u);
    const std::vector<float> k = random_normal_vector(size_t(p.dim), 22u);
    auto rotated_dot = [&](int64_t query_position, int64_t key_position) {
      std::vector<float> qr = q, kr = k;
      rope_apply_interleaved(qr.data(), 1, p.dim, 0, p.dim, &query_position, tables.cos.data(),
                             tables.sin.data());
      rope_apply_interleaved(kr.data(), 1, p.dim, 0, p.dim, &key_position, tables.cos.data(),
                             tables.sin.data());
      return dot_product(qr.data(), kr.data(), p.dim);
    };
    const double amplitude_sq = std::pow(yarn ? 0.1 * std::log(40.0) + 1.0 : 1.0, 2);
    const double qk_scale = std::sqrt(dot_product(q.data(), q.data(), p.dim) *
                                      dot_product(k.data(), k.data(), p.dim)) * amplitude_sq;
    for (auto [pq, pk] : {std::pair<int64_t, int64_t>{10, 3}, {500, 17}, {4000, 4000}, {7, 90}})
      for (int64_t shift : {1, 33, 4096}) {
        const double base = rotated_dot(pq, pk), shifted = rotated_dot(pq + shift, pk + shift);
        EXPECT_NEAR(shifted, base, 2e-5 * qk_scale)
            << "yarn=" << yarn << " p=" << pq << " p'=" << pk << " shift=" << shift;
      }
  }
}

TEST(RopeYarn, FactorOneEqualsPlainRope) {
  RopeParams plain;
  plain.dim = 64;
  RopeParams yarn = plain;
  yarn.yarn = true;
  yarn.factor = 1.0;
  yarn.mscale = 1.0;
  yarn.mscale_all_dim = 1.0;
  const RopeTables a = build_tables(plain, 3000), b = build_tables(yarn, 3000);
  for (size_t i = 0; i < a.cos.size(); ++i) {
    ASSERT_NEAR(a.cos[i], b.cos[i], 1e-6);
    ASSERT_NEAR(a.sin[i], b.sin[i], 1e-6);
  }
  EXPECT_EQ(rope_softmax_scale_factor(yarn), 1.0);
  EXPECT_EQ(rope_softmax_scale_factor(plain), 1.0);
}

// Expected YaRN frequency written out independently from the formula (DeepSeek-V3 reference):
// high-frequency pairs (i ≤ lo) keep θ^(−2i/D), low-frequency pairs (i ≥ hi) become θ^(−2i/D)/s.
double expected_yarn_frequency(int i, int D, double theta, double s, double L0, double beta_fast,
                               double beta_slow) {
  const double pi = std::numbers::pi;
  const double corr_fast = D * std::log(L0 / (2 * pi * beta_fast)) / (2 * std::log(theta));
  const double corr_slow = D * std::log(L0 / (2 * pi * beta_slow)) / (2 * std::log(theta));
  const double lo = std::max(0.0, std::floor(corr_fast));
  double hi = std::min(double(D - 1), std::ceil(corr_slow));
  if (hi == lo) hi += 0.001;
  double ramp = (i - lo) / (hi - lo);
  ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
  const double f = 1.0 / std::pow(theta, 2.0 * i / D);
  return f * (1 - ramp) + (f / s) * ramp;
}

TEST(RopeYarn, Factor40FrequenciesMatchHandComputation) {
  // D=64, θ=1e4, L0=4096: corr(32) = 64·ln(4096/(64π))/(2 ln 1e4) ≈ 10.47 → lo = 10;
  // corr(1) = 64·ln(4096/(2π))/(2 ln 1e4) ≈ 22.5 → hi = 23.
  const int D = 64;
  const double theta = 10000, s = 40, L0 = 4096;
  const double pi = std::numbers::pi;
  EXPECT_EQ(std::floor(D * std::log(L0 / (2 * pi * 32)) / (2 * std::log(theta))), 10.0);
  EXPECT_EQ(std::ceil(D * std::log(L0 / (2 * pi * 1)) / (2 * std::log(theta))), 23.0);

  RopeParams p;
  p.dim = D;
  p.theta = theta;
  p.yarn = true;
  p.factor = s;
  p.original_max_position = L0;
  p.beta_fast = 32;
  p.beta_slow = 1;
  p.mscale = 1.0;
  p.mscale_all_dim = 1.0;  // equal → cos/sin unscaled
  const int64_t positions = 4096;
  const RopeTables t = build_tables(p, positions);

  // Spot values: pair 0 untouched (f=1), pair 10 still extrapolated, pair 15 on the ramp
  // (ramp 5/13), pairs 23 and 31 fully interpolated (θ^(−2i/D)/40).
  EXPECT_NEAR(expected_yarn_frequency(0, D, theta, s, L0, 32, 1), 1.0, 1e-15);
  EXPECT_NEAR(expected_yarn_frequency(10, D, theta, s, L0, 32, 1), std::pow(theta, -20.0 / 64),
              1e-15);
  EXPECT_NEAR(expected_yarn_frequency(15, D, theta, s, L0, 32, 1),
              std::pow(theta, -30.0 / 64) * (8.0 / 13 + 5.0 / 13 / 40), 1e-15);
  EXPECT_NEAR(expected_yarn_frequency(31, D, theta, s, L0, 32, 1),
              std::pow(theta, -62.0 / 64) / 40, 1e-18);

  for (int i : {0, 5, 10, 11, 15, 22, 23, 31}) {
    const double f = expected_yarn_frequency(i, D, theta, s, L0, 32, 1);
    for (int64_t pos : {1, 7, 100, 1000, 4095}) {
      const size_t idx = size_t(pos * (D / 2) + i);
      EXPECT_NEAR(t.cos[idx], std::cos(pos * f), 2e-6 + 1e-7 * pos * f) << "i=" << i
                                                                        << " pos=" << pos;
      EXPECT_NEAR(t.sin[idx], std::sin(pos * f), 2e-6 + 1e-7 * pos * f) << "i=" << i
                                                                        << " pos=" << pos;
    }
  }

  // With the DeepSeek default mscale_all_dim = 0 the tables carry get_mscale(40, 1).
  p.mscale_all_dim = 0.0;
  const RopeTables scaled = build_tables(p, positions);
  const double amplitude = 0.1 * std::log(40.0) + 1.0;
  for (size_t idx = 0; idx < scaled.cos.size(); idx += 97) {
    EXPECT_NEAR(scaled.cos[idx], amplitude * t.cos[idx], 2e-6);
    EXPECT_NEAR(scaled.sin[idx], amplitude * t.sin[idx], 2e-6);
  }
}

TEST(RopeYarn, SoftmaxScaleFactorIsMscaleSquared) {
  RopeParams p;
  p.dim = 64;
  p.yarn = true;
  p.factor = 40;
  p.mscale = 1.0;
  p.mscale_all_dim = 1.0;
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(rope_softmax_scale_factor(p), m * m, 1e-12);
  p.mscale_all_dim = 0.0;
  EXPECT_EQ(rope_softmax_scale_factor(p), 1.0);
  p.mscale_all_dim = 0.707;
  EXPECT_NEAR(rope_softmax_scale_factor(p), std::pow(0.1 * 0.707 * std::log(40.0) + 1.0, 2),
              1e-12);
}

TEST(RopeInterleaved, MatchesHuggingFaceDeinterleavedRotateHalf) {
  // HF DeepSeek-V3 apply_rotary_pos_emb: x viewed as [D/2, 2], transposed to [2, D/2]
  // (→ [x0, x2, …, x1, x3, …]), then x·cat(cos, cos) + rotate_half(x)·cat(sin, sin) with
  // rotate_half([a, b]) = [−b, a]. Same rotation in a permuted layout: q·k must agree.
  RopeParams p;
  p.dim = 64;
  p.yarn = true;
  p.factor = 40;
  const int D = p.dim, half = D / 2;
  const int64_t positions = 2000;
  const RopeTables t = build_tables(p, positions);

  auto hf_rotate = [&](const std::vector<float>& x, int64_t pos) {
    std::vector<double> deinterleaved(D), rotated(D);
    for (int i = 0; i < half; ++i) {
      deinterleaved[i] = x[2 * i];
      deinterleaved[half + i] = x[2 * i + 1];
    }
    for (int d = 0; d < D; ++d) {
      const double c = t.cos[pos * half + d % half], s = t.sin[pos * half + d % half];
      const double rotate_half_x = d < half ? -deinterleaved[d + half] : deinterleaved[d - half];
      rotated[d] = deinterleaved[d] * c + rotate_half_x * s;
    }
    return rotated;
  };

  for (int trial = 0; trial < 6; ++trial) {
    std::vector<float> q = random_normal_vector(size_t(D), 100u + trial);
    std::vector<float> k = random_normal_vector(size_t(D), 200u + trial);
    int64_t query_position = 37 * trial + 1500, key_position = 211 * trial;
    const std::vector<double> q_hf = hf_rotate(q, query_position), k_hf = hf_rotate(k, key_position);
    double hf_dot = 0;
    for (int d = 0; d < D; ++d) hf_dot += q_hf[d] * k_hf[d];

    rope_apply_interleaved(q.data(), 1, D, 0, D, &query_position, t.cos.data(), t.sin.data());
    rope_apply_interleaved(k.data(), 1, D, 0, D, &key_position, t.cos.data(), t.sin.data());
    // Elementwise: our pair (2i, 2i+1) is HF's (i, i + D/2).
    for (int i = 0; i < half; ++i) {
      EXPECT_NEAR(q[2 * i], q_hf[i], 1e-5);
      EXPECT_NEAR(q[2 * i + 1], q_hf[half + i], 1e-5);
    }
    EXPECT_NEAR(dot_product(q.data(), k.data(), D), hf_dot, 1e-4);
  }
}

}  // namespace
}  // namespace dm
