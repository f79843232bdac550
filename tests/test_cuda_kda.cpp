// CUDA KDA (ops/cuda/kda.h) against the CPU operator (ops/cpu/kda.h) in double: the recurrent
// kernel (many-token runs and in-place decode steps), the chunked forward (fp32 CUDA-core path
// and bf16 path) and the chunked backward, on ragged shapes (T around chunk boundaries, T = 1,
// odd K and V), gates down to −27 per step, packed documents (doc_start) and null / in-place
// states. fp32: relative RMS ≤ 1e-5 for outputs and states, ≤ 1e-4 for gradients (the CPU fp32
// backward's own bound against double, tests/test_kda.cpp); bf16 inputs: ≤ 1e-2 against double
// on the bf16-rounded inputs, for both stage-4 paths of the bf16 backward (reference and tensor
// cores). Without a GPU every test skips.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda_test_util.h"
#include "ops/cpu/kda.h"
#include "ops/cuda/device.h"
#include "ops/cuda/kda.h"
#include "test_util.h"

namespace {

namespace cu = dm::cuda;
using dm::KdaShape;
using dm::test::all_finite;
using dm::test::DeviceScratch;
using dm::test::from_bf16;
using dm::test::to_bf16;

// Operator inputs in double (the reference's type); the GPU gets them as float or bf16.
struct KdaInputs {
  KdaShape shape;
  std::vector<double> q, k, v, g, beta, s0;
  std::vector<int32_t> doc_start;  // empty: one document per row
};

// g per channel: −exp(U(lo, hi)); (−6, 3.3) spans ~0 to −27 per step.
KdaInputs random_inputs(KdaShape s, uint64_t seed, double log_decay_lo = -6.0,
                        double log_decay_hi = 3.3) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0), log_decay(log_decay_lo, log_decay_hi);
  KdaInputs p;
  p.shape = s;
  const size_t n_qk = size_t(s.B * s.T * s.H * s.K), n_v = size_t(s.B * s.T * s.H * s.V);
  auto fill = [&](std::vector<double>& x, size_t n, auto&& draw) {
    x.resize(n);
    for (double& e : x) e = draw();
  };
  fill(p.q, n_qk, [&] { return normal(rng); });
  fill(p.k, n_qk, [&] { return normal(rng); });
  fill(p.v, n_v, [&] { return normal(rng); });
  fill(p.g, n_qk, [&] { return -std::exp(log_decay(rng)); });
  fill(p.beta, size_t(s.B * s.T * s.H), [&] { return unit(rng); });
  fill(p.s0, size_t(s.B * s.H * s.K * s.V), [&] { return 0.5 * normal(rng); });
  return p;
}

// Documents starting at the given in-row positions (and 0), for every row.
std::vector<int32_t> make_doc_start(const KdaShape& s, const std::vector<int64_t>& starts) {
  std::vector<int32_t> doc(size_t(s.B * s.T));
  for (int64_t b = 0; b < s.B; ++b) {
    int32_t current = 0;
    for (int64_t t = 0; t < s.T; ++t) {
      for (int64_t start : starts)
        if (start == t) current = int32_t(t);
      doc[size_t(b * s.T + t)] = current;
    }
  }
  return doc;
}

// Rounds every input through bf16 (so the double reference sees what a bf16 kernel sees).
void round_inputs_bf16(KdaInputs& p) {
  for (auto* x : {&p.q, &p.k, &p.v, &p.g, &p.beta})
    for (double& e : *x) e = double(cu::bf16_to_float(cu::float_to_bf16(float(e))));
}

std::vector<float> to_float(const std::vector<double>& x) { return {x.begin(), x.end()}; }

double rel_rms(const std::vector<float>& got, const std::vector<double>& want) {
  const std::vector<float> want32 = to_float(want);
  EXPECT_EQ(got.size(), want32.size());
  return dm::test::rel_rms(got.data(), want32.data(), want32.size());
}

double default_scale(const KdaShape& s) { return 1.0 / std::sqrt(double(s.K)); }

struct KdaForwardResult {
  std::vector<double> o, sT;
};

KdaForwardResult cpu_forward(const KdaInputs& p, bool with_s0) {
  const KdaShape& s = p.shape;
  KdaForwardResult r;
  r.o.assign(size_t(s.B * s.T * s.H * s.V), 0.0);
  r.sT.assign(size_t(s.B * s.H * s.K * s.V), 0.0);
  dm::kda_recurrent_forward<double>(p.q.data(), p.k.data(), p.v.data(), p.g.data(),
                                    p.beta.data(), with_s0 ? p.s0.data() : nullptr, r.o.data(),
                                    r.sT.data(), s, default_scale(s),
                                    p.doc_start.empty() ? nullptr : p.doc_start.data());
  return r;
}

enum class KdaGpuForm { Recurrent, Chunked };

// Runs the GPU forward with float (bf16 = false) or bf16 storage; returns o and sT as float.
std::pair<std::vector<float>, std::vector<float>> gpu_forward(const KdaInputs& p, KdaGpuForm form,
                                                              bool bf16, bool with_s0) {
  const KdaShape& s = p.shape;
  const size_t n_o = size_t(s.B * s.T * s.H * s.V), n_state = size_t(s.B * s.H * s.K * s.V);
  const size_t ws_bytes = form == KdaGpuForm::Chunked ? cu::kda_chunk_forward_workspace_bytes(s) : 0;
  DeviceScratch dev(8 * (p.q.size() + p.k.size() + p.v.size() + p.g.size() + p.beta.size()) +
                    8 * n_o + 8 * n_state + 4 * p.doc_start.size() + ws_bytes + (1 << 20));
  const float* s0 = with_s0 ? dev.upload(to_float(p.s0)) : nullptr;
  float* sT = dev.zeros<float>(n_state);
  const int32_t* doc = p.doc_start.empty() ? nullptr : dev.upload(p.doc_start);
  void* ws = ws_bytes ? dev.raw(ws_bytes) : nullptr;
  const float scale = float(default_scale(s));
  std::vector<float> o;
  if (bf16) {
    auto up = [&](const std::vector<double>& x) { return dev.upload(to_bf16(to_float(x))); };
    const uint16_t *q = up(p.q), *k = up(p.k), *v = up(p.v), *g = up(p.g), *beta = up(p.beta);
    uint16_t* o_d = dev.zeros<uint16_t>(n_o);
    if (form == KdaGpuForm::Chunked)
      cu::kda_chunk_forward(q, k, v, g, beta, s0, o_d, sT, s, scale, ws, doc);
    else
      cu::kda_recurrent_forward(q, k, v, g, beta, s0, o_d, sT, s, scale, doc);
    o = from_bf16(DeviceScratch::download(o_d, n_o));
  } else {
    auto up = [&](const std::vector<double>& x) { return dev.upload(to_float(x)); };
    const float *q = up(p.q), *k = up(p.k), *v = up(p.v), *g = up(p.g), *beta = up(p.beta);
    float* o_d = dev.zeros<float>(n_o);
    if (form == KdaGpuForm::Chunked)
      cu::kda_chunk_forward(q, k, v, g, beta, s0, o_d, sT, s, scale, ws, doc);
    else
      cu::kda_recurrent_forward(q, k, v, g, beta, s0, o_d, sT, s, scale, doc);
    o = DeviceScratch::download(o_d, n_o);
  }
  return {o, DeviceScratch::download(sT, n_state)};
}

void check_forward(const KdaInputs& p, KdaGpuForm form, bool bf16, bool with_s0,
                   const std::string& what) {
  const KdaForwardResult ref = cpu_forward(p, with_s0);
  const auto [o, sT] = gpu_forward(p, form, bf16, with_s0);
  const double tolerance = bf16 ? 1e-2 : 1e-5;
  EXPECT_TRUE(all_finite(o) && all_finite(sT)) << what;
  if (!ref.o.empty()) {
    EXPECT_LE(rel_rms(o, ref.o), tolerance) << what << " (o)";
  }
  EXPECT_LE(rel_rms(sT, ref.sT), tolerance) << what << " (sT)";
}

std::string describe(const KdaShape& s, const char* extra) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " H=" + std::to_string(s.H) +
         " K=" + std::to_string(s.K) + " V=" + std::to_string(s.V) + " " + extra;
}

// Ragged shapes: T around chunk boundaries and T = 1; odd K, V; full-size heads.
const KdaShape kForwardShapes[] = {{2, 1, 3, 16, 12},  {2, 17, 3, 16, 12}, {1, 63, 2, 7, 5},
                                   {2, 64, 3, 16, 12}, {1, 65, 2, 33, 17}, {2, 130, 3, 16, 12},
                                   {1, 200, 2, 128, 128}};

// ---------------------------------------------------------------------------------------------

TEST(CudaKdaRecurrent, MatchesCpuF32AndBf16) {
  DM_SKIP_WITHOUT_GPU();
  uint64_t seed = 100;
  for (const KdaShape& s : kForwardShapes) {
    KdaInputs p = random_inputs(s, ++seed);
    check_forward(p, KdaGpuForm::Recurrent, false, true, describe(s, "recurrent f32"));
    check_forward(p, KdaGpuForm::Recurrent, false, false, describe(s, "recurrent f32 no s0"));
    round_inputs_bf16(p);
    check_forward(p, KdaGpuForm::Recurrent, true, true, describe(s, "recurrent bf16"));
  }
  // K beyond the chunked limit is fine for the recurrent kernel.
  check_forward(random_inputs({1, 5, 2, 200, 40}, 7), KdaGpuForm::Recurrent, false, true,
                "recurrent K=200");
}

// Decode: T = 1 steps with the state carried in place (s0 == sT) equal one call over all tokens.
TEST(CudaKdaRecurrent, InPlaceDecodeStepsMatchOneShot) {
  DM_SKIP_WITHOUT_GPU();
  const KdaShape whole{3, 9, 4, 128, 128};
  const KdaInputs p = random_inputs(whole, 5);
  const KdaForwardResult ref = cpu_forward(p, true);
  const KdaShape step{whole.B, 1, whole.H, whole.K, whole.V};
  const int64_t row_k = whole.H * whole.K, row_v = whole.H * whole.V;
  DeviceScratch dev(size_t(1) << 24);
  float* state = dev.upload(to_float(p.s0));
  float* q = dev.zeros<float>(size_t(whole.B * row_k));
  float* k = dev.zeros<float>(size_t(whole.B * row_k));
  float* g = dev.zeros<float>(size_t(whole.B * row_k));
  float* v = dev.zeros<float>(size_t(whole.B * row_v));
  float* beta = dev.zeros<float>(size_t(whole.B * whole.H));
  float* o = dev.zeros<float>(size_t(whole.B * row_v));
  std::vector<float> o_all(ref.o.size());
  const float scale = float(default_scale(whole));
  for (int64_t t = 0; t < whole.T; ++t) {
    // Gather token t of every sequence into a [B, 1, H, ·] batch.
    std::vector<float> qs, ks, gs, vs, betas;
    for (int64_t b = 0; b < whole.B; ++b) {
      const size_t at_k = size_t((b * whole.T + t) * row_k), at_v = size_t((b * whole.T + t) * row_v);
      qs.insert(qs.end(), p.q.begin() + long(at_k), p.q.begin() + long(at_k + size_t(row_k)));
      ks.insert(ks.end(), p.k.begin() + long(at_k), p.k.begin() + long(at_k + size_t(row_k)));
      gs.insert(gs.end(), p.g.begin() + long(at_k), p.g.begin() + long(at_k + size_t(row_k)));
      vs.insert(vs.end(), p.v.begin() + long(at_v), p.v.begin() + long(at_v + size_t(row_v)));
      for (int64_t h = 0; h < whole.H; ++h) betas.push_back(float(p.beta[size_t((b * whole.T + t) * whole.H + h)]));
    }
    cu::copy_to_device(q, qs.data(), qs.size() * 4);
    cu::copy_to_device(k, ks.data(), ks.size() * 4);
    cu::copy_to_device(g, gs.data(), gs.size() * 4);
    cu::copy_to_device(v, vs.data(), vs.size() * 4);
    cu::copy_to_device(beta, betas.data(), betas.size() * 4);
    cu::kda_recurrent_forward(q, k, v, g, beta, state, o, state, step, scale);
    const std::vector<float> o_step = DeviceScratch::download(o, size_t(whole.B * row_v));
    for (int64_t b = 0; b < whole.B; ++b)
      for (int64_t i = 0; i < row_v; ++i)
        o_all[size_t((b * whole.T + t) * row_v + i)] = o_step[size_t(b * row_v + i)];
  }
  EXPECT_LE(rel_rms(o_all, ref.o), 1e-5);
  EXPECT_LE(rel_rms(DeviceScratch::download(state, ref.sT.size()), ref.sT), 1e-5);
}

TEST(CudaKdaChunk, ForwardMatchesCpuF32) {
  DM_SKIP_WITHOUT_GPU();
  uint64_t seed = 200;
  for (const KdaShape& s : kForwardShapes) {
    const KdaInputs p = random_inputs(s, ++seed);
    check_forward(p, KdaGpuForm::Chunked, false, true, describe(s, "chunked f32"));
    check_forward(p, KdaGpuForm::Chunked, false, false, describe(s, "chunked f32 no s0"));
  }
  // T = 0: no output, sT = s0.
  check_forward(random_inputs({2, 0, 3, 16, 12}, 9), KdaGpuForm::Chunked, false, true, "T=0");
}

TEST(CudaKdaChunk, ForwardMatchesCpuBf16) {
  DM_SKIP_WITHOUT_GPU();
  uint64_t seed = 300;
  for (const KdaShape& s : kForwardShapes) {
    KdaInputs p = random_inputs(s, ++seed);
    round_inputs_bf16(p);
    check_forward(p, KdaGpuForm::Chunked, true, true, describe(s, "chunked bf16"));
  }
}

// Every channel decays by e^{−20}…e^{−27} per step: e^{−Γ} would overflow within 4 tokens.
TEST(CudaKdaChunk, StrongDecayStaysFinite) {
  DM_SKIP_WITHOUT_GPU();
  const KdaInputs p = random_inputs({1, 130, 2, 32, 16}, 7, 3.0, 3.3);
  check_forward(p, KdaGpuForm::Chunked, false, true, "strong decay chunked");
  check_forward(p, KdaGpuForm::Recurrent, false, true, "strong decay recurrent");
}

// Packed documents: starts inside chunks, exactly at a chunk start, and on adjacent tokens.
TEST(CudaKdaChunk, DocStartMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  const KdaShape s{2, 150, 2, 16, 12};
  KdaInputs p = random_inputs(s, 11, -4.0, 1.0);
  p.doc_start = make_doc_start(s, {5, 6, 64, 100, 149});
  check_forward(p, KdaGpuForm::Chunked, false, true, "doc_start chunked");
  check_forward(p, KdaGpuForm::Recurrent, false, true, "doc_start recurrent");
}

TEST(CudaKdaChunk, RejectsBadInput) {
  DM_SKIP_WITHOUT_GPU();
  const float* none = nullptr;
  EXPECT_THROW(cu::kda_chunk_forward_workspace_bytes({1, 64, 1, 129, 16}), dm::Error);  // K > 128
  EXPECT_THROW(cu::kda_chunk_forward(none, none, none, none, none, nullptr, nullptr, nullptr,
                                     {1, 64, 1, 16, 16}, 0.25f, nullptr),
               dm::Error);  // missing workspace
  EXPECT_THROW(cu::kda_recurrent_forward(none, none, none, none, none, nullptr, nullptr, nullptr,
                                         {1, 4, 1, 300, 16}, 0.25f),
               dm::Error);  // K > 256
}

// ---------------------------------------------------------------------------------------------
// Backward: GPU chunked backward vs CPU BPTT in double. Gradient buffers start from random
// values, so accumulation (+=) is checked too.

struct KdaGradients {
  std::vector<double> dq, dk, dv, dg, dbeta, ds0;
};

// What one GPU backward added to each gradient (downloaded − initial contents).
struct KdaGradientsF {
  std::vector<float> dq, dk, dv, dg, dbeta, ds0;
};

// nonzero_initial: gradient buffers start from random values (checks +=); off where gradients are
// tiny (strong decay: dg ~ e^{−20}) and the float subtraction of the initial values would swamp
// them. path: stage 4 of the bf16 backward (fp32 always runs the reference). store (bf16): the op
// stores dq, dk, dv, dg, dβ (accumulate = false) over buffers holding NaN, so an element it reads
// or leaves unwritten shows. Returns what was added (or stored).
KdaGradientsF check_backward(const KdaInputs& p, bool bf16, const std::string& what,
                             bool nonzero_initial = true,
                             cu::KdaBackwardPath path = cu::KdaBackwardPath::Reference,
                             bool reuse_forward = false, bool store = false) {
  const KdaShape& s = p.shape;
  const size_t n_qk = p.q.size(), n_v = p.v.size(), n_beta = p.beta.size(), n_state = p.s0.size();
  const std::vector<double> d_o = [&] {
    std::vector<double> x(n_v);
    std::mt19937_64 rng(77);
    std::normal_distribution<double> normal(0.0, 1.0);
    for (double& e : x) e = bf16 ? double(cu::bf16_to_float(cu::float_to_bf16(float(normal(rng))))) : normal(rng);
    return x;
  }();
  std::vector<double> dsT(n_state);
  {
    std::mt19937_64 rng(78);
    std::normal_distribution<double> normal(0.0, 0.3);
    for (double& e : dsT) e = normal(rng);
  }
  // Initial gradient contents (the op accumulates into them).
  auto initial = [&](size_t n, uint64_t seed) {
    return nonzero_initial ? dm::test::random_normal(n, seed) : std::vector<float>(n, 0.0f);
  };
  // Stored outputs: nothing to subtract afterwards (ds0 always accumulates).
  auto initial_or_zero = [&](size_t n, uint64_t seed) {
    return store ? std::vector<float>(n, 0.0f) : initial(n, seed);
  };
  const std::vector<float> dq0 = initial_or_zero(n_qk, 81), dk0 = initial_or_zero(n_qk, 82);
  const std::vector<float> dv0 = initial_or_zero(n_v, 83), dg0 = initial_or_zero(n_qk, 84);
  const std::vector<float> dbeta0 = initial_or_zero(n_beta, 85);
  const std::vector<float> ds00 = initial(n_state, 86);

  KdaGradients ref{std::vector<double>(n_qk), std::vector<double>(n_qk), std::vector<double>(n_v),
                   std::vector<double>(n_qk), std::vector<double>(n_beta), std::vector<double>(n_state)};
  const int32_t* doc_host = p.doc_start.empty() ? nullptr : p.doc_start.data();
  dm::kda_recurrent_backward<double>(p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(),
                                     p.s0.data(), d_o.data(), dsT.data(), ref.dq.data(),
                                     ref.dk.data(), ref.dv.data(), ref.dg.data(), ref.dbeta.data(),
                                     ref.ds0.data(), s, default_scale(s), doc_host);

  const size_t ws_bytes =
      cu::kda_chunk_backward_workspace_bytes(s, bf16 ? path : cu::KdaBackwardPath::Reference);
  DeviceScratch dev(16 * (3 * n_qk + 2 * n_v + n_beta + 2 * n_state) + 4 * p.doc_start.size() +
                    ws_bytes + (1 << 20));
  const float* s0 = dev.upload(to_float(p.s0));
  const float* dsT_d = dev.upload(to_float(dsT));
  auto contents = [&](const std::vector<float>& x) {
    return store ? std::vector<float>(x.size(), std::numeric_limits<float>::quiet_NaN()) : x;
  };
  float* dq = dev.upload(contents(dq0));
  float* dk = dev.upload(contents(dk0));
  float* dv = dev.upload(contents(dv0));
  float* dg = dev.upload(contents(dg0));
  float* dbeta = dev.upload(contents(dbeta0));
  float* ds0 = dev.upload(ds00);
  const int32_t* doc = p.doc_start.empty() ? nullptr : dev.upload(p.doc_start);
  void* ws = ws_bytes ? dev.raw(ws_bytes) : nullptr;
  const float scale = float(default_scale(s));
  if (bf16) {
    auto up = [&](const std::vector<double>& x) { return dev.upload(to_bf16(to_float(x))); };
    const uint16_t *q = up(p.q), *k = up(p.k), *v = up(p.v), *g = up(p.g), *beta = up(p.beta);
    if (reuse_forward) {  // the forward fills ws; the backward must not need its own recompute
      uint16_t* o = dev.upload(std::vector<uint16_t>(n_v));
      cu::kda_chunk_forward(q, k, v, g, beta, s0, o, nullptr, s, scale, ws, doc);
    }
    cu::kda_chunk_backward(q, k, v, g, beta, s0, up(d_o), dsT_d, dq, dk, dv, dg, dbeta, ds0, s,
                           scale, ws, doc, nullptr, path, reuse_forward, nullptr,
                           /*accumulate=*/!store);
  } else {
    EXPECT_FALSE(store) << "the fp32 overload always accumulates";
    auto up = [&](const std::vector<double>& x) { return dev.upload(to_float(x)); };
    cu::kda_chunk_backward(up(p.q), up(p.k), up(p.v), up(p.g), up(p.beta), s0, up(d_o), dsT_d, dq,
                           dk, dv, dg, dbeta, ds0, s, scale, ws, doc);
  }
  const double tolerance = bf16 ? 1e-2 : 1e-4;
  // What the op added = downloaded − initial contents; compared with the pure reference gradient
  // (an op that overwrote instead of accumulating would be off by the initial contents).
  KdaGradientsF got;
  struct Check {
    const char* name;
    const float* device;
    const std::vector<float>* initial;
    const std::vector<double>* want;
    std::vector<float>* added;
  };
  const Check checks[] = {{"dq", dq, &dq0, &ref.dq, &got.dq},
                          {"dk", dk, &dk0, &ref.dk, &got.dk},
                          {"dv", dv, &dv0, &ref.dv, &got.dv},
                          {"dg", dg, &dg0, &ref.dg, &got.dg},
                          {"dbeta", dbeta, &dbeta0, &ref.dbeta, &got.dbeta},
                          {"ds0", ds0, &ds00, &ref.ds0, &got.ds0}};
  for (const Check& c : checks) {
    std::vector<float> added = DeviceScratch::download(c.device, c.want->size());
    EXPECT_TRUE(all_finite(added)) << what << " " << c.name;
    for (size_t i = 0; i < added.size(); ++i) added[i] -= (*c.initial)[i];
    EXPECT_LE(rel_rms(added, *c.want), tolerance) << what << " " << c.name;
    *c.added = std::move(added);
  }
  return got;
}

// Two GPU backwards of the same inputs agree: every gradient within `tolerance` relative RMS,
// ds0 within `tolerance_ds0`.
void expect_gradients_close(const KdaGradientsF& got, const KdaGradientsF& want, double tolerance,
                            double tolerance_ds0, const std::string& what) {
  auto as_double = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  EXPECT_LE(rel_rms(got.dq, as_double(want.dq)), tolerance) << what << " dq";
  EXPECT_LE(rel_rms(got.dk, as_double(want.dk)), tolerance) << what << " dk";
  EXPECT_LE(rel_rms(got.dv, as_double(want.dv)), tolerance) << what << " dv";
  EXPECT_LE(rel_rms(got.dg, as_double(want.dg)), tolerance) << what << " dg";
  EXPECT_LE(rel_rms(got.dbeta, as_double(want.dbeta)), tolerance) << what << " dbeta";
  EXPECT_LE(rel_rms(got.ds0, as_double(want.ds0)), tolerance_ds0) << what << " ds0";
}

TEST(CudaKdaBackward, MatchesCpuF32) {
  DM_SKIP_WITHOUT_GPU();
  uint64_t seed = 400;
  for (const KdaShape& s : {KdaShape{2, 1, 3, 16, 12}, KdaShape{1, 63, 2, 7, 5},
                            KdaShape{2, 65, 3, 16, 12}, KdaShape{1, 130, 2, 33, 17},
                            KdaShape{1, 70, 1, 128, 128}})
    check_backward(random_inputs(s, ++seed, -5.0, 1.0), false, describe(s, "backward f32"));
}

TEST(CudaKdaBackward, StrongDecayAndDocStartF32) {
  DM_SKIP_WITHOUT_GPU();
  check_backward(random_inputs({1, 130, 2, 32, 16}, 8, 3.0, 3.3), false, "backward strong decay",
                 /*nonzero_initial=*/false);
  const KdaShape s{2, 150, 2, 16, 12};
  KdaInputs p = random_inputs(s, 12, -4.0, 1.0);
  p.doc_start = make_doc_start(s, {5, 6, 64, 100, 149});
  check_backward(p, false, "backward doc_start");
}

TEST(CudaKdaBackward, MatchesCpuBf16) {
  DM_SKIP_WITHOUT_GPU();
  KdaInputs p = random_inputs({2, 100, 2, 64, 64}, 13, -5.0, 1.0);
  round_inputs_bf16(p);
  check_backward(p, true, "backward bf16");
}

// Stage 4 on tensor cores (KdaBackwardPath::TensorCore, bf16 only): the bf16 cases above plus
// ragged K, V (padding to 16) and T around chunk boundaries, at the bf16 tolerance.
TEST(CudaKdaBackward, TensorCoreMatchesCpuBf16) {
  DM_SKIP_WITHOUT_GPU();
  KdaInputs p = random_inputs({2, 100, 2, 64, 64}, 13, -5.0, 1.0);
  round_inputs_bf16(p);
  check_backward(p, true, "backward bf16 tc", true, cu::KdaBackwardPath::TensorCore);
  uint64_t seed = 500;
  for (const KdaShape& s : {KdaShape{2, 1, 3, 16, 12}, KdaShape{1, 63, 2, 7, 5},
                            KdaShape{2, 65, 3, 16, 12}, KdaShape{1, 130, 2, 33, 17},
                            KdaShape{1, 70, 1, 128, 128}}) {
    KdaInputs q = random_inputs(s, ++seed, -5.0, 1.0);
    round_inputs_bf16(q);
    check_backward(q, true, describe(s, "backward bf16 tc"), true, cu::KdaBackwardPath::TensorCore);
  }
}

// Both paths (a failure of the reference too points at the bf16 inputs, not at stage 4).
TEST(CudaKdaBackward, TensorCoreStrongDecayAndDocStartBf16) {
  DM_SKIP_WITHOUT_GPU();
  KdaInputs strong = random_inputs({1, 130, 2, 32, 16}, 8, 3.0, 3.3);
  round_inputs_bf16(strong);
  const KdaShape s{2, 150, 2, 16, 12};
  KdaInputs p = random_inputs(s, 12, -4.0, 1.0);
  p.doc_start = make_doc_start(s, {5, 6, 64, 100, 149});
  round_inputs_bf16(p);
  for (const cu::KdaBackwardPath path :
       {cu::KdaBackwardPath::Reference, cu::KdaBackwardPath::TensorCore}) {
    const std::string name = path == cu::KdaBackwardPath::TensorCore ? " tc" : " ref";
    check_backward(strong, true, "backward bf16 strong decay" + name, /*nonzero_initial=*/false,
                   path);
    check_backward(p, true, "backward bf16 doc_start" + name, true, path);
  }
}

// accumulate = false: the split kernels store every element of dq, dk, dv, dg, dβ once (no
// zeroed buffers needed: the training step's KDA backward); the fused kernel's path zeroes them
// itself first. Partial chunks, documents, several heads and batches.
TEST(CudaKdaBackward, StoresGradientsWhenAskedBf16) {
  DM_SKIP_WITHOUT_GPU();
  const KdaShape shapes[] = {{2, 150, 3, 64, 64}, {1, 300, 2, 128, 128}};
  uint64_t seed = 700;
  for (const KdaShape& s : shapes) {
    KdaInputs p = random_inputs(s, ++seed, -5.0, 1.0);
    p.doc_start = make_doc_start(s, {5, 64, 100});
    round_inputs_bf16(p);
    ASSERT_TRUE(cu::kda_backward_split_supported(s));
    for (const cu::KdaBackwardPath path :
         {cu::KdaBackwardPath::TensorCoreSplit, cu::KdaBackwardPath::TensorCore})
      for (const bool reuse : {false, true})
        check_backward(p, true, describe(s, "stored") + (reuse ? " reusing" : ""), true, path,
                       reuse, /*store=*/true);
  }
}

// The realistic case: K = V = 128, a partial last chunk (T = 300 = 4·64 + 44), documents starting
// mid-chunk, at a chunk start and in the partial chunk, s0 and dsT given; both stage-4 paths
// against the CPU, then against each other.
TEST(CudaKdaBackward, TensorCoreMatchesReferenceRealisticBf16) {
  DM_SKIP_WITHOUT_GPU();
  const KdaShape s{1, 300, 2, 128, 128};
  KdaInputs p = random_inputs(s, 21, -5.0, 1.0);
  p.doc_start = make_doc_start(s, {37, 128, 200, 270});
  round_inputs_bf16(p);
  const KdaGradientsF reference = check_backward(p, true, "realistic bf16 ref", true,
                                                 cu::KdaBackwardPath::Reference);
  const KdaGradientsF tensor_cores = check_backward(p, true, "realistic bf16 tc", true,
                                                    cu::KdaBackwardPath::TensorCore);
  // Stages 1–3 differ too (tf32 tensor cores against fp32 CUDA cores): ds0 within bf16 tolerance.
  expect_gradients_close(tensor_cores, reference, 1e-2, 1e-2, "tc vs ref");
}

// workspace_holds_forward: the backward after a forward into the same workspace skips its
// recompute and gives the gradients of the recomputing backward (up to the order of stage 4's
// shared-memory atomics), so both match the CPU.
TEST(CudaKdaBackward, ReusesTheForwardWorkspaceBf16) {
  DM_SKIP_WITHOUT_GPU();
  const KdaShape s{1, 300, 2, 128, 128};
  KdaInputs p = random_inputs(s, 31, -5.0, 1.0);
  p.doc_start = make_doc_start(s, {37, 128, 200, 270});
  round_inputs_bf16(p);
  const KdaGradientsF recomputed =
      check_backward(p, true, "recomputing tc", true, cu::KdaBackwardPath::TensorCore, false);
  const KdaGradientsF reused =
      check_backward(p, true, "reusing tc", true, cu::KdaBackwardPath::TensorCore, true);
  expect_gradients_close(reused, recomputed, 1e-5, 1e-6, "reuse vs recompute");
}

// The workspace arithmetic the training's memory plan relies on (host code only: it runs without
// a GPU). The backward's workspace is the forward's followed by the backward's own region (which
// the layer backward takes from the step's scratch instead); the split's own region is the fused
// path's plus its hand-over (dP and dM partials [2, C, C], dβ partials [2, C], dX [C, VP] per
// chunk-head, each view rounded up to 256 bytes); a shape the split does not take sizes as the
// fused path.
TEST(CudaKdaBackward, WorkspaceSizesAddUp) {
  using Path = cu::KdaBackwardPath;
  for (const KdaShape& s : {KdaShape{1, 300, 2, 128, 128}, KdaShape{2, 100, 3, 64, 32},
                            KdaShape{1, 130, 2, 33, 17}}) {
    const std::string what = describe(s, "workspace");
    for (const Path path : {Path::Reference, Path::TensorCore, Path::TensorCoreSplit})
      EXPECT_EQ(cu::kda_chunk_backward_workspace_bytes(s, path),
                cu::kda_chunk_forward_workspace_bytes(s) + cu::kda_chunk_backward_own_bytes(s, path))
          << what;
    const int64_t chunk_heads = s.B * s.H * ((s.T + 63) / 64), VP = (s.V + 15) / 16 * 16;
    auto view = [](int64_t floats) { return size_t((floats * 4 + 255) / 256 * 256); };
    const size_t hand_over = cu::kda_backward_split_supported(s)
                                 ? 2 * view(chunk_heads * 2 * 64 * 64) +
                                       view(chunk_heads * 2 * 64) + view(chunk_heads * 64 * VP)
                                 : 0;
    EXPECT_EQ(cu::kda_chunk_backward_own_bytes(s, Path::TensorCoreSplit),
              cu::kda_chunk_backward_own_bytes(s, Path::TensorCore) + hand_over)
        << what;
    EXPECT_EQ(cu::kda_chunk_backward_own_bytes(s, Path::TensorCore),
              cu::kda_chunk_backward_own_bytes(s, Path::Reference))
        << what;
  }
  EXPECT_FALSE(cu::kda_backward_split_supported({1, 130, 2, 33, 17}));  // KP = 48
  EXPECT_TRUE(cu::kda_backward_split_supported({1, 130, 2, 32, 64}));
}

// Why the split exists: its two kernels fit two blocks per H200 SM at the largest head dims
// (K = V = 128), where the fused kernel fits one (host arithmetic: runs without a GPU). A layout
// change that breaks this halves the split's occupancy without failing any GPU test.
TEST(CudaKdaBackward, SplitKernelsFitTwoBlocksPerSm) {
  constexpr size_t kTwoBlocks = 113 * 1024;  // (228 KB of an SM − 1 KB reserved per block) / 2
  for (const KdaShape& s : {KdaShape{1, 8192, 16, 128, 128}, KdaShape{2, 100, 3, 64, 32},
                            KdaShape{1, 150, 2, 32, 64}}) {
    const cu::KdaStage4SharedBytes bytes = cu::kda_stage4_shared_bytes(s);
    EXPECT_LE(bytes.value, kTwoBlocks) << describe(s, "value kernel");
    EXPECT_LE(bytes.key, kTwoBlocks) << describe(s, "key kernel");
  }
  EXPECT_GT(cu::kda_stage4_shared_bytes({1, 8192, 16, 128, 128}).fused, kTwoBlocks);
}

// The split stage 4 (value kernel over V halves, key kernel over K halves as a cluster of two)
// against the fused kernel: the same products with the same precisions, only summed in another
// order (dP, dM and the row dots in two halves), so within 1e-4 of each other where the split
// takes the pair-by-pair inside sums too (strong decay), 2e-3 where it takes them as tf32
// products (below), and both within the bf16 tolerance of the CPU (check_backward). Shapes: the
// realistic one with documents and a partial chunk (recomputing and reusing the forward), K = 64
// / V = 32 (one mma tile per warp), K = 32 / V = 64 with strong decay and documents, V = 30 and
// K = V = 126 (padded heads, rows not in 16-byte pieces, dv stored a float at a time; the latter
// on the K = V = 128 kernels), and one the split does not take (KP = 48: the fused kernel runs,
// so the two agree exactly up to the atomics' order).
TEST(CudaKdaBackward, SplitStageFourMatchesFusedBf16) {
  DM_SKIP_WITHOUT_GPU();
  struct Case {
    KdaShape shape;
    uint64_t seed;
    double log_decay_lo, log_decay_hi;  // random_inputs
    std::vector<int64_t> docs;
    bool reuse;
  };
  const Case cases[] = {{{1, 300, 2, 128, 128}, 41, -5.0, 1.0, {37, 128, 200, 270}, false},
                        {{1, 300, 2, 128, 128}, 42, -5.0, 1.0, {37, 128, 200, 270}, true},
                        {{2, 100, 2, 64, 32}, 43, -5.0, 1.0, {}, true},
                        {{2, 150, 2, 32, 64}, 44, 3.0, 3.3, {5, 6, 64, 100, 149}, false},
                        {{2, 100, 2, 64, 30}, 46, -5.0, 1.0, {}, true},
                        {{1, 200, 2, 126, 126}, 47, -5.0, 1.0, {77}, true},
                        {{1, 130, 2, 33, 17}, 45, -5.0, 1.0, {}, false}};
  for (const Case& c : cases) {
    // All but the last shape run the split kernels (else this would compare the fused with itself).
    EXPECT_EQ(cu::kda_backward_split_supported(c.shape), c.shape.K != 33) << describe(c.shape, "");
    KdaInputs p = random_inputs(c.shape, c.seed, c.log_decay_lo, c.log_decay_hi);
    if (!c.docs.empty()) p.doc_start = make_doc_start(c.shape, c.docs);
    round_inputs_bf16(p);
    const std::string what = describe(c.shape, c.reuse ? "reusing" : "recomputing");
    const bool strong = c.log_decay_lo > 0.0;  // tiny gradients: start from zero (check_backward)
    const KdaGradientsF fused =
        check_backward(p, true, what + " fused", !strong, cu::KdaBackwardPath::TensorCore, c.reuse);
    const KdaGradientsF split = check_backward(p, true, what + " split", !strong,
                                               cu::KdaBackwardPath::TensorCoreSplit, c.reuse);
    // The split's key kernel forms the sums inside 16-token sub-blocks as tf32 products through
    // the middle token when the decays allow (kKdaInsideExponentLimit: every case here but the
    // strong-decay one), where the fused kernel takes one exact exponential per pair: tf32's
    // rounding of those terms, not only the summation order, separates the two there.
    const double tolerance = strong ? 1e-4 : 2e-3;
    expect_gradients_close(split, fused, tolerance, 1e-6, what + " split vs fused");
  }
}

// The tf32 state stages (kda_chunk_state_tf32.cu) pick 16- or 32-column tiles by the SM count,
// and the backward's kernel by how many blocks the grid has (Qd and W staged in shared memory,
// or held in registers); small test shapes would only ever see 16 columns and the staged
// kernel. Every combination, forced through DM_KDA_STATE_COLUMNS and DM_KDA_STATE_BACKWARD
// (read at each call), with the per-chunk operands by TMA (the default) and by cp.async
// (DM_KDA_STATE_TMA=0), on shapes with VP % 32 == 0, documents and a partial chunk (the TMA's
// zero fill past T and past V), forward (bf16) and backward (tc).
TEST(CudaKdaChunk, StateTileWidthsMatchCpuBf16) {
  DM_SKIP_WITHOUT_GPU();
  uint64_t seed = 700;
  for (const char* tma : {"1", "0"})
    for (const char* columns : {"16", "32"})
      for (const char* backward : {"staged", "regs"})
        for (const KdaShape& s : {KdaShape{1, 300, 2, 128, 128}, KdaShape{2, 130, 3, 64, 32}}) {
          dm::test::ScopedEnv width("DM_KDA_STATE_COLUMNS", columns),
              kernel("DM_KDA_STATE_BACKWARD", backward), copies("DM_KDA_STATE_TMA", tma);
          KdaInputs p = random_inputs(s, ++seed, -5.0, 1.0);
          p.doc_start = make_doc_start(s, {37, 128, 129});
          round_inputs_bf16(p);
          const std::string what = describe(
              s, (std::string("state tiles ") + columns + ", backward " + backward + ", TMA " + tma)
                     .c_str());
          check_forward(p, KdaGpuForm::Chunked, true, true, what + " forward");
          check_backward(p, true, what + " backward", true, cu::KdaBackwardPath::TensorCore);
        }
  // 40 heads of 4 16-column tiles: 160 blocks, more than one round of the H200's 132 SMs, where
  // DM_KDA_STATE_TMA=all puts the forward on TMA with thread 0 alone polling its barriers.
  for (const char* tma : {"all", "0"}) {
    dm::test::ScopedEnv width("DM_KDA_STATE_COLUMNS", "16"), copies("DM_KDA_STATE_TMA", tma);
    const KdaShape s{1, 130, 40, 64, 64};
    KdaInputs p = random_inputs(s, ++seed, -5.0, 1.0);
    round_inputs_bf16(p);
    const std::string what = describe(s, (std::string("state tiles 16, TMA ") + tma).c_str());
    check_forward(p, KdaGpuForm::Chunked, true, true, what + " forward");
    check_backward(p, true, what + " backward", true, cu::KdaBackwardPath::TensorCore);
  }
}

}  // namespace
#else
TEST(CudaKda, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
