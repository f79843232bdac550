// MoE layer and dense FFN layer backward (model/moe.h): finite differences in double for every
// parameter tensor and the input, float vs double agreement, saved-vs-unsaved forward identity.
// Variants: K3 (latent projection + latent RMSNorm + SiTU + 2 shared experts) and plain
// (Kimi-Linear/DeepSeek: no latent, SwiGLU, 1 shared expert, expert groups). SPEC §1.4, §1.5.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/arena.h"
#include "core/gemm.h"
#include "model/moe.h"
#include "ops/cpu/moe.h"
#include "test_util.h"

namespace dm {
namespace {

ModelConfig k3_variant_config() {
  ModelConfig c;
  c.hidden = 16;
  c.activation = Activation::SiTU;
  c.rms_eps = 1e-5f;
  c.moe.num_experts = 8;
  c.moe.top_k = 2;
  c.moe.expert_ffn = 12;
  c.moe.num_shared = 2;
  c.moe.shared_ffn = 6;
  c.moe.latent_dim = 8;
  c.moe.latent_norm = true;
  c.moe.routed_scaling = 1.0f;
  return c;
}

ModelConfig plain_variant_config() {
  ModelConfig c;
  c.hidden = 16;
  c.activation = Activation::SwiGLU;
  c.moe.num_experts = 8;
  c.moe.top_k = 2;
  c.moe.expert_ffn = 12;
  c.moe.num_shared = 1;
  c.moe.shared_ffn = 10;
  c.moe.latent_dim = 0;
  c.moe.n_group = 4;
  c.moe.topk_group = 2;
  c.moe.routed_scaling = 2.5f;
  return c;
}

// Owning storage for one MoE layer's parameters (or their gradients), viewable as MoeWeightsT.
template <typename Real>
struct MoeLayerParams {
  std::vector<Real> router, router_bias, expert_gate, expert_up, expert_down;
  std::vector<Real> shared_gate, shared_up, shared_down, latent_down, latent_up, latent_norm;

  static Real* ptr(std::vector<Real>& v) { return v.empty() ? nullptr : v.data(); }
  MoeWeightsT<Real> view() {
    MoeWeightsT<Real> w{};
    w.router = ptr(router);
    w.router_bias = ptr(router_bias);
    w.expert_gate = ptr(expert_gate);
    w.expert_up = ptr(expert_up);
    w.expert_down = ptr(expert_down);
    w.shared = FfnWeightsT<Real>{ptr(shared_gate), ptr(shared_up), ptr(shared_down)};
    w.latent_down = ptr(latent_down);
    w.latent_up = ptr(latent_up);
    w.latent_norm = ptr(latent_norm);
    return w;
  }
  // The trainable tensors by checkpoint-ish name (the routing bias is not trainable).
  std::vector<std::pair<std::string, std::vector<Real>*>> trainable() {
    std::vector<std::pair<std::string, std::vector<Real>*>> t = {
        {"router", &router},           {"expert_gate", &expert_gate},
        {"expert_up", &expert_up},     {"expert_down", &expert_down},
        {"shared_gate", &shared_gate}, {"shared_up", &shared_up},
        {"shared_down", &shared_down}, {"latent_down", &latent_down},
        {"latent_up", &latent_up},     {"latent_norm", &latent_norm}};
    t.erase(std::remove_if(t.begin(), t.end(), [](auto& e) { return e.second->empty(); }), t.end());
    return t;
  }
};

template <typename Real>
MoeLayerParams<Real> zero_params_like(const ModelConfig& c) {
  const MoeConfig& m = c.moe;
  const int64_t E = m.num_experts, d = c.hidden, l = m.latent_dim ? m.latent_dim : d;
  const int64_t F = m.expert_ffn, Fs = int64_t(m.num_shared) * m.shared_ffn;
  MoeLayerParams<Real> p;
  p.router.assign(E * d, 0);
  p.router_bias.assign(E, 0);
  p.expert_gate.assign(E * F * l, 0);
  p.expert_up.assign(E * F * l, 0);
  p.expert_down.assign(E * l * F, 0);
  if (Fs > 0) {
    p.shared_gate.assign(Fs * d, 0);
    p.shared_up.assign(Fs * d, 0);
    p.shared_down.assign(d * Fs, 0);
  }
  if (m.latent_dim > 0) {
    p.latent_down.assign(l * d, 0);
    p.latent_up.assign(d * l, 0);
    if (m.latent_norm) p.latent_norm.assign(l, 0);
  }
  return p;
}

void fill_normal(std::vector<double>& v, double mean, double stddev, std::mt19937& rng) {
  std::normal_distribution<double> dist(mean, stddev);
  for (double& x : v) x = dist(rng);
}

// Router weights with a large spread so that the routing margins are wide (finite differences
// must not flip a selection); a non-zero bias exercises the "bias steers selection only" path.
MoeLayerParams<double> random_params(const ModelConfig& c, uint32_t seed) {
  std::mt19937 rng(seed);
  MoeLayerParams<double> p = zero_params_like<double>(c);
  fill_normal(p.router, 0, 0.6, rng);
  fill_normal(p.router_bias, 0, 0.05, rng);
  fill_normal(p.expert_gate, 0, 0.5, rng);
  fill_normal(p.expert_up, 0, 0.5, rng);
  fill_normal(p.expert_down, 0, 0.4, rng);
  fill_normal(p.shared_gate, 0, 0.4, rng);
  fill_normal(p.shared_up, 0, 0.4, rng);
  fill_normal(p.shared_down, 0, 0.3, rng);
  fill_normal(p.latent_down, 0, 0.4, rng);
  fill_normal(p.latent_up, 0, 0.3, rng);
  fill_normal(p.latent_norm, 1.0, 0.2, rng);
  return p;
}

template <typename To, typename From>
std::vector<To> convert(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

MoeLayerParams<float> to_float(const MoeLayerParams<double>& p) {
  MoeLayerParams<float> f;
  f.router = convert<float>(p.router);
  f.router_bias = convert<float>(p.router_bias);
  f.expert_gate = convert<float>(p.expert_gate);
  f.expert_up = convert<float>(p.expert_up);
  f.expert_down = convert<float>(p.expert_down);
  f.shared_gate = convert<float>(p.shared_gate);
  f.shared_up = convert<float>(p.shared_up);
  f.shared_down = convert<float>(p.shared_down);
  f.latent_down = convert<float>(p.latent_down);
  f.latent_up = convert<float>(p.latent_up);
  f.latent_norm = convert<float>(p.latent_norm);
  return f;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Forward + backward of one MoE layer with arenas sized by the layer's published byte counts
// (an undersized arena throws, so this also checks those bounds).
template <typename Real>
struct MoeLayerRun {
  std::vector<Real> y, dx;
  MoeLayerParams<Real> grad;
  std::vector<int32_t> idx;
};

template <typename Real>
MoeLayerRun<Real> run_moe_layer(const ModelConfig& c, MoeLayerParams<Real>& params,
                                const std::vector<Real>& x, const std::vector<Real>& dy,
                                int64_t N) {
  const size_t elem = sizeof(Real);
  Arena ws(std::max(moe_layer_workspace_bytes(c, N, elem),
                    moe_layer_backward_workspace_bytes(c, N, elem)),
           "moe-layer-ws");
  Arena saved_arena(moe_layer_saved_bytes(c, N, elem), "moe-layer-saved");
  MoeLayerRun<Real> r;
  r.y.assign(N * c.hidden, Real(0));
  r.dx.assign(N * c.hidden, Real(0));
  r.grad = zero_params_like<Real>(c);
  MoeSaved<Real> saved;
  const MoeWeightsT<Real> w = params.view();
  moe_layer_forward(c, w, x.data(), r.y.data(), N, ws, nullptr, &saved, &saved_arena);
  EXPECT_EQ(ws.used(), 0u);
  r.idx.assign(saved.routing.idx, saved.routing.idx + N * c.moe.top_k);
  MoeWeightsT<Real> g = r.grad.view();
  moe_layer_backward(c, w, g, x.data(), saved, dy.data(), r.dx.data(), N, ws);
  EXPECT_EQ(ws.used(), 0u);
  return r;
}

struct FdReport {
  double worst = 0;
  int flips = 0;
};

// FD check of the MoE layer in double: x and a random subset of every trainable tensor.
FdReport moe_layer_fd_check(const ModelConfig& c, uint32_t seed, const char* variant) {
  const int64_t N = 12, d = c.hidden;
  std::mt19937 rng(seed);
  MoeLayerParams<double> params = random_params(c, seed + 1);
  std::vector<double> x(N * d), R(N * d);
  fill_normal(x, 0, 1.0, rng);
  fill_normal(R, 0, 1.0, rng);
  const MoeLayerRun<double> analytic = run_moe_layer(c, params, x, R, N);

  Arena ws(moe_layer_workspace_bytes(c, N, sizeof(double)), "moe-fd-ws");
  FdReport report;
  auto loss = [&] {
    std::vector<double> y(N * d);
    MoeRoutingT<double> routing;
    const size_t mark = ws.mark();
    moe_layer_forward(c, params.view(), x.data(), y.data(), N, ws, &routing);
    // Selection is piecewise constant: a step that changes it makes the FD meaningless.
    if (!std::equal(analytic.idx.begin(), analytic.idx.end(), routing.idx)) ++report.flips;
    ws.release(mark);
    return dot(y, R);
  };
  auto check = [&](const std::string& name, std::vector<double>& param,
                   const std::vector<double>& grad, size_t samples) {
    std::vector<size_t> entries(param.size());
    std::iota(entries.begin(), entries.end(), size_t(0));
    std::shuffle(entries.begin(), entries.end(), rng);
    entries.resize(std::min(samples, entries.size()));
    double max_diff = 0, max_grad = 1e-300;
    for (size_t i : entries) {
      const double saved = param[i], step = 1e-6 * std::max(1.0, std::fabs(saved));
      param[i] = saved + step;
      const double plus = loss();
      param[i] = saved - step;
      const double minus = loss();
      param[i] = saved;
      const double fd = (plus - minus) / (2 * step);
      max_diff = std::max(max_diff, std::fabs(fd - grad[i]));
      max_grad = std::max(max_grad, std::fabs(grad[i]));
    }
    const double err = max_diff / max_grad;
    std::printf("[          ] %s %-12s FD rel err %.2g (max |grad| %.2g, %zu entries)\n", variant,
                name.c_str(), err, max_grad, entries.size());
    EXPECT_LE(err, 1e-6) << variant << " " << name;
    report.worst = std::max(report.worst, err);
  };
  check("x", x, analytic.dx, 48);
  MoeLayerParams<double> grad = analytic.grad;
  auto grads = grad.trainable();
  auto tensors = params.trainable();
  for (size_t t = 0; t < tensors.size(); ++t) {
    // Gradients must reach every trainable tensor of the variant.
    double norm = 0;
    for (double g : *grads[t].second) norm += g * g;
    EXPECT_GT(norm, 0.0) << variant << " " << tensors[t].first << " got no gradient";
    check(tensors[t].first, *tensors[t].second, *grads[t].second, 24);
  }
  // The routing bias steers selection only: no gradient.
  for (double g : analytic.grad.router_bias) EXPECT_EQ(g, 0.0);
  EXPECT_EQ(report.flips, 0) << "finite-difference steps flipped a routing decision";
  return report;
}

TEST(MoeLayerTest, K3VariantGradientsMatchFiniteDifferences) {
  const FdReport r = moe_layer_fd_check(k3_variant_config(), 101, "k3");
  RecordProperty("moe_layer_k3_fd_worst_rel_err", testing::PrintToString(r.worst));
}

TEST(MoeLayerTest, PlainVariantGradientsMatchFiniteDifferences) {
  const FdReport r = moe_layer_fd_check(plain_variant_config(), 202, "plain");
  RecordProperty("moe_layer_plain_fd_worst_rel_err", testing::PrintToString(r.worst));
}

TEST(MoeLayerTest, BackwardAccumulates) {
  const ModelConfig c = k3_variant_config();
  const int64_t N = 7, d = c.hidden;
  std::mt19937 rng(5);
  MoeLayerParams<double> params = random_params(c, 6);
  std::vector<double> x(N * d), R(N * d);
  fill_normal(x, 0, 1.0, rng);
  fill_normal(R, 0, 1.0, rng);
  Arena ws(std::max(moe_layer_workspace_bytes(c, N, 8), moe_layer_backward_workspace_bytes(c, N, 8)),
           "ws");
  Arena saved_arena(moe_layer_saved_bytes(c, N, 8), "saved");
  MoeSaved<double> saved;
  std::vector<double> y(N * d), dx(N * d, 0.0);
  moe_layer_forward(c, params.view(), x.data(), y.data(), N, ws, nullptr, &saved, &saved_arena);
  MoeLayerParams<double> grad = zero_params_like<double>(c);
  MoeWeightsT<double> g = grad.view();
  moe_layer_backward(c, params.view(), g, x.data(), saved, R.data(), dx.data(), N, ws);
  const std::vector<double> dx_once = dx;
  const MoeLayerParams<double> grad_once = grad;
  moe_layer_backward(c, params.view(), g, x.data(), saved, R.data(), dx.data(), N, ws);
  for (size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx[i], 2 * dx_once[i], 1e-12);
  auto twice = grad.trainable();
  auto once = const_cast<MoeLayerParams<double>&>(grad_once).trainable();
  for (size_t t = 0; t < twice.size(); ++t)
    for (size_t i = 0; i < twice[t].second->size(); ++i)
      ASSERT_NEAR((*twice[t].second)[i], 2 * (*once[t].second)[i], 1e-12) << twice[t].first;
}

// Float engine vs double reference on the same parameters and inputs.
TEST(MoeLayerTest, FloatAgreesWithDouble) {
  double worst = 0;
  for (const auto& [c, name] : {std::pair{k3_variant_config(), "k3"},
                                std::pair{plain_variant_config(), "plain"}}) {
    const int64_t N = 40, d = c.hidden;
    std::mt19937 rng(77);
    MoeLayerParams<double> params_d = random_params(c, 78);
    MoeLayerParams<float> params_f = to_float(params_d);
    std::vector<double> x_d(N * d), R_d(N * d);
    fill_normal(x_d, 0, 1.0, rng);
    fill_normal(R_d, 0, 1.0, rng);
    // Round the inputs to float first so both runs see identical values.
    const std::vector<float> x_f = convert<float>(x_d), R_f = convert<float>(R_d);
    x_d = convert<double>(x_f);
    R_d = convert<double>(R_f);
    const MoeLayerRun<double> rd = run_moe_layer(c, params_d, x_d, R_d, N);
    const MoeLayerRun<float> rf = run_moe_layer(c, params_f, x_f, R_f, N);
    ASSERT_EQ(rd.idx, rf.idx) << name << ": float and double routed differently";
    auto compare = [&](const std::string& what, const std::vector<float>& f,
                       const std::vector<double>& dbl) {
      const std::vector<double> widened = convert<double>(f);
      const double err = test::rel_rms(widened.data(), dbl.data(), dbl.size());
      EXPECT_LE(err, 1e-4) << name << " " << what;
      worst = std::max(worst, err);
      std::printf("[          ] %s %-12s float vs double rel RMS %.2g\n", name, what.c_str(), err);
    };
    compare("y", rf.y, rd.y);
    compare("dx", rf.dx, rd.dx);
    auto gd = const_cast<MoeLayerParams<double>&>(rd.grad).trainable();
    auto gf = const_cast<MoeLayerParams<float>&>(rf.grad).trainable();
    for (size_t t = 0; t < gd.size(); ++t) compare(gd[t].first, *gf[t].second, *gd[t].second);
  }
  RecordProperty("moe_layer_float_vs_double_worst_rel_rms", testing::PrintToString(worst));
}

// Saving activations must not change the float forward (inference and training agree bitwise).
TEST(MoeLayerTest, SavingForwardIsBitIdenticalToInferenceForward) {
  for (const ModelConfig& c : {k3_variant_config(), plain_variant_config()}) {
    const int64_t N = 33, d = c.hidden;
    std::mt19937 rng(9);
    MoeLayerParams<float> params = to_float(random_params(c, 10));
    std::vector<double> x_d(N * d);
    fill_normal(x_d, 0, 1.0, rng);
    const std::vector<float> x = convert<float>(x_d);
    Arena ws(moe_layer_workspace_bytes(c, N), "ws");
    Arena saved_arena(moe_layer_saved_bytes(c, N), "saved");
    std::vector<float> y_inference(N * d), y_training(N * d);
    MoeRouting routing;
    moe_layer_forward(c, params.view(), x.data(), y_inference.data(), N, ws, &routing);
    const std::vector<int32_t> idx(routing.idx, routing.idx + N * c.moe.top_k);
    const std::vector<float> weight(routing.weight, routing.weight + N * c.moe.top_k);
    ws.reset();
    MoeSaved<float> saved;
    MoeRouting routing_training;
    moe_layer_forward(c, params.view(), x.data(), y_training.data(), N, ws, &routing_training,
                      &saved, &saved_arena);
    EXPECT_EQ(y_inference, y_training);
    EXPECT_EQ(routing_training.idx, saved.routing.idx);  // views into the saved arena
    EXPECT_EQ(idx, std::vector<int32_t>(saved.routing.idx, saved.routing.idx + N * c.moe.top_k));
    EXPECT_EQ(weight,
              std::vector<float>(saved.routing.weight, saved.routing.weight + N * c.moe.top_k));
    EXPECT_EQ(ws.used(), 0u);  // routing went to the saved arena, scratch fully released
  }
}

// ---------------------------------------------------------------------------------------------
// Routed experts at a size with several tiles per expert

// Multi-tile experts (> kMoeExpertTileRows rows): float agrees with double, and the float result
// is bit-identical whatever the thread count (one writer per expert, fixed per-token order).
TEST(MoeExpertsBackwardTest, FloatMatchesDoubleAndIsThreadCountIndependent) {
  std::mt19937 rng(31);
  const int64_t N = 700, Din = 24, F = 40;
  const int E = 4, k = 2;
  auto random_floats = [&](size_t n, float stddev) {
    std::normal_distribution<float> dist(0.0f, stddev);
    std::vector<float> v(n);
    for (float& value : v) value = dist(rng);
    return v;
  };
  const std::vector<float> gate = random_floats(E * F * Din, 0.3f);
  const std::vector<float> up = random_floats(E * F * Din, 0.3f);
  const std::vector<float> down = random_floats(E * Din * F, 0.2f);
  const std::vector<float> x = random_floats(N * Din, 1.0f);
  const std::vector<float> dy = random_floats(N * Din, 1.0f);
  std::vector<float> w(N * k);
  std::uniform_real_distribution<float> wdist(0.1f, 1.0f);
  for (float& v : w) v = wdist(rng);
  // Token t → experts t mod E and (t+1) mod E (ascending): 350 rows per expert, two tiles each.
  std::vector<int32_t> idx(N * k);
  for (int64_t t = 0; t < N; ++t) {
    const int32_t a = int32_t(t % E), b = int32_t((t + 1) % E);
    idx[t * k] = std::min(a, b);
    idx[t * k + 1] = std::max(a, b);
  }
  Arena plan_arena(1 << 20, "plan");
  MoePlan plan;
  moe_plan_build(idx.data(), N, k, E, &plan, plan_arena);
  for (int e = 0; e < E; ++e) ASSERT_GT(plan.offsets[e + 1] - plan.offsets[e], kMoeExpertTileRows);
  const ExpertWeights ew{gate.data(), up.data(), down.data(), E, Din, F};
  const int threads_before = num_threads();
  const int many = std::max(threads_before, 4);
  Arena ws(moe_experts_backward_workspace_bytes(N, k, ew, many, 8), "moe-ws");

  struct Grads {
    std::vector<float> dx, dw, dgate, dup, ddown;
  };
  auto run_float = [&](int threads) {
    set_num_threads(threads);
    Grads g{std::vector<float>(N * Din, 0.0f), std::vector<float>(N * k, 0.0f),
            std::vector<float>(gate.size(), 0.0f), std::vector<float>(up.size(), 0.0f),
            std::vector<float>(down.size(), 0.0f)};
    moe_experts_backward(x.data(), plan, w.data(), ew, GluActivation{Activation::SiTU, 4.0f, 25.0f}, nullptr, nullptr, dy.data(),
                         g.dx.data(), g.dw.data(),
                         ExpertGradsT<float>{g.dgate.data(), g.dup.data(), g.ddown.data()}, ws);
    return g;
  };
  const Grads g_many = run_float(many), g_one = run_float(1);
  set_num_threads(threads_before);
  EXPECT_EQ(g_many.dx, g_one.dx);
  EXPECT_EQ(g_many.dw, g_one.dw);
  EXPECT_EQ(g_many.dgate, g_one.dgate);
  EXPECT_EQ(g_many.dup, g_one.dup);
  EXPECT_EQ(g_many.ddown, g_one.ddown);

  auto to_double = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  const std::vector<double> gate_d = to_double(gate), up_d = to_double(up), down_d = to_double(down);
  const std::vector<double> x_d = to_double(x), dy_d = to_double(dy), w_d = to_double(w);
  const ExpertWeightsT<double> ew_d{gate_d.data(), up_d.data(), down_d.data(), E, Din, F};
  std::vector<double> dx(N * Din, 0.0), dw(N * k, 0.0), dgate(gate.size(), 0.0),
      dup(up.size(), 0.0), ddown(down.size(), 0.0);
  moe_experts_backward(x_d.data(), plan, w_d.data(), ew_d, GluActivation{Activation::SiTU, 4.0f, 25.0f}, nullptr, nullptr, dy_d.data(),
                       dx.data(), dw.data(),
                       ExpertGradsT<double>{dgate.data(), dup.data(), ddown.data()}, ws);
  double worst = 0;
  for (const auto& [f, d] : {std::pair{&g_one.dx, &dx}, std::pair{&g_one.dw, &dw},
                             std::pair{&g_one.dgate, &dgate}, std::pair{&g_one.dup, &dup},
                             std::pair{&g_one.ddown, &ddown}}) {
    const std::vector<double> fd(f->begin(), f->end());
    const double err = test::rel_rms(fd.data(), d->data(), fd.size());
    EXPECT_LE(err, 1e-5);
    worst = std::max(worst, err);
  }
  RecordProperty("moe_experts_backward_float_vs_double_rel_rms", testing::PrintToString(worst));
  std::printf("[          ] moe_experts_backward float vs double: worst rel RMS %.3g\n", worst);
}

// ---------------------------------------------------------------------------------------------
// Dense FFN layer

TEST(FfnLayerTest, DenseGradientsMatchFiniteDifferencesAndFloat) {
  ModelConfig c;
  c.hidden = 16;
  c.dense_ffn = 24;
  double worst_fd = 0, worst_float = 0;
  for (Activation act : {Activation::SiTU, Activation::SwiGLU}) {
    c.activation = act;
    const int64_t N = 9, d = c.hidden, F = c.dense_ffn;
    std::mt19937 rng(300 + int(act));
    std::vector<double> gate(F * d), up(F * d), down(d * F), x(N * d), R(N * d);
    fill_normal(gate, 0, 0.5, rng);
    fill_normal(up, 0, 0.5, rng);
    fill_normal(down, 0, 0.4, rng);
    fill_normal(x, 0, 1.0, rng);
    fill_normal(R, 0, 1.0, rng);
    const FfnWeightsT<double> w{gate.data(), up.data(), down.data()};
    Arena ws(std::max(dense_ffn_workspace_bytes(c, N, 8), dense_ffn_backward_workspace_bytes(c, N, 8)),
             "ws");
    Arena saved_arena(dense_ffn_saved_bytes(c, N, 8), "saved");
    DenseFfnSaved<double> saved;
    std::vector<double> y(N * d), dx(N * d, 0.0), dgate(F * d, 0.0), dup(F * d, 0.0),
        ddown(d * F, 0.0);
    dense_ffn_forward(c, w, x.data(), y.data(), N, ws, &saved, &saved_arena);
    FfnWeightsT<double> g{dgate.data(), dup.data(), ddown.data()};
    dense_ffn_backward(c, w, g, x.data(), &saved, R.data(), dx.data(), N, ws);
    // Without saved activations (recompute) the gradients are the same.
    std::vector<double> dx_recomputed(N * d, 0.0), ddown_recomputed(d * F, 0.0);
    FfnWeightsT<double> g_recomputed{nullptr, nullptr, ddown_recomputed.data()};
    dense_ffn_backward(c, w, g_recomputed, x.data(), nullptr,
                       R.data(), dx_recomputed.data(), N, ws);
    EXPECT_LE(test::rel_rms(dx_recomputed.data(), dx.data(), dx.size()), 1e-14);
    EXPECT_LE(test::rel_rms(ddown_recomputed.data(), ddown.data(), ddown.size()), 1e-14);

    auto loss = [&] {
      std::vector<double> out(N * d);
      dense_ffn_forward(c, w, x.data(), out.data(), N, ws);
      return dot(out, R);
    };
    for (auto [name, param, grad] : {std::tuple{"x", &x, &dx}, std::tuple{"gate", &gate, &dgate},
                                     std::tuple{"up", &up, &dup}, std::tuple{"down", &down, &ddown}}) {
      double max_diff = 0, max_grad = 1e-300;
      for (size_t i = 0; i < param->size(); i += 3) {
        double& p = (*param)[i];
        const double keep = p, step = 1e-6 * std::max(1.0, std::fabs(keep));
        p = keep + step;
        const double plus = loss();
        p = keep - step;
        const double minus = loss();
        p = keep;
        max_diff = std::max(max_diff, std::fabs((plus - minus) / (2 * step) - (*grad)[i]));
        max_grad = std::max(max_grad, std::fabs((*grad)[i]));
      }
      const double err = max_diff / max_grad;
      EXPECT_LE(err, 1e-7) << name;
      worst_fd = std::max(worst_fd, err);
    }

    // Float path against the double one.
    const std::vector<float> gate_f = convert<float>(gate), up_f = convert<float>(up),
                             down_f = convert<float>(down), x_f = convert<float>(x),
                             R_f = convert<float>(R);
    const FfnWeightsT<float> wf{const_cast<float*>(gate_f.data()), const_cast<float*>(up_f.data()),
                                const_cast<float*>(down_f.data())};
    Arena ws_f(dense_ffn_backward_workspace_bytes(c, N), "ws-f");
    Arena saved_f_arena(dense_ffn_saved_bytes(c, N), "saved-f");
    DenseFfnSaved<float> saved_f;
    std::vector<float> yf(N * d), dxf(N * d, 0.0f), dgf(F * d, 0.0f), duf(F * d, 0.0f),
        ddf(d * F, 0.0f);
    dense_ffn_forward(c, wf, x_f.data(), yf.data(), N, ws_f, &saved_f, &saved_f_arena);
    FfnWeightsT<float> gf{dgf.data(), duf.data(), ddf.data()};
    dense_ffn_backward(c, wf, gf, x_f.data(), &saved_f, R_f.data(), dxf.data(), N, ws_f);
    // Double reference on the float-rounded values.
    std::vector<double> gate_r = convert<double>(gate_f), up_r = convert<double>(up_f),
                        down_r = convert<double>(down_f), x_r = convert<double>(x_f),
                        R_r = convert<double>(R_f);
    const FfnWeightsT<double> wr{gate_r.data(), up_r.data(), down_r.data()};
    std::vector<double> yr(N * d), dxr(N * d, 0.0), dgr(F * d, 0.0), dur(F * d, 0.0),
        ddr(d * F, 0.0);
    dense_ffn_forward(c, wr, x_r.data(), yr.data(), N, ws);
    FfnWeightsT<double> gr{dgr.data(), dur.data(), ddr.data()};
    dense_ffn_backward(c, wr, gr, x_r.data(), nullptr,
                       R_r.data(), dxr.data(), N, ws);
    for (auto [f, r] : {std::pair{&yf, &yr}, std::pair{&dxf, &dxr}, std::pair{&dgf, &dgr},
                        std::pair{&duf, &dur}, std::pair{&ddf, &ddr}}) {
      const std::vector<double> widened = convert<double>(*f);
      const double err = test::rel_rms(widened.data(), r->data(), r->size());
      EXPECT_LE(err, 1e-5);
      worst_float = std::max(worst_float, err);
    }
  }
  std::printf("[          ] dense FFN layer: FD worst rel err %.2g, float vs double worst rel RMS %.2g\n",
              worst_fd, worst_float);
  RecordProperty("dense_ffn_fd_worst_rel_err", testing::PrintToString(worst_fd));
  RecordProperty("dense_ffn_float_vs_double_worst_rel_rms", testing::PrintToString(worst_float));
}

}  // namespace
}  // namespace dm
