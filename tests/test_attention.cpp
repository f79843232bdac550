// Tests for the CPU causal attention (flash-style forward vs double reference; FlashAttention-2
// backward vs a full-matrix reference backward and finite differences; packed documents via
// doc_start; determinism across thread counts) and RoPE / YaRN tables (incl. the inverse
// rotation used by the backward).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numbers>
#include <random>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "core/gemm.h"
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

// A NaN in one key's vector must reach every output row that sees that key (and no earlier
// row): the softmax exps are vectorised approximations that would map a NaN score to a finite
// weight if the NaN were not carried through explicitly (core/fastmath.h, fast_exp_keep_nan).
TEST(AttentionCausal, NanKeyReachesTheRowsThatSeeIt) {
  const AttnShape shape{1, 40, 1, 8, 8};
  AttentionInputs in = make_attention_inputs(shape, 5u);
  const int64_t bad = 20;
  in.k[size_t(bad * shape.Dqk + 3)] = std::numeric_limits<float>::quiet_NaN();
  Arena ws(attention_causal_workspace_bytes(shape, 16), "attn-test");
  std::vector<float> out(in.v.size());
  attention_causal_forward(in.q.data(), in.k.data(), in.v.data(), out.data(), nullptr, shape,
                           0.35f, ws, 16);
  for (int64_t t = 0; t < shape.T; ++t)
    EXPECT_EQ(std::isnan(out[size_t(t * shape.Dv)]), t >= bad) << "row " << t;
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


// ---------------------------------------------------------------------------------------------
// Backward and packed documents

template <typename Real>
std::vector<Real> random_vector_of(size_t n, uint32_t seed, double stddev = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, stddev);
  std::vector<Real> out(n);
  for (auto& x : out) x = Real(normal(rng));
  return out;
}

// doc_start [B·T] for rows packed from documents of the given lengths (each row's lengths sum to T).
std::vector<int32_t> doc_start_from_lengths(const std::vector<std::vector<int>>& rows, int64_t T) {
  std::vector<int32_t> doc_start;
  for (const auto& lengths : rows) {
    int32_t start = 0;
    for (int length : lengths) {
      for (int i = 0; i < length; ++i) doc_start.push_back(start);
      start += length;
    }
    EXPECT_EQ(start, T) << "document lengths must fill the row";
  }
  return doc_start;
}

// Random packing of every row into documents of length 1..max_length.
std::vector<int32_t> random_doc_start(int64_t B, int64_t T, uint32_t seed, int max_length) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int>> rows(static_cast<size_t>(B));
  for (auto& lengths : rows) {
    int64_t used = 0;
    while (used < T) {
      const int length = int(std::min<int64_t>(1 + rng() % max_length, T - used));
      lengths.push_back(length);
      used += length;
    }
  }
  return doc_start_from_lengths(rows, T);
}

template <typename Real>
struct AttentionProblem {
  AttnShape shape;
  std::vector<Real> q, k, v, dout;
  std::vector<int32_t> doc_start;  // empty = one document per row
  const int32_t* doc_start_or_null() const { return doc_start.empty() ? nullptr : doc_start.data(); }
};

template <typename Real>
AttentionProblem<Real> make_attention_problem(const AttnShape& s, uint32_t seed) {
  AttentionProblem<Real> p;
  p.shape = s;
  p.q = random_vector_of<Real>(size_t(s.B * s.T * s.H * s.Dqk), seed);
  p.k = random_vector_of<Real>(size_t(s.B * s.T * s.H * s.Dqk), seed + 1);
  p.v = random_vector_of<Real>(size_t(s.B * s.T * s.H * s.Dv), seed + 2);
  p.dout = random_vector_of<Real>(size_t(s.B * s.T * s.H * s.Dv), seed + 3);
  return p;
}

template <typename To, typename From>
AttentionProblem<To> cast_attention_problem(const AttentionProblem<From>& p) {
  AttentionProblem<To> c;
  c.shape = p.shape;
  c.q.assign(p.q.begin(), p.q.end());
  c.k.assign(p.k.begin(), p.k.end());
  c.v.assign(p.v.begin(), p.v.end());
  c.dout.assign(p.dout.begin(), p.dout.end());
  c.doc_start = p.doc_start;
  return c;
}

template <typename Real>
struct AttentionGradients {
  std::vector<Real> o, lse, dq, dk, dv;
};

// Forward (for o, lse) then the flash backward into zeroed gradients.
template <typename Real>
AttentionGradients<Real> run_flash_forward_backward(const AttentionProblem<Real>& p, int block,
                                                    double scale) {
  const AttnShape& s = p.shape;
  AttentionGradients<Real> g;
  g.o.assign(p.v.size(), Real(NAN));
  g.lse.assign(size_t(s.B * s.H * s.T), Real(NAN));
  g.dq.assign(p.q.size(), Real(0));
  g.dk.assign(p.k.size(), Real(0));
  g.dv.assign(p.v.size(), Real(0));
  Arena ws(std::max(attention_causal_workspace_bytes(s, block, sizeof(Real)),
                    attention_causal_backward_workspace_bytes(s, block, sizeof(Real))),
           "attn-backward-test");
  attention_causal_forward(p.q.data(), p.k.data(), p.v.data(), g.o.data(), g.lse.data(), s, scale,
                           ws, block, p.doc_start_or_null());
  attention_causal_backward(p.q.data(), p.k.data(), p.v.data(), g.o.data(), g.lse.data(),
                            p.dout.data(), g.dq.data(), g.dk.data(), g.dv.data(), s, scale, ws,
                            block, p.doc_start_or_null());
  EXPECT_EQ(ws.used(), 0u) << "scratch must be released on return";
  return g;
}

template <typename Real>
AttentionGradients<double> run_reference_backward(const AttentionProblem<Real>& p_in,
                                                  double scale) {
  const AttentionProblem<double> p = cast_attention_problem<double>(p_in);
  AttentionGradients<double> g;
  g.o.assign(p.v.size(), 0.0);
  g.dq.assign(p.q.size(), 0.0);
  g.dk.assign(p.k.size(), 0.0);
  g.dv.assign(p.v.size(), 0.0);
  attention_causal_reference(p.q.data(), p.k.data(), p.v.data(), g.o.data(), p.shape, scale,
                             p.doc_start_or_null());
  attention_causal_reference_backward(p.q.data(), p.k.data(), p.v.data(), p.dout.data(),
                                      g.dq.data(), g.dk.data(), g.dv.data(), p.shape, scale,
                                      p.doc_start_or_null());
  return g;
}

template <typename Real>
double rel_rms_against_double(const std::vector<Real>& a, const std::vector<double>& b) {
  const std::vector<double> a_double(a.begin(), a.end());
  return test::rel_rms(a_double.data(), b.data(), b.size());
}

struct AttentionBackwardCase {
  int64_t B, T, H, Dqk, Dv;
  int block;
  bool packed_documents;
};

class AttentionBackwardVsReference : public ::testing::TestWithParam<AttentionBackwardCase> {};

template <typename Real>
void check_backward_against_reference(const AttentionBackwardCase& c, double tolerance) {
  const AttnShape shape{c.B, c.T, c.H, c.Dqk, c.Dv};
  AttentionProblem<double> problem = make_attention_problem<double>(shape, 500u + uint32_t(c.T));
  if (c.packed_documents) problem.doc_start = random_doc_start(c.B, c.T, 77u + uint32_t(c.T), 40);
  const double scale = 1.0 / std::sqrt(double(c.Dqk));
  const AttentionProblem<Real> typed = cast_attention_problem<Real>(problem);
  const AttentionGradients<Real> flash = run_flash_forward_backward(typed, c.block, scale);
  const AttentionGradients<double> reference = run_reference_backward(problem, scale);
  const double err_o = rel_rms_against_double(flash.o, reference.o);
  const double err_dq = rel_rms_against_double(flash.dq, reference.dq);
  const double err_dk = rel_rms_against_double(flash.dk, reference.dk);
  const double err_dv = rel_rms_against_double(flash.dv, reference.dv);
  std::printf("  %s B=%lld T=%lld H=%lld Dqk=%lld Dv=%lld block=%d packed=%d: rel RMS o %.3g "
              "dq %.3g dk %.3g dv %.3g\n",
              sizeof(Real) == 4 ? "float " : "double", (long long)c.B, (long long)c.T,
              (long long)c.H, (long long)c.Dqk, (long long)c.Dv, c.block, int(c.packed_documents),
              err_o, err_dq, err_dk, err_dv);
  EXPECT_LE(err_o, tolerance);
  EXPECT_LE(err_dq, tolerance);
  EXPECT_LE(err_dk, tolerance);
  EXPECT_LE(err_dv, tolerance);
}

TEST_P(AttentionBackwardVsReference, FloatGradientsMatch) {
  check_backward_against_reference<float>(GetParam(), 1e-5);
}
TEST_P(AttentionBackwardVsReference, DoubleGradientsMatch) {
  check_backward_against_reference<double>(GetParam(), 1e-12);
}

INSTANTIATE_TEST_SUITE_P(
    AttentionBackwardShapes, AttentionBackwardVsReference,
    ::testing::Values(AttentionBackwardCase{1, 1, 1, 8, 8, 16, false},
                      AttentionBackwardCase{2, 100, 3, 48, 32, 16, false},
                      AttentionBackwardCase{2, 100, 3, 48, 32, 64, false},
                      AttentionBackwardCase{1, 150, 2, 40, 24, 64, false},
                      AttentionBackwardCase{1, 131, 1, 24, 16, 16, false},
                      AttentionBackwardCase{1, 37, 2, 16, 24, 7, false},
                      AttentionBackwardCase{2, 100, 2, 24, 16, 16, true},
                      AttentionBackwardCase{1, 150, 2, 40, 24, 64, true},
                      AttentionBackwardCase{2, 37, 1, 8, 8, 1, true}));

// Central differences of L = Σ o·R on a tiny double problem (several blocks, with and without
// packed documents) against the flash backward.
TEST(AttentionBackward, FiniteDifferencesInDouble) {
  for (bool packed : {false, true}) {
    const AttnShape shape{2, 9, 2, 5, 3};
    const int block = 4;
    AttentionProblem<double> p = make_attention_problem<double>(shape, 31u);
    if (packed) p.doc_start = doc_start_from_lengths({{4, 5}, {2, 1, 6}}, shape.T);
    const double scale = 0.7;
    const AttentionGradients<double> analytic = run_flash_forward_backward(p, block, scale);

    Arena ws(attention_causal_workspace_bytes(shape, block, sizeof(double)), "attn-fd");
    std::vector<double> o(p.v.size());
    auto loss = [&]() {
      attention_causal_forward(p.q.data(), p.k.data(), p.v.data(), o.data(), nullptr, shape,
                               scale, ws, block, p.doc_start_or_null());
      double l = 0;
      for (size_t i = 0; i < o.size(); ++i) l += o[i] * p.dout[i];
      return l;
    };
    auto check = [&](std::vector<double>& input, const std::vector<double>& gradient,
                     const char* name) {
      double max_error = 0, max_gradient = 0;
      for (size_t i = 0; i < input.size(); ++i) {
        const double saved = input[i], h = 1e-6 * std::max(1.0, std::abs(saved));
        input[i] = saved + h;
        const double plus = loss();
        input[i] = saved - h;
        const double minus = loss();
        input[i] = saved;
        max_error = std::max(max_error, std::abs((plus - minus) / (2 * h) - gradient[i]));
        max_gradient = std::max(max_gradient, std::abs(gradient[i]));
      }
      std::printf("  FD packed=%d d%s: max abs error %.3g (max |grad| %.3g)\n", int(packed), name,
                  max_error, max_gradient);
      EXPECT_LE(max_error, 1e-7 * std::max(1.0, max_gradient)) << name;
    };
    check(p.q, analytic.dq, "q");
    check(p.k, analytic.dk, "k");
    check(p.v, analytic.dv, "v");
  }
}

// A row packing [A | B] (doc_start) behaves exactly like A and B as separate rows, forward
// (o, lse) and backward (dq, dk, dv); documents cross block boundaries mid-block.
template <typename Real>
void check_packed_equals_separate(double tolerance) {
  const int64_t H = 2, Dqk = 12, Dv = 10, length_a = 13, length_b = 24, T = length_a + length_b;
  const int block = 16;
  const double scale = 0.4;
  const AttnShape packed_shape{1, T, H, Dqk, Dv};
  AttentionProblem<Real> packed = make_attention_problem<Real>(packed_shape, 71u);
  packed.doc_start = doc_start_from_lengths({{int(length_a), int(length_b)}}, T);
  const AttentionGradients<Real> packed_grads = run_flash_forward_backward(packed, block, scale);

  int64_t token_offset = 0;
  for (int64_t length : {length_a, length_b}) {
    // Slice document tokens [token_offset, token_offset + length) out of the packed row.
    AttentionProblem<Real> single;
    single.shape = AttnShape{1, length, H, Dqk, Dv};
    auto slice = [&](const std::vector<Real>& full, int64_t width) {
      return std::vector<Real>(full.begin() + token_offset * H * width,
                               full.begin() + (token_offset + length) * H * width);
    };
    single.q = slice(packed.q, Dqk);
    single.k = slice(packed.k, Dqk);
    single.v = slice(packed.v, Dv);
    single.dout = slice(packed.dout, Dv);
    const AttentionGradients<Real> single_grads = run_flash_forward_backward(single, block, scale);
    auto compare = [&](const std::vector<Real>& packed_values, const std::vector<Real>& expected,
                       int64_t width, const char* name) {
      const std::vector<Real> part(packed_values.begin() + token_offset * H * width,
                                   packed_values.begin() + (token_offset + length) * H * width);
      const double err = test::rel_rms(part.data(), expected.data(), expected.size());
      EXPECT_LE(err, tolerance) << name << " document at " << token_offset;
      return err;
    };
    const double err_o = compare(packed_grads.o, single_grads.o, Dv, "o");
    const double err_dq = compare(packed_grads.dq, single_grads.dq, Dqk, "dq");
    const double err_dk = compare(packed_grads.dk, single_grads.dk, Dqk, "dk");
    const double err_dv = compare(packed_grads.dv, single_grads.dv, Dv, "dv");
    double max_lse_error = 0;  // lse is [B, H, T]
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < length; ++t)
        max_lse_error = std::max(max_lse_error,
                                 std::abs(double(packed_grads.lse[h * T + token_offset + t]) -
                                          double(single_grads.lse[h * length + t])));
    EXPECT_LE(max_lse_error, tolerance * 10);
    std::printf("  %s packed vs separate doc@%lld: o %.3g dq %.3g dk %.3g dv %.3g lse %.3g\n",
                sizeof(Real) == 4 ? "float " : "double", (long long)token_offset, err_o, err_dq,
                err_dk, err_dv, max_lse_error);
    token_offset += length;
  }
}

TEST(AttentionDocStart, PackedRowEqualsSeparateRowsDouble) { check_packed_equals_separate<double>(1e-13); }
TEST(AttentionDocStart, PackedRowEqualsSeparateRowsFloat) { check_packed_equals_separate<float>(1e-6); }

TEST(AttentionDocStart, RejectsStartsOutsideTheRow) {
  const AttnShape shape{1, 4, 1, 4, 4};
  const AttentionInputs in = make_attention_inputs(shape, 5u);
  Arena ws(attention_causal_workspace_bytes(shape, 16), "attn-test");
  std::vector<float> out(in.v.size());
  for (std::vector<int32_t> bad : {std::vector<int32_t>{0, 0, 3, 2}, {0, -1, 0, 0}}) {
    EXPECT_THROW(attention_causal_forward(in.q.data(), in.k.data(), in.v.data(), out.data(),
                                          nullptr, shape, 1.0, ws, 16, bad.data()),
                 Error);
  }
}

// The per-head schedule (1 thread) and the two-pass schedule (more threads than heads) give
// bit-identical gradients; and the backward accumulates into its outputs.
TEST(AttentionBackward, DeterministicAcrossThreadCountsAndAccumulates) {
  const AttnShape shape{1, 200, 1, 32, 16};
  AttentionProblem<float> p = make_attention_problem<float>(shape, 9u);
  p.doc_start = random_doc_start(1, shape.T, 4u, 90);
  const int saved_threads = num_threads();
  set_num_threads(1);
  const AttentionGradients<float> one_thread = run_flash_forward_backward(p, 32, 0.2);
  set_num_threads(4);
  const AttentionGradients<float> four_threads = run_flash_forward_backward(p, 32, 0.2);
  set_num_threads(saved_threads);
  EXPECT_EQ(one_thread.dq, four_threads.dq);
  EXPECT_EQ(one_thread.dk, four_threads.dk);
  EXPECT_EQ(one_thread.dv, four_threads.dv);

  // Accumulation: a second backward into the same buffers doubles them (up to rounding: the
  // tiles are added one by one onto the existing values).
  AttentionGradients<float> twice = one_thread;
  Arena ws(attention_causal_backward_workspace_bytes(shape, 32), "attn-test");
  attention_causal_backward(p.q.data(), p.k.data(), p.v.data(), twice.o.data(), twice.lse.data(),
                            p.dout.data(), twice.dq.data(), twice.dk.data(), twice.dv.data(),
                            shape, 0.2, ws, 32, p.doc_start_or_null());
  for (size_t i = 0; i < twice.dq.size(); ++i)
    ASSERT_NEAR(twice.dq[i], 2 * one_thread.dq[i], 1e-5 * (1 + std::abs(one_thread.dq[i])));
  for (size_t i = 0; i < twice.dk.size(); ++i)
    ASSERT_NEAR(twice.dk[i], 2 * one_thread.dk[i], 1e-5 * (1 + std::abs(one_thread.dk[i])));
  for (size_t i = 0; i < twice.dv.size(); ++i)
    ASSERT_NEAR(twice.dv[i], 2 * one_thread.dv[i], 1e-5 * (1 + std::abs(one_thread.dv[i])));
}

// ---------------------------------------------------------------------------------------------
// RoPE backward and positions

TEST(RopeInterleaved, InverseIsTransposeAndUndoesPlainRotation) {
  for (bool yarn : {false, true}) {
    RopeParams p;
    p.dim = 16;
    p.yarn = yarn;
    p.factor = 8;
    p.original_max_position = 64;
    p.mscale = 1.0;
    p.mscale_all_dim = 0.0;  // under YaRN the tables then carry an amplitude ≠ 1
    const int64_t positions = 300, rows = 12, stride = 24, offset = 5;
    std::vector<double> cos(size_t(positions * p.dim / 2)), sin(cos.size());
    rope_build_tables(p, positions, cos.data(), sin.data());
    std::vector<int64_t> pos(rows);
    for (int64_t r = 0; r < rows; ++r) pos[r] = (r * 37) % positions;
    const std::vector<double> x = random_vector_of<double>(size_t(rows * stride), 1u);
    const std::vector<double> y = random_vector_of<double>(size_t(rows * stride), 2u);
    std::vector<double> rotated_x = x, inverse_rotated_y = y;
    rope_apply_interleaved(rotated_x.data(), rows, stride, offset, p.dim, pos.data(), cos.data(),
                           sin.data());
    rope_apply_interleaved_inverse(inverse_rotated_y.data(), rows, stride, offset, p.dim,
                                   pos.data(), cos.data(), sin.data());
    // <R x, y> = <x, Rᵀ y>
    double lhs = 0, rhs = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      lhs += rotated_x[i] * y[i];
      rhs += x[i] * inverse_rotated_y[i];
    }
    EXPECT_NEAR(lhs, rhs, 1e-12 * (1 + std::abs(lhs))) << "yarn=" << yarn;
    if (!yarn) {  // amplitude 1: the inverse undoes the rotation
      rope_apply_interleaved_inverse(rotated_x.data(), rows, stride, offset, p.dim, pos.data(),
                                     cos.data(), sin.data());
      for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(rotated_x[i], x[i], 1e-13);
    }
  }
}

TEST(RopeInterleaved, DoubleTablesMatchFloatTables) {
  RopeParams p;
  p.dim = 64;
  p.yarn = true;
  p.factor = 40;
  const int64_t positions = 5000;
  const RopeTables f = build_tables(p, positions);
  std::vector<double> cos(f.cos.size()), sin(f.sin.size());
  rope_build_tables(p, positions, cos.data(), sin.data());
  for (size_t i = 0; i < cos.size(); ++i) {
    ASSERT_EQ(f.cos[i], float(cos[i]));
    ASSERT_EQ(f.sin[i], float(sin[i]));
  }
}

TEST(RopeInterleaved, PositionsRestartAtDocumentStarts) {
  const std::vector<int32_t> doc_start = doc_start_from_lengths({{3, 2}, {5}}, 5);
  std::vector<int64_t> pos(10);
  rope_positions_from_doc_start(doc_start.data(), 2, 5, pos.data());
  EXPECT_EQ(pos, (std::vector<int64_t>{0, 1, 2, 0, 1, 0, 1, 2, 3, 4}));
  rope_positions_from_doc_start(nullptr, 2, 5, pos.data());
  EXPECT_EQ(pos, (std::vector<int64_t>{0, 1, 2, 3, 4, 0, 1, 2, 3, 4}));
}

}  // namespace
}  // namespace dm
