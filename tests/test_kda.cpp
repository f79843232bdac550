// KDA operator (SPEC §1.1): recurrent and chunked forms against the reference goldens, against
// each other on random inputs (including decay strong enough to underflow), state handling
// (nullptr s0 / sT, in-place decode), packed documents (doc_start), the backward of both forms
// (goldens, chunked vs BPTT, finite differences) and the `deltamoe op kda` CLI.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
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
// Backward.

namespace {

template <typename T>
struct KdaGrads {
  std::vector<T> dq, dk, dv, dg, dbeta, ds0;
};

// Gradients of Σ o·d_o + Σ sT·dsT (dsT == nullptr: 0); chunk == 0 selects BPTT.
template <typename T>
KdaGrads<T> run_kda_backward(const KdaProblem<T>& p, const std::vector<T>& d_o,
                             const std::type_identity_t<std::vector<T>>* dsT, int chunk,
                             bool with_s0 = true,
                             const int32_t* doc_start = nullptr) {
  const KdaShape& s = p.shape;
  KdaGrads<T> r;
  const size_t n_qk = size_t(s.B * s.T * s.H * s.K), n_v = size_t(s.B * s.T * s.H * s.V);
  r.dq.assign(n_qk, T(0));
  r.dk.assign(n_qk, T(0));
  r.dg.assign(n_qk, T(0));
  r.dv.assign(n_v, T(0));
  r.dbeta.assign(size_t(s.B * s.T * s.H), T(0));
  r.ds0.assign(size_t(s.B * s.H * s.K * s.V), T(0));
  const T* s0 = with_s0 ? p.s0.data() : nullptr;
  const T* dsT_ptr = dsT ? dsT->data() : nullptr;
  if (chunk == 0) {
    kda_recurrent_backward<T>(p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(), s0,
                              d_o.data(), dsT_ptr, r.dq.data(), r.dk.data(), r.dv.data(),
                              r.dg.data(), r.dbeta.data(), r.ds0.data(), s, default_scale<T>(s),
                              doc_start);
  } else {
    Arena ws(kda_chunk_backward_workspace_bytes<T>(s, chunk), "kda_backward_test_ws");
    kda_chunk_backward<T>(p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(), s0,
                          d_o.data(), dsT_ptr, r.dq.data(), r.dk.data(), r.dv.data(),
                          r.dg.data(), r.dbeta.data(), r.ds0.data(), s, default_scale<T>(s),
                          chunk, ws, doc_start);
    EXPECT_EQ(ws.used(), 0u) << "workspace not released";
  }
  return r;
}

template <typename T>
std::vector<std::pair<std::string, const std::vector<T>*>> grad_list(const KdaGrads<T>& g) {
  return {{"dq", &g.dq}, {"dk", &g.dk}, {"dv", &g.dv},
          {"dg", &g.dg}, {"dbeta", &g.dbeta}, {"ds0", &g.ds0}};
}

std::vector<double> random_normal_vector(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> x(n);
  for (auto& e : x) e = normal(rng);
  return x;
}

void check_golden_backward_file(const std::string& file) {
  if (!test::goldens_available()) GTEST_SKIP() << "goldens not found at " << test::goldens_dir();
  const auto reader = SafetensorsReader::open(test::goldens_dir() + "/" + file);
  const KdaProblem<double> p = load_golden_problem(reader);
  const KdaProblem<float> p32 = cast_problem<float>(p);
  const std::vector<double> d_o = test::to_f64(reader.get("do"));
  const std::vector<double> dsT = test::to_f64(reader.get("dsT"));
  const std::vector<float> d_o32 = cast_vector<float>(d_o), dsT32 = cast_vector<float>(dsT);
  for (int chunk : {0, 16, 32, 64}) {
    const std::string form = chunk == 0 ? "recurrent" : "chunk " + std::to_string(chunk);
    const KdaGrads<double> g64 = run_kda_backward(p, d_o, &dsT, chunk);
    const KdaGrads<float> g32 = run_kda_backward(p32, d_o32, &dsT32, chunk);
    const auto list64 = grad_list(g64);
    const auto list32 = grad_list(g32);
    std::string line;
    for (size_t i = 0; i < list64.size(); ++i) {
      const std::string& name = list64[i].first;
      const std::vector<double> ref = test::to_f64(reader.get(name));
      const std::vector<float> ref32 = test::to_f32(reader.get(name));
      const double err64 = test::rel_rms(list64[i].second->data(), ref.data(), ref.size());
      const double err32 = test::rel_rms(list32[i].second->data(), ref32.data(), ref32.size());
      char buf[96];
      std::snprintf(buf, sizeof buf, " %s %.1e/%.1e", name.c_str(), err64, err32);
      line += buf;
      EXPECT_LE(err64, 1e-10) << form << " " << name;
      EXPECT_LE(err32, 1e-4) << form << " " << name;
    }
    std::printf("[kda backward %s %-10s] f64/f32:%s\n", file.c_str(), form.c_str(), line.c_str());
  }
}

}  // namespace

TEST(KdaBackwardGolden, SmallMatchesReference) {
  check_golden_backward_file("kda_op_small.safetensors");
}
TEST(KdaBackwardGolden, LongMatchesReference) {
  check_golden_backward_file("kda_op_long.safetensors");
}

// Chunked backward == BPTT for lengths around chunk boundaries, with mixed weak / very strong
// decay, with and without s0 / dsT.
TEST(KdaBackward, ChunkMatchesRecurrentRandom) {
  for (int64_t T_len : {1, 17, 63, 64, 65, 130}) {
    const KdaShape shape{2, T_len, 3, 16, 12};
    const KdaProblem<double> p = random_problem(shape, 2000 + uint64_t(T_len));
    const KdaProblem<float> p32 = cast_problem<float>(p);
    const std::vector<double> d_o = random_normal_vector(size_t(shape.B * T_len * shape.H * shape.V), 1);
    const std::vector<double> dsT = random_normal_vector(size_t(shape.B * shape.H * shape.K * shape.V), 2);
    const std::vector<float> d_o32 = cast_vector<float>(d_o), dsT32 = cast_vector<float>(dsT);
    double worst64 = 0, worst32 = 0;
    for (bool with_state : {true, false}) {
      const std::vector<double>* dsT_ptr = with_state ? &dsT : nullptr;
      const std::vector<float>* dsT32_ptr = with_state ? &dsT32 : nullptr;
      const KdaGrads<double> ref = run_kda_backward(p, d_o, dsT_ptr, 0, with_state);
      for (int chunk : {16, 32, 64}) {
        const KdaGrads<double> r = run_kda_backward(p, d_o, dsT_ptr, chunk, with_state);
        const KdaGrads<float> r32 = run_kda_backward(p32, d_o32, dsT32_ptr, chunk, with_state);
        const auto ref_list = grad_list(ref), list = grad_list(r);
        const auto list32 = grad_list(r32);
        for (size_t i = 0; i < ref_list.size(); ++i) {
          const std::vector<double>& want = *ref_list[i].second;
          ASSERT_TRUE(all_finite(*list[i].second) && all_finite(*list32[i].second));
          const std::vector<float> want32 = cast_vector<float>(want);
          const double err = test::rel_rms(list[i].second->data(), want.data(), want.size());
          const double err32 =
              test::rel_rms(list32[i].second->data(), want32.data(), want32.size());
          worst64 = std::max(worst64, err);
          worst32 = std::max(worst32, err32);
          EXPECT_LE(err, 1e-11) << "T=" << T_len << " chunk=" << chunk << " "
                                << ref_list[i].first << " state=" << with_state;
          EXPECT_LE(err32, 1e-4) << "T=" << T_len << " chunk=" << chunk << " "
                                 << ref_list[i].first << " state=" << with_state;
        }
      }
    }
    std::printf("[kda backward chunk vs bptt T=%3lld] worst f64 %.1e f32 %.1e\n",
                (long long)T_len, worst64, worst32);
  }
}

// Every channel decays by e^{−20} or more per step: the backward must stay finite too.
TEST(KdaBackward, StrongDecayStaysFinite) {
  const KdaShape shape{1, 130, 2, 32, 16};
  const KdaProblem<double> p = random_problem(shape, 8, 3.0, 3.3);
  const KdaProblem<float> p32 = cast_problem<float>(p);
  const std::vector<double> d_o = random_normal_vector(size_t(shape.T * shape.H * shape.V), 3);
  const std::vector<double> dsT = random_normal_vector(size_t(shape.H * shape.K * shape.V), 4);
  const std::vector<float> d_o32 = cast_vector<float>(d_o), dsT32 = cast_vector<float>(dsT);
  const KdaGrads<double> ref = run_kda_backward(p, d_o, &dsT, 0);
  const auto ref_list = grad_list(ref);
  for (int chunk : {16, 32, 64}) {
    const KdaGrads<double> r = run_kda_backward(p, d_o, &dsT, chunk);
    const KdaGrads<float> r32 = run_kda_backward(p32, d_o32, &dsT32, chunk);
    const auto list = grad_list(r);
    const auto list32 = grad_list(r32);
    for (size_t i = 0; i < ref_list.size(); ++i) {
      const std::string& name = ref_list[i].first;
      ASSERT_TRUE(all_finite(*list[i].second) && all_finite(*list32[i].second)) << name;
      const std::vector<double>& want = *ref_list[i].second;
      if (name == "ds0") {  // ~e^{−20·130}: zero in every form; compare absolutely
        double max_abs = 0;
        for (size_t j = 0; j < want.size(); ++j)
          max_abs = std::max(max_abs, std::abs((*list[i].second)[j] - want[j]));
        EXPECT_LE(max_abs, 1e-12) << chunk;
        continue;
      }
      const std::vector<float> want32 = cast_vector<float>(want);
      const double err = test::rel_rms(list[i].second->data(), want.data(), want.size());
      const double err32 = test::rel_rms(list32[i].second->data(), want32.data(), want32.size());
      std::printf("[kda backward strong decay chunk %d %-5s] f64 %.1e f32 %.1e\n", chunk,
                  name.c_str(), err, err32);
      EXPECT_LE(err, 1e-11) << chunk << " " << name;
      EXPECT_LE(err32, 1e-4) << chunk << " " << name;
    }
  }
}

// Central differences in double of L = Σ o·R + Σ sT·Rs against both backwards.
TEST(KdaBackward, FiniteDifferencesDouble) {
  const KdaShape shape{2, 21, 2, 8, 6};
  const KdaProblem<double> base = random_problem(shape, 99, -5.0, 1.0);
  const std::vector<double> r_o = random_normal_vector(size_t(shape.B * shape.T * shape.H * shape.V), 5);
  const std::vector<double> r_s = random_normal_vector(size_t(shape.B * shape.H * shape.K * shape.V), 6);
  for (int chunk : {0, 16}) {
    auto loss = [&](const KdaProblem<double>& p) {
      const KdaResult<double> r = run_kda(p, chunk);
      double total = 0;
      for (size_t i = 0; i < r.o.size(); ++i) total += r.o[i] * r_o[i];
      for (size_t i = 0; i < r.sT.size(); ++i) total += r.sT[i] * r_s[i];
      return total;
    };
    const KdaGrads<double> analytic = run_kda_backward(base, r_o, &r_s, chunk);
    using Field = std::vector<double> KdaProblem<double>::*;
    const std::vector<std::tuple<std::string, Field, const std::vector<double>*>> fields = {
        {"q", &KdaProblem<double>::q, &analytic.dq},   {"k", &KdaProblem<double>::k, &analytic.dk},
        {"v", &KdaProblem<double>::v, &analytic.dv},   {"g", &KdaProblem<double>::g, &analytic.dg},
        {"beta", &KdaProblem<double>::beta, &analytic.dbeta},
        {"s0", &KdaProblem<double>::s0, &analytic.ds0}};
    std::mt19937_64 rng(123);
    for (const auto& [name, field, grad] : fields) {
      const size_t n = (base.*field).size();
      std::vector<double> numeric, expected;
      for (int sample = 0; sample < 60; ++sample) {
        const size_t i = size_t(rng() % n);
        KdaProblem<double> p = base;
        const double x = (base.*field)[i];
        const double h = 1e-6 * std::max(1.0, std::abs(x));
        (p.*field)[i] = x + h;
        const double up = loss(p);
        (p.*field)[i] = x - h;
        const double down = loss(p);
        numeric.push_back((up - down) / (2 * h));
        expected.push_back((*grad)[i]);
      }
      const double err = test::rel_rms(expected.data(), numeric.data(), numeric.size());
      std::printf("[kda fd %-9s %-4s] rel err %.2e\n", chunk == 0 ? "recurrent" : "chunk 16",
                  name.c_str(), err);
      EXPECT_LE(err, 1e-6) << name << " chunk=" << chunk;
    }
  }
}

// Packed documents: one row holding several documents equals running each document as its own
// sequence (the first from s0, the others from the zero state), forward and backward. Documents
// start inside chunks, at a chunk boundary, and one is a single token.
TEST(KdaDocStart, PackedEqualsSeparate) {
  const std::vector<std::vector<int64_t>> row_docs = {{23, 41}, {16, 1, 30, 17}};
  const int64_t T_len = 64, H = 2, K = 8, V = 6;
  const KdaShape packed_shape{int64_t(row_docs.size()), T_len, H, K, V};
  const KdaProblem<double> packed = random_problem(packed_shape, 31, -4.0, 1.0);
  const std::vector<double> d_o = random_normal_vector(size_t(2 * T_len * H * V), 7);
  const std::vector<double> dsT = random_normal_vector(size_t(2 * H * K * V), 8);
  std::vector<int32_t> doc_start(size_t(2 * T_len));
  for (size_t b = 0; b < row_docs.size(); ++b) {
    int64_t start = 0;
    for (int64_t len : row_docs[b]) {
      for (int64_t t = start; t < start + len; ++t) doc_start[b * T_len + t] = int32_t(start);
      start += len;
    }
    ASSERT_EQ(start, T_len);
  }
  // Slices [start, start+len) of row b of a [B, T, H, W] tensor → a [1, len, H, W] tensor.
  auto slice = [&](const std::vector<double>& x, size_t b, int64_t start, int64_t len,
                   int64_t width) {
    const double* from = x.data() + (int64_t(b) * T_len + start) * H * width;
    return std::vector<double>(from, from + len * H * width);
  };
  for (int chunk : {0, 16, 32, 64}) {
    const KdaResult<double> fwd = [&] {
      KdaResult<double> r;
      r.o.assign(d_o.size(), 0.0);
      r.sT.assign(dsT.size(), 0.0);
      if (chunk == 0) {
        kda_recurrent_forward<double>(packed.q.data(), packed.k.data(), packed.v.data(),
                                      packed.g.data(), packed.beta.data(), packed.s0.data(),
                                      r.o.data(), r.sT.data(), packed_shape,
                                      default_scale<double>(packed_shape), doc_start.data());
      } else {
        Arena ws(kda_chunk_workspace_bytes<double>(packed_shape, chunk));
        kda_chunk_forward<double>(packed.q.data(), packed.k.data(), packed.v.data(),
                                  packed.g.data(), packed.beta.data(), packed.s0.data(),
                                  r.o.data(), r.sT.data(), packed_shape,
                                  default_scale<double>(packed_shape), chunk, ws,
                                  doc_start.data());
      }
      return r;
    }();
    const KdaGrads<double> bwd =
        run_kda_backward(packed, d_o, &dsT, chunk, true, doc_start.data());
    for (size_t b = 0; b < row_docs.size(); ++b) {
      int64_t start = 0;
      for (size_t doc = 0; doc < row_docs[b].size(); ++doc) {
        const int64_t len = row_docs[b][doc];
        const bool first = doc == 0, last = doc + 1 == row_docs[b].size();
        KdaProblem<double> one;
        one.shape = {1, len, H, K, V};
        one.q = slice(packed.q, b, start, len, K);
        one.k = slice(packed.k, b, start, len, K);
        one.g = slice(packed.g, b, start, len, K);
        one.v = slice(packed.v, b, start, len, V);
        one.beta = slice(packed.beta, b, start, len, 1);
        one.s0.assign(packed.s0.begin() + b * H * K * V, packed.s0.begin() + (b + 1) * H * K * V);
        const std::vector<double> one_d_o = slice(d_o, b, start, len, V);
        const std::vector<double> one_dsT(dsT.begin() + b * H * K * V,
                                          dsT.begin() + (b + 1) * H * K * V);
        const KdaResult<double> want = run_kda(one, chunk, first);
        const KdaGrads<double> want_grads =
            run_kda_backward(one, one_d_o, last ? &one_dsT : nullptr, chunk, first);
        const std::string where = "chunk=" + std::to_string(chunk) + " row=" +
                                  std::to_string(b) + " doc=" + std::to_string(doc);
        auto expect_close = [&](const std::vector<double>& got, const std::vector<double>& ref,
                                const std::string& what) {
          ASSERT_EQ(got.size(), ref.size());
          EXPECT_LE(test::rel_rms(got.data(), ref.data(), ref.size()), 1e-12) << where << " " << what;
        };
        expect_close(slice(fwd.o, b, start, len, V), want.o, "o");
        expect_close(slice(bwd.dq, b, start, len, K), want_grads.dq, "dq");
        expect_close(slice(bwd.dk, b, start, len, K), want_grads.dk, "dk");
        expect_close(slice(bwd.dg, b, start, len, K), want_grads.dg, "dg");
        expect_close(slice(bwd.dv, b, start, len, V), want_grads.dv, "dv");
        expect_close(slice(bwd.dbeta, b, start, len, 1), want_grads.dbeta, "dbeta");
        if (first) {
          const std::vector<double> ds0_row(bwd.ds0.begin() + b * H * K * V,
                                            bwd.ds0.begin() + (b + 1) * H * K * V);
          expect_close(ds0_row, want_grads.ds0, "ds0");
        }
        if (last) {
          const std::vector<double> sT_row(fwd.sT.begin() + b * H * K * V,
                                           fwd.sT.begin() + (b + 1) * H * K * V);
          expect_close(sT_row, want.sT, "sT");
        }
        start += len;
      }
    }
  }
}

// Gradients accumulate: running the backward twice into the same buffers doubles them.
TEST(KdaBackward, Accumulates) {
  const KdaProblem<double> p = random_problem({1, 40, 2, 8, 8}, 41);
  const std::vector<double> d_o = random_normal_vector(size_t(40 * 2 * 8), 9);
  for (int chunk : {0, 16}) {
    const KdaGrads<double> once = run_kda_backward(p, d_o, nullptr, chunk);
    KdaGrads<double> twice = once;
    const KdaShape& s = p.shape;
    if (chunk == 0) {
      kda_recurrent_backward<double>(p.q.data(), p.k.data(), p.v.data(), p.g.data(),
                                     p.beta.data(), p.s0.data(), d_o.data(), nullptr,
                                     twice.dq.data(), twice.dk.data(), twice.dv.data(),
                                     twice.dg.data(), twice.dbeta.data(), twice.ds0.data(), s,
                                     default_scale<double>(s));
    } else {
      Arena ws(kda_chunk_backward_workspace_bytes<double>(s, chunk));
      kda_chunk_backward<double>(p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(),
                                 p.s0.data(), d_o.data(), nullptr, twice.dq.data(),
                                 twice.dk.data(), twice.dv.data(), twice.dg.data(),
                                 twice.dbeta.data(), twice.ds0.data(), s,
                                 default_scale<double>(s), chunk, ws);
    }
    const auto a = grad_list(once), b2 = grad_list(twice);
    for (size_t i = 0; i < a.size(); ++i)
      for (size_t j = 0; j < a[i].second->size(); ++j)
        ASSERT_NEAR((*b2[i].second)[j], 2 * (*a[i].second)[j], 1e-12) << a[i].first;
  }
}

// Large enough for the OpenMP path: same gradients as one thread.
TEST(KdaBackward, ParallelMatchesSerial) {
  const KdaProblem<double> p = random_problem({2, 100, 4, 32, 32}, 16);
  const std::vector<double> d_o = random_normal_vector(size_t(2 * 100 * 4 * 32), 10);
  const int saved_threads = num_threads();
  set_num_threads(1);
  const KdaGrads<double> serial = run_kda_backward(p, d_o, nullptr, 64);
  set_num_threads(std::max(saved_threads, 4));
  const KdaGrads<double> parallel = run_kda_backward(p, d_o, nullptr, 64);
  const KdaGrads<double> parallel_recurrent = run_kda_backward(p, d_o, nullptr, 0);
  set_num_threads(saved_threads);
  const auto a = grad_list(serial), b = grad_list(parallel), c = grad_list(parallel_recurrent);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE(test::rel_rms(b[i].second->data(), a[i].second->data(), a[i].second->size()), 1e-13)
        << a[i].first;
    EXPECT_LE(test::rel_rms(c[i].second->data(), a[i].second->data(), a[i].second->size()), 1e-11)
        << a[i].first;
  }
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

// With `do` and `dsT` in the input the CLI also writes the gradients; without them it does not.
TEST(KdaCli, WritesGoldenGradients) {
  if (!test::goldens_available()) GTEST_SKIP() << "goldens not found at " << test::goldens_dir();
  const std::string dir = test::temp_dir("kda_cli_backward");
  for (const std::string file : {"kda_op_small.safetensors", "kda_op_long.safetensors"}) {
    const std::string input = test::goldens_dir() + "/" + file;
    const auto golden = SafetensorsReader::open(input);
    struct Case {
      std::string flags;
      DType dtype;
      double tolerance;
    };
    for (const Case& c : {Case{"", DType::F64, 1e-10}, Case{"--chunk recurrent", DType::F64, 1e-10},
                          Case{"--chunk 16 --dtype f32", DType::F32, 1e-4}}) {
      const std::string output = dir + "/grads.safetensors";
      const auto res = test::run_cli("op kda --input " + input + " --output " + output + " " +
                                     c.flags);
      ASSERT_EQ(res.exit_code, 0) << c.flags << ": " << res.output;
      const auto out = SafetensorsReader::open(output);
      std::string line;
      for (const char* name : {"dq", "dk", "dv", "dg", "dbeta", "ds0"}) {
        ASSERT_TRUE(out.has(name)) << name;
        EXPECT_EQ(out.get(name).dtype, c.dtype) << name;
        EXPECT_EQ(out.get(name).shape, golden.get(name).shape) << name;
        const std::vector<double> got = test::to_f64(out.get(name));
        const std::vector<double> want = test::to_f64(golden.get(name));
        const double err = test::rel_rms(got.data(), want.data(), want.size());
        char buf[48];
        std::snprintf(buf, sizeof buf, " %s %.1e", name, err);
        line += buf;
        EXPECT_LE(err, c.tolerance) << file << " " << c.flags << " " << name;
      }
      std::printf("[kda cli backward %s %-24s]%s\n", file.c_str(), c.flags.c_str(), line.c_str());
    }
  }
  // Forward-only input: no gradient tensors.
  const auto golden = SafetensorsReader::open(test::goldens_dir() + "/kda_op_small.safetensors");
  SafetensorsWriter w;
  for (const char* name : {"q", "k", "v", "g", "beta", "s0"}) w.add(name, golden.get(name));
  const std::string input = dir + "/forward_only.safetensors";
  w.write(input);
  const auto res = test::run_cli("op kda --input " + input + " --output " + dir + "/fwd.safetensors");
  ASSERT_EQ(res.exit_code, 0) << res.output;
  const auto out = SafetensorsReader::open(dir + "/fwd.safetensors");
  EXPECT_TRUE(out.has("o"));
  EXPECT_FALSE(out.has("dq"));
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
