// KDA layer backward (SPEC §1.1, docs/backward.md): central differences in double for every
// parameter tensor and the input, for both gate kinds and both output-gate kinds, chunked and
// recurrent; packed documents equal separate sequences; float agrees with double. Also the
// building blocks (short conv + SiLU, the gate, the gated RMSNorm) on their own.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "io/config.h"
#include "model/kda.h"
#include "model/weights.h"
#include "core/error.h"
#include "ops/cpu/kda.h"
#include "ops/cpu/kda_prep.h"
#include "ops/cpu/norm_gated.h"
#include "test_util.h"

using namespace dm;

namespace {

// Tiny layer: d = 16, H = 2, K = 8, conv kernel 4.
ModelConfig tiny_kda_config(KdaGateKind gate, bool full_rank_gate) {
  ModelConfig cfg;
  cfg.hidden = 16;
  cfg.rms_eps = 1e-5f;
  cfg.kda.num_heads = 2;
  cfg.kda.head_dim = 8;
  cfg.kda.conv_kernel = 4;
  cfg.kda.gate = gate;
  cfg.kda.gate_lower_bound = -5.0f;
  cfg.kda.full_rank_output_gate = full_rank_gate;
  return cfg;
}

template <typename Real>
using KdaField = Real* KdaWeightsT<Real>::*;

struct KdaParamSpec {
  std::string name;
  int64_t numel;
  double init_std;   // N(init_mean, init_std)
  double init_mean;
  bool a_log;        // log U(1, 16) instead
};

// The layer's parameter tensors with their sizes and test initialisation.
std::vector<std::pair<KdaParamSpec, int>> kda_param_specs(const ModelConfig& cfg) {
  const int64_t d = cfg.hidden, H = cfg.kda.num_heads, K = cfg.kda.head_dim, HK = H * K,
                Kc = cfg.kda.conv_kernel;
  const double proj = 1.0 / std::sqrt(double(d));
  std::vector<std::pair<KdaParamSpec, int>> specs = {
      {{"q_proj", HK * d, proj, 0, false}, 0},   {{"k_proj", HK * d, proj, 0, false}, 1},
      {{"v_proj", HK * d, proj, 0, false}, 2},   {{"q_conv", HK * Kc, 0.5, 0, false}, 3},
      {{"k_conv", HK * Kc, 0.5, 0, false}, 4},   {{"v_conv", HK * Kc, 0.5, 0, false}, 5},
      {{"f_a", K * d, proj, 0, false}, 6},       {{"f_b", HK * K, 0.4, 0, false}, 7},
      {{"b_proj", H * d, 0.5, 0, false}, 8},     {{"A_log", H, 0, 0, true}, 9},
      {{"dt_bias", HK, 0.7, -0.5, false}, 10},   {{"o_norm", K, 0.1, 1.0, false}, 14},
      {{"o_proj", d * HK, 1.0 / std::sqrt(double(HK)), 0, false}, 15}};
  if (cfg.kda.full_rank_output_gate) {
    specs.push_back({{"g_proj", HK * d, proj, 0, false}, 13});
  } else {
    specs.push_back({{"g_a", K * d, proj, 0, false}, 11});
    specs.push_back({{"g_b", HK * K, 0.4, 0, false}, 12});
  }
  return specs;
}

template <typename Real>
KdaField<Real> kda_field(int index) {
  static const KdaField<Real> fields[] = {
      &KdaWeightsT<Real>::q_proj, &KdaWeightsT<Real>::k_proj,  &KdaWeightsT<Real>::v_proj,
      &KdaWeightsT<Real>::q_conv, &KdaWeightsT<Real>::k_conv,  &KdaWeightsT<Real>::v_conv,
      &KdaWeightsT<Real>::f_a,    &KdaWeightsT<Real>::f_b,     &KdaWeightsT<Real>::b_proj,
      &KdaWeightsT<Real>::A_log,  &KdaWeightsT<Real>::dt_bias, &KdaWeightsT<Real>::g_a,
      &KdaWeightsT<Real>::g_b,    &KdaWeightsT<Real>::g_full,  &KdaWeightsT<Real>::o_norm,
      &KdaWeightsT<Real>::o_proj};
  return fields[index];
}

// Parameters of one layer in a flat buffer, with KdaWeightsT views into it.
template <typename Real>
struct TinyKdaParams {
  std::vector<Real> storage;
  KdaWeightsT<Real> w{};
  std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> tensors;  // name → (offset, n)

  explicit TinyKdaParams(const ModelConfig& cfg) {
    int64_t total = 0;
    for (const auto& [spec, index] : kda_param_specs(cfg)) {
      tensors.push_back({spec.name, {total, spec.numel}});
      total += spec.numel;
    }
    storage.assign(size_t(total), Real(0));
    const auto specs = kda_param_specs(cfg);
    for (size_t i = 0; i < specs.size(); ++i)
      w.*kda_field<Real>(specs[i].second) = storage.data() + tensors[i].second.first;
  }
  TinyKdaParams(const TinyKdaParams&) = delete;
};

template <typename Real>
void init_params(TinyKdaParams<Real>& p, const ModelConfig& cfg, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(1.0, 16.0);
  const auto specs = kda_param_specs(cfg);
  for (size_t i = 0; i < specs.size(); ++i) {
    const KdaParamSpec& spec = specs[i].first;
    Real* data = p.storage.data() + p.tensors[i].second.first;
    for (int64_t j = 0; j < spec.numel; ++j)
      data[j] = Real(spec.a_log ? std::log(uniform(rng)) : spec.init_mean + spec.init_std * normal(rng));
  }
}

std::vector<double> random_vector(size_t n, uint64_t seed, double stddev = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, stddev);
  std::vector<double> x(n);
  for (auto& e : x) e = normal(rng);
  return x;
}

template <typename Real>
std::vector<Real> layer_forward(const ModelConfig& cfg, const KdaWeightsT<Real>& w,
                                const std::vector<Real>& x, int64_t B, int64_t T, int chunk,
                                const int32_t* doc_start = nullptr) {
  std::vector<Real> y(size_t(B * T * cfg.hidden));
  Arena ws(kda_layer_workspace_bytes(cfg, B, T, chunk, sizeof(Real)), "kda_layer_ws");
  kda_layer_forward<Real>(cfg, w, x.data(), y.data(), B, T, ws, KdaRunOptions{chunk}, doc_start);
  return y;
}

// Forward with saved activations, then backward of Σ y·R. Returns y; grad and dx accumulate.
template <typename Real>
std::vector<Real> layer_forward_backward(const ModelConfig& cfg, const KdaWeightsT<Real>& w,
                                         KdaWeightsT<Real>& grad, const std::vector<Real>& x,
                                         const std::vector<Real>& dy, std::vector<Real>& dx,
                                         int64_t B, int64_t T, int chunk,
                                         const int32_t* doc_start = nullptr) {
  std::vector<Real> y(size_t(B * T * cfg.hidden));
  Arena ws(std::max(kda_layer_workspace_bytes(cfg, B, T, chunk, sizeof(Real)),
                    kda_layer_backward_workspace_bytes(cfg, B, T, chunk, sizeof(Real))),
           "kda_layer_ws");
  // Exactly the advertised size: an undercount would throw.
  Arena saved_arena(kda_layer_saved_bytes(cfg, B, T, sizeof(Real)), "kda_layer_saved");
  KdaSaved<Real> saved;
  kda_layer_forward<Real>(cfg, w, x.data(), y.data(), B, T, ws, KdaRunOptions{chunk}, doc_start,
                          &saved, &saved_arena);
  EXPECT_EQ(ws.used(), 0u);
  kda_layer_backward<Real>(cfg, w, grad, x.data(), saved, dy.data(), dx.data(), B, T, ws,
                           doc_start);
  EXPECT_EQ(ws.used(), 0u);
  return y;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

struct LayerCase {
  KdaGateKind gate;
  bool full_rank_gate;
  int chunk;
  bool packed;  // with doc_start: row 0 = [5 | 8], row 1 = [13]
  std::string label() const {
    return std::string(gate == KdaGateKind::Softplus ? "softplus" : "safe") +
           (full_rank_gate ? "/full-gate" : "/lowrank-gate") +
           (chunk == 0 ? "/recurrent" : "/chunk" + std::to_string(chunk)) +
           (packed ? "/packed" : "");
  }
};

std::vector<int32_t> tiny_doc_start(int64_t T) {
  std::vector<int32_t> doc_start(size_t(2 * T), 0);
  for (int64_t t = 5; t < T; ++t) doc_start[size_t(t)] = 5;  // row 0: docs [0,5) and [5,T)
  return doc_start;
}

}  // namespace

// Central differences of L = Σ y·R in double for a random subset of every parameter tensor and
// of x, against kda_layer_backward.
TEST(KdaLayerBackward, FiniteDifferencesDouble) {
  const int64_t B = 2, T = 13;
  std::vector<LayerCase> cases;
  for (KdaGateKind gate : {KdaGateKind::Softplus, KdaGateKind::Safe})
    for (bool full : {false, true})
      for (int chunk : {16, 0}) cases.push_back({gate, full, chunk, false});
  cases.push_back({KdaGateKind::Safe, true, 16, true});
  cases.push_back({KdaGateKind::Softplus, false, 0, true});
  for (const LayerCase& c : cases) {
    const ModelConfig cfg = tiny_kda_config(c.gate, c.full_rank_gate);
    TinyKdaParams<double> params(cfg), grads(cfg);
    init_params(params, cfg, 42);
    const std::vector<int32_t> doc_start = tiny_doc_start(T);
    const int32_t* docs = c.packed ? doc_start.data() : nullptr;
    const std::vector<double> x = random_vector(size_t(B * T * cfg.hidden), 7);
    const std::vector<double> r = random_vector(size_t(B * T * cfg.hidden), 8);
    std::vector<double> dx(x.size(), 0.0);
    layer_forward_backward(cfg, params.w, grads.w, x, r, dx, B, T, c.chunk, docs);

    std::mt19937_64 rng(5);
    auto loss = [&](const std::vector<double>& input) {
      return dot(layer_forward(cfg, params.w, input, B, T, c.chunk, docs), r);
    };
    auto central_difference = [&](double& slot, const std::vector<double>& input) {
      const double saved_value = slot;
      const double h = 1e-6 * std::max(1.0, std::abs(saved_value));
      slot = saved_value + h;
      const double up = loss(input);
      slot = saved_value - h;
      const double down = loss(input);
      slot = saved_value;
      return (up - down) / (2 * h);
    };
    double worst = 0;
    std::string worst_name;
    for (const auto& [name, range] : params.tensors) {
      const auto [offset, n] = range;
      std::vector<double> numeric, analytic;
      for (int sample = 0; sample < std::min<int64_t>(n, 12); ++sample) {
        const int64_t i = n <= 12 ? sample : int64_t(rng() % uint64_t(n));
        numeric.push_back(central_difference(params.storage[size_t(offset + i)], x));
        analytic.push_back(grads.storage[size_t(offset + i)]);
      }
      const double err = test::rel_rms(analytic.data(), numeric.data(), numeric.size());
      if (err > worst) worst = err, worst_name = name;
      EXPECT_LE(err, 1e-6) << c.label() << " " << name;
    }
    std::vector<double> numeric, analytic, x_perturbed = x;
    for (int sample = 0; sample < 24; ++sample) {
      const size_t i = size_t(rng() % x.size());
      numeric.push_back(central_difference(x_perturbed[i], x_perturbed));
      analytic.push_back(dx[i]);
    }
    const double x_err = test::rel_rms(analytic.data(), numeric.data(), numeric.size());
    EXPECT_LE(x_err, 1e-6) << c.label() << " x";
    std::printf("[kda layer fd %-36s] worst parameter %.2e (%s), x %.2e\n", c.label().c_str(),
                worst, worst_name.c_str(), x_err);
  }
}

// A row holding two documents equals the two documents as separate sequences: y and dx per
// token, and parameter gradients summed over the documents.
TEST(KdaLayerBackward, PackedDocumentsEqualSeparate) {
  const int64_t T = 13, split = 5;
  for (int chunk : {0, 16}) {
    const ModelConfig cfg = tiny_kda_config(KdaGateKind::Safe, false);
    const int64_t d = cfg.hidden;
    TinyKdaParams<double> params(cfg), packed_grads(cfg), separate_grads(cfg);
    init_params(params, cfg, 43);
    const std::vector<double> x = random_vector(size_t(T * d), 9);
    const std::vector<double> r = random_vector(size_t(T * d), 10);
    std::vector<int32_t> doc_start(size_t(T), 0);
    for (int64_t t = split; t < T; ++t) doc_start[size_t(t)] = int32_t(split);
    std::vector<double> dx_packed(x.size(), 0.0);
    const std::vector<double> y_packed = layer_forward_backward(
        cfg, params.w, packed_grads.w, x, r, dx_packed, 1, T, chunk, doc_start.data());
    std::vector<double> y_separate, dx_separate;
    for (const auto& [start, len] : {std::pair<int64_t, int64_t>{0, split}, {split, T - split}}) {
      const std::vector<double> x_doc(x.begin() + start * d, x.begin() + (start + len) * d);
      const std::vector<double> r_doc(r.begin() + start * d, r.begin() + (start + len) * d);
      std::vector<double> dx_doc(x_doc.size(), 0.0);
      const std::vector<double> y_doc = layer_forward_backward(cfg, params.w, separate_grads.w,
                                                               x_doc, r_doc, dx_doc, 1, len, chunk);
      y_separate.insert(y_separate.end(), y_doc.begin(), y_doc.end());
      dx_separate.insert(dx_separate.end(), dx_doc.begin(), dx_doc.end());
    }
    EXPECT_LE(test::rel_rms(y_packed.data(), y_separate.data(), y_packed.size()), 1e-13) << chunk;
    EXPECT_LE(test::rel_rms(dx_packed.data(), dx_separate.data(), dx_packed.size()), 1e-12)
        << chunk;
    EXPECT_LE(test::rel_rms(packed_grads.storage.data(), separate_grads.storage.data(),
                            packed_grads.storage.size()),
              1e-12)
        << chunk;
  }
}

// The float engine path agrees with the double reference (same weights and inputs).
TEST(KdaLayerBackward, FloatMatchesDouble) {
  const int64_t B = 2, T = 37;
  for (KdaGateKind gate : {KdaGateKind::Softplus, KdaGateKind::Safe})
    for (bool full : {false, true})
      for (int chunk : {0, 16, 64}) {
        const ModelConfig cfg = tiny_kda_config(gate, full);
        TinyKdaParams<double> params(cfg), grads(cfg);
        TinyKdaParams<float> params32(cfg), grads32(cfg);
        init_params(params, cfg, 44);
        for (size_t i = 0; i < params.storage.size(); ++i)
          params32.storage[i] = float(params.storage[i]);
        const std::vector<double> x = random_vector(size_t(B * T * cfg.hidden), 11);
        const std::vector<double> r = random_vector(size_t(B * T * cfg.hidden), 12);
        const std::vector<float> x32(x.begin(), x.end()), r32(r.begin(), r.end());
        std::vector<double> dx(x.size(), 0.0);
        std::vector<float> dx32(x.size(), 0.0f);
        const std::vector<double> y = layer_forward_backward(cfg, params.w, grads.w, x, r, dx, B,
                                                             T, chunk);
        const std::vector<float> y32 = layer_forward_backward(cfg, params32.w, grads32.w, x32,
                                                              r32, dx32, B, T, chunk);
        const std::vector<double> y_up(y32.begin(), y32.end()), dx_up(dx32.begin(), dx32.end());
        const double y_err = test::rel_rms(y_up.data(), y.data(), y.size());
        const double dx_err = test::rel_rms(dx_up.data(), dx.data(), dx.size());
        EXPECT_LE(y_err, 1e-5);
        EXPECT_LE(dx_err, 1e-4);
        double worst = 0;
        for (const auto& [name, range] : params.tensors) {
          const std::vector<double> g32(grads32.storage.begin() + range.first,
                                        grads32.storage.begin() + range.first + range.second);
          const double err = test::rel_rms(g32.data(), grads.storage.data() + range.first,
                                           size_t(range.second));
          worst = std::max(worst, err);
          if (getenv("KDA_VERBOSE")) std::printf("  %s %.2e\n", name.c_str(), err);
          EXPECT_LE(err, 1e-4) << name << " chunk=" << chunk << " full=" << full;
        }
        std::printf("[kda layer f32 vs f64 %s/%s/chunk %d] y %.1e dx %.1e worst grad %.1e\n",
                    gate == KdaGateKind::Softplus ? "softplus" : "safe",
                    full ? "full" : "lowrank", chunk, y_err, dx_err, worst);
      }
}

// The float forward without `saved` (the inference path) gives the same y as with it.
TEST(KdaLayerBackward, SavedForwardMatchesInferenceForward) {
  const int64_t B = 2, T = 21;
  const ModelConfig cfg = tiny_kda_config(KdaGateKind::Softplus, false);
  TinyKdaParams<float> params(cfg), grads(cfg);
  init_params(params, cfg, 45);
  const std::vector<double> x64 = random_vector(size_t(B * T * cfg.hidden), 13);
  const std::vector<float> x(x64.begin(), x64.end());
  std::vector<float> dx(x.size(), 0.0f), dy(x.size(), 0.0f);
  for (int chunk : {0, 16}) {
    const std::vector<float> y_inference = layer_forward(cfg, params.w, x, B, T, chunk);
    const std::vector<float> y_training =
        layer_forward_backward(cfg, params.w, grads.w, x, dy, dx, B, T, chunk);
    EXPECT_EQ(y_inference, y_training) << chunk;
  }
}

// The operator rejects a doc_start that does not describe documents (it would otherwise make the
// recurrent and chunked forms silently disagree).
TEST(KdaDocStart, RejectsInconsistentDocStart) {
  const KdaShape s{1, 6, 1, 4, 4};
  const std::vector<double> q(24, 0.3), v(24, 0.1), g(24, -0.1), beta(6, 0.5);
  std::vector<double> o(24), d(24), db(6);
  Arena ws(kda_chunk_workspace_bytes<double>(s, 16) + kda_chunk_backward_workspace_bytes<double>(s, 16));
  for (const std::vector<int32_t>& bad : {std::vector<int32_t>{1, 1, 1, 1, 1, 1},
                                          std::vector<int32_t>{0, 0, 0, 2, 3, 3},
                                          std::vector<int32_t>{0, 0, 5, 5, 5, 5}}) {
    EXPECT_THROW(kda_recurrent_forward<double>(q.data(), q.data(), v.data(), g.data(), beta.data(),
                                               nullptr, o.data(), nullptr, s, 0.5, bad.data()),
                 Error);
    EXPECT_THROW(kda_chunk_forward<double>(q.data(), q.data(), v.data(), g.data(), beta.data(),
                                           nullptr, o.data(), nullptr, s, 0.5, 16, ws, bad.data()),
                 Error);
    EXPECT_THROW(kda_chunk_backward<double>(q.data(), q.data(), v.data(), g.data(), beta.data(),
                                            nullptr, v.data(), nullptr, d.data(), d.data(),
                                            d.data(), d.data(), db.data(), nullptr, s, 0.5, 16, ws,
                                            bad.data()),
                 Error);
  }
  const std::vector<int32_t> good = {0, 0, 2, 2, 2, 5};
  EXPECT_NO_THROW(kda_chunk_forward<double>(q.data(), q.data(), v.data(), g.data(), beta.data(),
                                            nullptr, o.data(), nullptr, s, 0.5, 16, ws,
                                            good.data()));
}

// ---------------------------------------------------------------------------------------------
// Building blocks on their own (double, central differences).

TEST(KdaPrepBackward, ShortConvGateNormFiniteDifferences) {
  const int64_t B = 2, T = 9, C = 5, N = B * T, H = 2, K = 3, D = 6;
  const int Kc = 4;
  std::vector<int32_t> doc_start(size_t(B * T), 0);
  for (int64_t t = 4; t < T; ++t) doc_start[size_t(t)] = 4;
  const std::vector<double> x = random_vector(size_t(B * T * C), 21);
  const std::vector<double> w = random_vector(size_t(C * Kc), 22, 0.7);
  const std::vector<double> tail = random_vector(size_t(B * (Kc - 1) * C), 23);
  const std::vector<double> r = random_vector(size_t(B * T * C), 24);
  for (bool with_docs : {false, true})
    for (bool with_tail : {false, true}) {
      const int32_t* docs = with_docs ? doc_start.data() : nullptr;
      const double* tail_ptr = with_tail ? tail.data() : nullptr;
      auto loss = [&](const std::vector<double>& xx, const std::vector<double>& ww) {
        std::vector<double> y(xx.size());
        short_conv_silu_forward<double>(xx.data(), ww.data(), tail_ptr, y.data(), B, T, C, Kc,
                                        docs);
        return dot(y, r);
      };
      std::vector<double> dx(x.size(), 0.0), dw(w.size(), 0.0);
      short_conv_silu_backward<double>(x.data(), w.data(), tail_ptr, r.data(), dx.data(),
                                       dw.data(), B, T, C, Kc, docs);
      std::vector<double> num_dx(x.size()), num_dw(w.size());
      for (size_t i = 0; i < x.size(); ++i) {
        std::vector<double> up = x, down = x;
        up[i] += 1e-6;
        down[i] -= 1e-6;
        num_dx[i] = (loss(up, w) - loss(down, w)) / 2e-6;
      }
      for (size_t i = 0; i < w.size(); ++i) {
        std::vector<double> up = w, down = w;
        up[i] += 1e-6;
        down[i] -= 1e-6;
        num_dw[i] = (loss(x, up) - loss(x, down)) / 2e-6;
      }
      EXPECT_LE(test::rel_rms(dx.data(), num_dx.data(), dx.size()), 1e-7) << with_docs << with_tail;
      EXPECT_LE(test::rel_rms(dw.data(), num_dw.data(), dw.size()), 1e-7) << with_docs << with_tail;
    }
  // With documents, token 4 of row 0 must not see tokens 0..3: changing them leaves it alone.
  {
    std::vector<double> y1(x.size()), y2(x.size()), x2 = x;
    for (int64_t t = 0; t < 4; ++t) x2[size_t(t * C)] += 1.0;
    short_conv_silu_forward<double>(x.data(), w.data(), nullptr, y1.data(), B, T, C, Kc,
                                    doc_start.data());
    short_conv_silu_forward<double>(x2.data(), w.data(), nullptr, y2.data(), B, T, C, Kc,
                                    doc_start.data());
    for (int64_t t = 4; t < T; ++t) EXPECT_EQ(y1[size_t(t * C)], y2[size_t(t * C)]) << t;
  }

  // Gate: both kinds, f / A_log / dt_bias.
  const std::vector<double> f = random_vector(size_t(N * H * K), 25, 2.0);
  const std::vector<double> dg_up = random_vector(size_t(N * H * K), 26);
  const std::vector<double> a_log = {std::log(2.0), std::log(9.0)};
  const std::vector<double> dt_bias = random_vector(size_t(H * K), 27);
  for (KdaGateKind kind : {KdaGateKind::Softplus, KdaGateKind::Safe}) {
    auto loss = [&](const std::vector<double>& ff, const std::vector<double>& al,
                    const std::vector<double>& db) {
      std::vector<double> g(ff.size());
      kda_gate_forward<double>(ff.data(), al.data(), db.data(), g.data(), N, H, K, kind, -5.0f);
      return dot(g, dg_up);
    };
    std::vector<double> df(f.size(), 0.0), da(a_log.size(), 0.0), ddb(dt_bias.size(), 0.0);
    kda_gate_backward<double>(f.data(), a_log.data(), dt_bias.data(), dg_up.data(), df.data(),
                              da.data(), ddb.data(), N, H, K, kind, -5.0f);
    auto check = [&](const std::vector<double>& analytic, int which) {
      std::vector<double> numeric(analytic.size());
      for (size_t i = 0; i < analytic.size(); ++i) {
        std::vector<double> ff = f, al = a_log, db = dt_bias;
        std::vector<double>& target = which == 0 ? ff : which == 1 ? al : db;
        const double base = target[i];
        target[i] = base + 1e-6;
        const double up = loss(ff, al, db);
        target[i] = base - 1e-6;
        numeric[i] = (up - loss(ff, al, db)) / 2e-6;
      }
      EXPECT_LE(test::rel_rms(analytic.data(), numeric.data(), numeric.size()), 1e-7)
          << int(kind) << " " << which;
    };
    check(df, 0);
    check(da, 1);
    check(ddb, 2);
  }

  // Gated RMSNorm: x, w, gate.
  const std::vector<double> nx = random_vector(size_t(N * D), 28);
  const std::vector<double> nw = random_vector(size_t(D), 29, 0.3);
  const std::vector<double> ngate = random_vector(size_t(N * D), 30, 2.0);
  const std::vector<double> nr = random_vector(size_t(N * D), 31);
  auto norm_loss = [&](const std::vector<double>& xx, const std::vector<double>& ww,
                       const std::vector<double>& gg) {
    std::vector<double> y(xx.size());
    rmsnorm_gated_forward<double>(xx.data(), ww.data(), gg.data(), y.data(), N, D, 1e-5f);
    return dot(y, nr);
  };
  std::vector<double> ndx(nx.size(), 0.0), ndw(nw.size(), 0.0), ndgate(ngate.size(), 0.0);
  rmsnorm_gated_backward<double>(nx.data(), nw.data(), ngate.data(), nr.data(), ndx.data(),
                                 ndw.data(), ndgate.data(), N, D, 1e-5f);
  for (int which = 0; which < 3; ++which) {
    const std::vector<double>& analytic = which == 0 ? ndx : which == 1 ? ndw : ndgate;
    std::vector<double> numeric(analytic.size());
    for (size_t i = 0; i < analytic.size(); ++i) {
      std::vector<double> xx = nx, ww = nw, gg = ngate;
      std::vector<double>& target = which == 0 ? xx : which == 1 ? ww : gg;
      const double base = target[i];
      target[i] = base + 1e-6;
      const double up = norm_loss(xx, ww, gg);
      target[i] = base - 1e-6;
      numeric[i] = (up - norm_loss(xx, ww, gg)) / 2e-6;
    }
    EXPECT_LE(test::rel_rms(analytic.data(), numeric.data(), numeric.size()), 1e-7) << which;
  }
}
