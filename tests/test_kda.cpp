// KDA operator (SPEC §1.1): recurrent and chunked forms against the reference goldens, against
// each other on random inputs (including decay strong enough to underflow), state handling
// (nullptr s0 / sT, in-place decode), and the `deltamoe op kda` CLI.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "core/gemm.h"
#include "io/safetensors.h"
#include "ops/cpu/kda.h"
#include "test_util.h"

using namespace dm;

namespace {

// All operator inputs of one problem, in the compute type.
template <typename T>
struct KdaProblem {
  KdaShape shape;
  std::vector<T> q, k, v, g, beta, s0;
};

template <typename T>
struct KdaResult {
  std::vector<T> o, sT;
};

template <typename T>
T default_scale(const KdaShape& s) {
  return T(1) / std::sqrt(T(s.K));
}

// chunk == 0 selects the recurrent form.
template <typename T>
KdaResult<T> run_kda(const KdaProblem<T>& p, int chunk, bool with_s0 = true) {
  const KdaShape& s = p.shape;
  KdaResult<T> r;
  r.o.assign(size_t(s.B * s.T * s.H * s.V), T(0));
  r.sT.assign(size_t(s.B * s.H * s.K * s.V), T(0));
  const T* s0 = with_s0 ? p.s0.data() : nullptr;
  if (chunk == 0) {
    kda_recurrent_forward<T>(p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(), s0,
                             r.o.data(), r.sT.data(), s, default_scale<T>(s));
  } else {
    Arena ws(kda_chunk_workspace_bytes<T>(s, chunk), "kda_test_ws");
    kda_chunk_forward<T>(p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(), s0,
                         r.o.data(), r.sT.data(), s, default_scale<T>(s), chunk, ws);
    EXPECT_EQ(ws.used(), 0u) << "workspace not released";
  }
  return r;
}

template <typename T>
std::vector<T> cast_vector(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

template <typename T>
KdaProblem<T> cast_problem(const KdaProblem<double>& p) {
  KdaProblem<T> c;
  c.shape = p.shape;
  c.q = cast_vector<T>(p.q);
  c.k = cast_vector<T>(p.k);
  c.v = cast_vector<T>(p.v);
  c.g = cast_vector<T>(p.g);
  c.beta = cast_vector<T>(p.beta);
  c.s0 = cast_vector<T>(p.s0);
  return c;
}

// Random problem. g per channel: −exp(U(log_decay_lo, log_decay_hi)), so with (−6, 3) channels
// range from nearly no decay (−0.0025) to −20 per step (e^{−20·64} underflows in any chunk).
KdaProblem<double> random_problem(KdaShape s, uint64_t seed, double log_decay_lo = -6.0,
                                  double log_decay_hi = 3.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::uniform_real_distribution<double> log_decay(log_decay_lo, log_decay_hi);
  KdaProblem<double> p;
  p.shape = s;
  auto fill = [&](std::vector<double>& x, size_t n, auto&& draw) {
    x.resize(n);
    for (auto& e : x) e = draw();
  };
  const size_t n_qk = size_t(s.B * s.T * s.H * s.K), n_v = size_t(s.B * s.T * s.H * s.V);
  fill(p.q, n_qk, [&] { return normal(rng); });
  fill(p.k, n_qk, [&] { return normal(rng); });
  fill(p.v, n_v, [&] { return normal(rng); });
  fill(p.g, n_qk, [&] { return -std::exp(log_decay(rng)); });
  fill(p.beta, size_t(s.B * s.T * s.H), [&] { return unit(rng); });
  fill(p.s0, size_t(s.B * s.H * s.K * s.V), [&] { return 0.5 * normal(rng); });
  return p;
}

template <typename T>
bool all_finite(const std::vector<T>& x) {
  for (T e : x)
    if (!std::isfinite(e)) return false;
  return true;
}

KdaProblem<double> load_golden_problem(const SafetensorsReader& r) {
  KdaProblem<double> p;
  const Shape& qs = r.get("q").shape;
  p.shape = {qs[0], qs[1], qs[2], qs[3], r.get("v").shape[3]};
  p.q = test::to_f64(r.get("q"));
  p.k = test::to_f64(r.get("k"));
  p.v = test::to_f64(r.get("v"));
  p.g = test::to_f64(r.get("g"));
  p.beta = test::to_f64(r.get("beta"));
  p.s0 = test::to_f64(r.get("s0"));
  return p;
}

void check_golden_file(const std::string& file) {
  if (!test::goldens_available()) GTEST_SKIP() << "goldens not found at " << test::goldens_dir();
  const auto reader = SafetensorsReader::open(test::goldens_dir() + "/" + file);
  const KdaProblem<double> p = load_golden_problem(reader);
  const std::vector<double> o_ref = test::to_f64(reader.get("o"));
  const std::vector<double> sT_ref = test::to_f64(reader.get("sT"));
  const std::vector<float> o_ref32 = test::to_f32(reader.get("o"));
  const std::vector<float> sT_ref32 = test::to_f32(reader.get("sT"));
  const KdaProblem<float> p32 = cast_problem<float>(p);
  for (int chunk : {0, 16, 32, 64}) {
    const std::string form = chunk == 0 ? "recurrent" : "chunk " + std::to_string(chunk);
    const KdaResult<double> r64 = run_kda(p, chunk);
    const double o64 = test::rel_rms(r64.o.data(), o_ref.data(), o_ref.size());
    const double s64 = test::rel_rms(r64.sT.data(), sT_ref.data(), sT_ref.size());
    const KdaResult<float> r32 = run_kda(p32, chunk);
    const double o32 = test::rel_rms(r32.o.data(), o_ref32.data(), o_ref32.size());
    const double s32 = test::rel_rms(r32.sT.data(), sT_ref32.data(), sT_ref32.size());
    std::printf("[kda %s %-10s] f64 o %.3e sT %.3e | f32 o %.3e sT %.3e\n", file.c_str(),
                form.c_str(), o64, s64, o32, s32);
    EXPECT_LE(o64, 1e-10) << form;
    EXPECT_LE(s64, 1e-10) << form;
    EXPECT_LE(o32, 1e-5) << form;
    EXPECT_LE(s32, 1e-5) << form;
  }
}

}  // namespace

TEST(KdaGolden, SmallMatchesReference) { check_golden_file("kda_op_small.safetensors"); }
TEST(KdaGolden, LongMatchesReference) { check_golden_file("kda_op_long.safetensors"); }

// Chunked == recurrent for lengths around chunk boundaries, with mixed weak / very strong decay.
TEST(KdaChunk, MatchesRecurrentRandom) {
  for (int64_t T_len : {1, 17, 63, 64, 65, 130}) {
    const KdaShape shape{2, T_len, 3, 16, 12};
    const KdaProblem<double> p = random_problem(shape, 1000 + uint64_t(T_len));
    const KdaProblem<float> p32 = cast_problem<float>(p);
    const KdaResult<double> ref = run_kda(p, 0);
    ASSERT_TRUE(all_finite(ref.o) && all_finite(ref.sT));
    for (int chunk : {16, 32, 64}) {
      const KdaResult<double> r = run_kda(p, chunk);
      const KdaResult<float> r32 = run_kda(p32, chunk);
      EXPECT_TRUE(all_finite(r.o) && all_finite(r.sT)) << "T=" << T_len << " chunk=" << chunk;
      EXPECT_TRUE(all_finite(r32.o) && all_finite(r32.sT)) << "T=" << T_len << " chunk=" << chunk;
      const double o_err = test::rel_rms(r.o.data(), ref.o.data(), ref.o.size());
      const double s_err = test::rel_rms(r.sT.data(), ref.sT.data(), ref.sT.size());
      const std::vector<float> ref_o32 = cast_vector<float>(ref.o);
      const std::vector<float> ref_s32 = cast_vector<float>(ref.sT);
      const double o_err32 = test::rel_rms(r32.o.data(), ref_o32.data(), ref_o32.size());
      const double s_err32 = test::rel_rms(r32.sT.data(), ref_s32.data(), ref_s32.size());
      EXPECT_LE(o_err, 1e-12) << "T=" << T_len << " chunk=" << chunk;
      EXPECT_LE(s_err, 1e-12) << "T=" << T_len << " chunk=" << chunk;
      EXPECT_LE(o_err32, 1e-5) << "T=" << T_len << " chunk=" << chunk;
      EXPECT_LE(s_err32, 1e-5) << "T=" << T_len << " chunk=" << chunk;
    }
  }
}

// Every channel decays by e^{−20} or more per step: the cumulative decay of a chunk is far below
// the smallest double, and e^{−Γ} would be +inf. Results must stay finite and agree.
TEST(KdaChunk, StrongDecayStaysFinite) {
  const KdaShape shape{1, 130, 2, 32, 16};
  // −exp(U(3.0, 3.3)) ∈ [−27, −20] per step.
  const KdaProblem<double> p = random_problem(shape, 7, 3.0, 3.3);
  const KdaProblem<float> p32 = cast_problem<float>(p);
  const KdaResult<double> ref = run_kda(p, 0);
  const KdaResult<float> ref32 = run_kda(p32, 0);
  ASSERT_TRUE(all_finite(ref.o) && all_finite(ref.sT));
  ASSERT_TRUE(all_finite(ref32.o) && all_finite(ref32.sT));
  for (int chunk : {16, 32, 64}) {
    const KdaResult<double> r = run_kda(p, chunk);
    const KdaResult<float> r32 = run_kda(p32, chunk);
    ASSERT_TRUE(all_finite(r.o) && all_finite(r.sT)) << "chunk=" << chunk;
    ASSERT_TRUE(all_finite(r32.o) && all_finite(r32.sT)) << "chunk=" << chunk;
    EXPECT_LE(test::rel_rms(r.o.data(), ref.o.data(), ref.o.size()), 1e-12) << chunk;
    EXPECT_LE(test::rel_rms(r32.o.data(), ref32.o.data(), ref32.o.size()), 1e-5) << chunk;
    // sT is ~e^{−20} of the last token's contribution: compare absolutely.
    double max_abs = 0;
    for (size_t i = 0; i < ref.sT.size(); ++i)
      max_abs = std::max(max_abs, std::abs(r.sT[i] - ref.sT[i]));
    EXPECT_LE(max_abs, 1e-12) << chunk;
  }
}

// Large enough to take the OpenMP path (one (b, h) per thread, BLAS pinned to one thread):
// same results as one thread, for both forms.
TEST(KdaChunk, ParallelMatchesSerial) {
  const KdaProblem<double> p = random_problem({2, 100, 4, 32, 32}, 15);
  const int saved_threads = num_threads();
  std::vector<KdaResult<double>> serial;
  set_num_threads(1);
  for (int chunk : {0, 64}) serial.push_back(run_kda(p, chunk));
  set_num_threads(std::max(saved_threads, 4));
  std::vector<KdaResult<double>> parallel;
  for (int chunk : {0, 64}) parallel.push_back(run_kda(p, chunk));
  set_num_threads(saved_threads);
  for (size_t i = 0; i < serial.size(); ++i) {
    EXPECT_LE(test::rel_rms(parallel[i].o.data(), serial[i].o.data(), serial[i].o.size()), 1e-13);
    EXPECT_LE(test::rel_rms(parallel[i].sT.data(), serial[i].sT.data(), serial[i].sT.size()),
              1e-13);
  }
  // And the chunked form still agrees with the recurrent one at this size.
  EXPECT_LE(test::rel_rms(parallel[1].o.data(), parallel[0].o.data(), parallel[0].o.size()),
            1e-12);
}

// s0 == nullptr is the same as an explicit zero state; sT == nullptr leaves o unchanged.
TEST(KdaState, NullInitialStateEqualsZeros) {
  KdaProblem<double> p = random_problem({2, 70, 2, 16, 8}, 11);
  std::fill(p.s0.begin(), p.s0.end(), 0.0);
  for (int chunk : {0, 16, 64}) {
    const KdaResult<double> explicit_zero = run_kda(p, chunk, /*with_s0=*/true);
    const KdaResult<double> null_state = run_kda(p, chunk, /*with_s0=*/false);
    EXPECT_EQ(explicit_zero.o, null_state.o) << chunk;
    EXPECT_EQ(explicit_zero.sT, null_state.sT) << chunk;
  }
}

TEST(KdaState, NullFinalState) {
  const KdaProblem<double> p = random_problem({1, 40, 2, 16, 8}, 12);
  const KdaShape& s = p.shape;
  const double scale = default_scale<double>(s);
  for (int chunk : {0, 32}) {
    const KdaResult<double> full = run_kda(p, chunk);
    std::vector<double> o(full.o.size(), -1.0);
    if (chunk == 0) {
      kda_recurrent_forward<double>(p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(),
                                    p.s0.data(), o.data(), nullptr, s, scale);
    } else {
      Arena ws(kda_chunk_workspace_bytes<double>(s, chunk));
      kda_chunk_forward<double>(p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(),
                                p.s0.data(), o.data(), nullptr, s, scale, chunk, ws);
    }
    EXPECT_EQ(o, full.o) << chunk;
  }
}

// Decode: one token per call with the state carried in place (s0 == sT) equals one long call;
// so does prefill in two chunked calls.
TEST(KdaState, InPlaceStateAcrossCalls) {
  const KdaProblem<double> p = random_problem({1, 50, 2, 16, 8}, 13);
  const KdaShape& s = p.shape;
  const double scale = default_scale<double>(s);
  const KdaResult<double> whole = run_kda(p, 0);
  // Row of token t for b = 0: t·H, so token t's slices start at t·H·K and t·H·V.
  auto token_slice = [&](const std::vector<double>& x, int64_t t, int64_t width) {
    return x.data() + t * s.H * width;
  };
  std::vector<double> state = p.s0, o(whole.o.size());
  const KdaShape one_token{1, 1, s.H, s.K, s.V};
  for (int64_t t = 0; t < s.T; ++t) {
    kda_recurrent_forward<double>(token_slice(p.q, t, s.K), token_slice(p.k, t, s.K),
                                  token_slice(p.v, t, s.V), token_slice(p.g, t, s.K),
                                  p.beta.data() + t * s.H, state.data(),
                                  o.data() + t * s.H * s.V, state.data(), one_token, scale);
  }
  EXPECT_LE(test::rel_rms(o.data(), whole.o.data(), o.size()), 1e-13);
  EXPECT_LE(test::rel_rms(state.data(), whole.sT.data(), state.size()), 1e-13);

  // Two chunked calls: tokens [0, 37) then [37, 50).
  state = p.s0;
  Arena ws(kda_chunk_workspace_bytes<double>(s, 16));
  const int64_t split = 37;
  const KdaShape head_part{1, split, s.H, s.K, s.V}, tail_part{1, s.T - split, s.H, s.K, s.V};
  for (const auto& [start, part] : {std::pair{int64_t(0), head_part}, std::pair{split, tail_part}})
    kda_chunk_forward<double>(token_slice(p.q, start, s.K), token_slice(p.k, start, s.K),
                              token_slice(p.v, start, s.V), token_slice(p.g, start, s.K),
                              p.beta.data() + start * s.H, state.data(),
                              o.data() + start * s.H * s.V, state.data(), part, scale, 16, ws);
  EXPECT_LE(test::rel_rms(o.data(), whole.o.data(), o.size()), 1e-12);
  EXPECT_LE(test::rel_rms(state.data(), whole.sT.data(), state.size()), 1e-12);
}

TEST(KdaChunk, RejectsBadChunkAndTinyWorkspace) {
  const KdaProblem<double> p = random_problem({1, 8, 1, 8, 8}, 14);
  std::vector<double> o(64), sT(64);
  Arena big(1 << 20), tiny(64);
  EXPECT_THROW(kda_chunk_forward<double>(p.q.data(), p.k.data(), p.v.data(), p.g.data(),
                                         p.beta.data(), nullptr, o.data(), sT.data(), p.shape,
                                         0.5, 48, big),
               Error);
  EXPECT_THROW(kda_chunk_forward<double>(p.q.data(), p.k.data(), p.v.data(), p.g.data(),
                                         p.beta.data(), nullptr, o.data(), sT.data(), p.shape,
                                         0.5, 16, tiny),
               Error);
}

// ---------------------------------------------------------------------------------------------
// CLI: `deltamoe op kda`.

TEST(KdaCli, ReproducesSmallGolden) {
  if (!test::goldens_available()) GTEST_SKIP() << "goldens not found at " << test::goldens_dir();
  const std::string input = test::goldens_dir() + "/kda_op_small.safetensors";
  const auto golden = SafetensorsReader::open(input);
  const std::vector<double> o_ref = test::to_f64(golden.get("o"));
  const std::vector<double> sT_ref = test::to_f64(golden.get("sT"));
  const std::string dir = test::temp_dir("kda_cli");
  struct Case {
    std::string flags;
    DType dtype;
    double tolerance;
  };
  for (const Case& c : {Case{"", DType::F64, 1e-10}, Case{"--chunk 16", DType::F64, 1e-10},
                        Case{"--chunk recurrent --dtype f32", DType::F32, 1e-5},
                        Case{"--chunk 32 --dtype f32", DType::F32, 1e-5}}) {
    const std::string output = dir + "/out.safetensors";
    const auto res = test::run_cli("op kda --input " + input + " --output " + output + " " +
                                   c.flags);
    ASSERT_EQ(res.exit_code, 0) << c.flags << ": " << res.output;
    const auto out = SafetensorsReader::open(output);
    EXPECT_EQ(out.get("o").dtype, c.dtype) << c.flags;
    EXPECT_EQ(out.get("o").shape, golden.get("o").shape) << c.flags;
    EXPECT_EQ(out.get("sT").shape, golden.get("sT").shape) << c.flags;
    const std::vector<double> o = test::to_f64(out.get("o")), sT = test::to_f64(out.get("sT"));
    const double o_err = test::rel_rms(o.data(), o_ref.data(), o.size());
    const double s_err = test::rel_rms(sT.data(), sT_ref.data(), sT.size());
    std::printf("[kda cli %-32s] o %.3e sT %.3e\n", c.flags.c_str(), o_err, s_err);
    EXPECT_LE(o_err, c.tolerance) << c.flags;
    EXPECT_LE(s_err, c.tolerance) << c.flags;
  }
}

// A malformed input fails with exit code 1 and a single line naming the offending tensor.
TEST(KdaCli, BadInputNamesTheTensor) {
  const std::string dir = test::temp_dir("kda_cli_bad");
  const int64_t B = 1, T = 5, H = 1, K = 8, V = 4;
  std::vector<double> qkg(size_t(B * T * H * K), 0.1), k_wrong(size_t(B * T * H * (K - 1)), 0.1),
      v(size_t(B * T * H * V), 0.2), beta(size_t(B * T * H), 0.5), s0_wrong(size_t(K * K), 0.0);
  std::vector<int64_t> beta_int(size_t(B * T * H), 1);
  struct Case {
    std::string bad_tensor;  // the tensor the error must name
    std::string tag;
  };
  for (const Case& c : {Case{"k", "shape"}, Case{"beta", "dtype"}, Case{"g", "missing"},
                        Case{"s0", "shape"}}) {
    SafetensorsWriter w;
    w.add("q", Tensor{qkg.data(), DType::F64, {B, T, H, K}});
    if (c.bad_tensor == "k") w.add("k", Tensor{k_wrong.data(), DType::F64, {B, T, H, K - 1}});
    else w.add("k", Tensor{qkg.data(), DType::F64, {B, T, H, K}});
    if (c.bad_tensor != "g") w.add("g", Tensor{qkg.data(), DType::F64, {B, T, H, K}});
    w.add("v", Tensor{v.data(), DType::F64, {B, T, H, V}});
    if (c.bad_tensor == "beta") w.add("beta", Tensor{beta_int.data(), DType::I64, {B, T, H}});
    else w.add("beta", Tensor{beta.data(), DType::F64, {B, T, H}});
    if (c.bad_tensor == "s0") w.add("s0", Tensor{s0_wrong.data(), DType::F64, {B, H, K, K}});
    const std::string input = dir + "/bad_" + c.bad_tensor + ".safetensors";
    w.write(input);
    const auto res =
        test::run_cli("op kda --input " + input + " --output " + dir + "/never.safetensors");
    EXPECT_EQ(res.exit_code, 1) << c.tag << ": " << res.output;
    EXPECT_NE(res.output.find("'" + c.bad_tensor + "'"), std::string::npos)
        << c.tag << ": " << res.output;
    EXPECT_EQ(std::count(res.output.begin(), res.output.end(), '\n'), 1) << res.output;
    EXPECT_FALSE(std::ifstream(dir + "/never.safetensors").good()) << c.tag;
  }
}
