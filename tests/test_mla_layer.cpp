// Gated MLA layer backward (model/mla.h): finite differences in double for every parameter
// tensor (a random subset of entries) and the input, for the K3 variant (q LoRA, NoPE, output
// gate), the DeepSeek variant (q LoRA, RoPE + YaRN, no gate) and the Kimi variant (no q LoRA);
// float vs double agreement; packed documents (doc_start) vs separate rows; accumulation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "io/config.h"
#include "model/mla.h"
#include "test_util.h"

namespace dm {
namespace {

enum class MlaVariant { K3, DeepSeek, Kimi };

const char* variant_name(MlaVariant v) {
  return v == MlaVariant::K3 ? "K3" : v == MlaVariant::DeepSeek ? "DeepSeek" : "Kimi";
}

// Tiny config: d=16, H=2, nope 8, rope 4, v 8, kv_lora 8, q_lora 12.
ModelConfig tiny_mla_config(MlaVariant variant) {
  ModelConfig cfg;
  cfg.hidden = 16;
  MlaConfig& m = cfg.mla;
  m.num_heads = 2;
  m.qk_nope_dim = 8;
  m.qk_rope_dim = 4;
  m.v_head_dim = 8;
  m.kv_lora_rank = 8;
  m.q_lora_rank = variant == MlaVariant::Kimi ? 0 : 12;
  m.output_gate = variant == MlaVariant::K3;
  m.use_rope = variant == MlaVariant::DeepSeek;
  m.latent_norm_eps = 1e-6f;
  if (variant == MlaVariant::DeepSeek) {
    // YaRN with a ramp inside the 2 frequency pairs and mscale ≠ mscale_all_dim, so the tables
    // carry an amplitude ≠ 1 (the RoPE backward must be the transpose, not the inverse).
    m.rope_theta = 10000.0;
    m.yarn.enabled = true;
    m.yarn.factor = 4.0;
    m.yarn.original_max_position = 8;
    m.yarn.beta_fast = 32;
    m.yarn.beta_slow = 1;
    m.yarn.mscale = 1.0;
    m.yarn.mscale_all_dim = 0.5;
  }
  return cfg;
}

// Owns one tensor per MlaWeightsT field (empty when the config does not use it).
template <typename Real>
struct OwnedMlaWeights {
  std::vector<std::vector<Real>> tensors;  // in the order of tensor_names()
  static std::vector<std::string> tensor_names() {
    return {"q_a", "q_a_norm", "q_b", "q_proj", "kv_a", "kv_a_norm", "kv_b", "gate", "o_proj"};
  }
  MlaWeightsT<Real> view() {
    auto p = [&](int i) { return tensors[size_t(i)].empty() ? nullptr : tensors[size_t(i)].data(); };
    MlaWeightsT<Real> w{};
    w.q_a = p(0), w.q_a_norm = p(1), w.q_b = p(2), w.q_proj = p(3);
    w.kv_a = p(4), w.kv_a_norm = p(5), w.kv_b = p(6), w.gate = p(7), w.o_proj = p(8);
    return w;
  }
};

template <typename Real>
OwnedMlaWeights<Real> zero_weights_for(const ModelConfig& cfg) {
  const MlaConfig& m = cfg.mla;
  const int64_t d = cfg.hidden, H = m.num_heads, dq = m.qk_nope_dim + m.qk_rope_dim;
  const int64_t ql = m.q_lora_rank, kvl = m.kv_lora_rank, dv = m.v_head_dim;
  const bool lora = ql > 0;
  const std::vector<int64_t> sizes = {lora ? ql * d : 0,
                                      lora ? ql : 0,
                                      lora ? H * dq * ql : 0,
                                      lora ? 0 : H * dq * d,
                                      (kvl + m.qk_rope_dim) * d,
                                      kvl,
                                      H * (m.qk_nope_dim + dv) * kvl,
                                      m.output_gate ? H * dv * d : 0,
                                      d * H * dv};
  OwnedMlaWeights<Real> w;
  for (int64_t n : sizes) w.tensors.emplace_back(size_t(n), Real(0));
  return w;
}

// Random weights: matrices N(0, 1/in) (so activations stay O(1)), norm weights 1 + N(0, 0.2²).
OwnedMlaWeights<double> random_weights_for(const ModelConfig& cfg, uint32_t seed) {
  OwnedMlaWeights<double> w = zero_weights_for<double>(cfg);
  const MlaConfig& m = cfg.mla;
  const int64_t fan_in[] = {cfg.hidden, 0, m.q_lora_rank, cfg.hidden, cfg.hidden, 0,
                            m.kv_lora_rank, cfg.hidden, m.num_heads * m.v_head_dim};
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (size_t i = 0; i < w.tensors.size(); ++i)
    for (double& value : w.tensors[i])
      value = fan_in[i] > 0 ? normal(rng) / std::sqrt(double(fan_in[i])) : 1.0 + 0.2 * normal(rng);
  return w;
}

template <typename To>
OwnedMlaWeights<To> cast_weights(const OwnedMlaWeights<double>& w) {
  OwnedMlaWeights<To> c;
  for (const auto& t : w.tensors) c.tensors.emplace_back(t.begin(), t.end());
  return c;
}

std::vector<double> random_doubles(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> out(n);
  for (auto& x : out) x = normal(rng);
  return out;
}

// One layer instance with arenas sized by the layer's own size functions.
template <typename Real>
struct MlaHarness {
  ModelConfig cfg;
  int64_t B, T;
  Arena ws, saved_arena;
  MlaHarness(const ModelConfig& c, int64_t b, int64_t t)
      : cfg(c), B(b), T(t),
        ws(std::max(mla_layer_workspace_bytes(c, b, t, sizeof(Real)),
                    mla_layer_backward_workspace_bytes(c, b, t, sizeof(Real))),
           "mla-test-ws"),
        saved_arena(mla_layer_saved_bytes(c, b, t, sizeof(Real)), "mla-test-saved") {}

  std::vector<Real> forward(OwnedMlaWeights<Real>& w, const std::vector<Real>& x,
                            const int32_t* doc_start = nullptr) {
    std::vector<Real> y(x.size());
    mla_layer_forward(cfg, w.view(), x.data(), y.data(), B, T, ws, doc_start);
    EXPECT_EQ(ws.used(), 0u);
    return y;
  }
  // Forward with saved activations then backward with dy; gradients accumulate into grad, dx.
  std::vector<Real> forward_backward(OwnedMlaWeights<Real>& w, const std::vector<Real>& x,
                                     const std::vector<Real>& dy, OwnedMlaWeights<Real>& grad,
                                     std::vector<Real>& dx, const int32_t* doc_start = nullptr) {
    std::vector<Real> y(x.size());
    saved_arena.reset();
    MlaSaved<Real> saved;
    mla_layer_forward(cfg, w.view(), x.data(), y.data(), B, T, ws, doc_start, &saved,
                      &saved_arena);
    EXPECT_EQ(ws.used(), 0u);
    EXPECT_LE(saved_arena.used(), saved_arena.capacity());
    MlaWeightsT<Real> grad_view = grad.view();
    mla_layer_backward(cfg, w.view(), grad_view, x.data(), saved, dy.data(), dx.data(), B, T, ws,
                       doc_start);
    EXPECT_EQ(ws.used(), 0u);
    return y;
  }
};

void check_layer_finite_differences(MlaVariant variant, bool packed) {
  const int64_t B = 2, T = 11;
  const ModelConfig cfg = tiny_mla_config(variant);
  const int64_t d = cfg.hidden;
  OwnedMlaWeights<double> w = random_weights_for(cfg, 100u + uint32_t(variant));
  std::vector<double> x = random_doubles(size_t(B * T * d), 200u);
  const std::vector<double> R = random_doubles(size_t(B * T * d), 300u);
  // Row 0: documents of 4 and 7 tokens; row 1: 2, 6, 3.
  std::vector<int32_t> doc_start;
  if (packed) doc_start = {0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 0, 0, 2, 2, 2, 2, 2, 2, 8, 8, 8};
  const int32_t* doc = packed ? doc_start.data() : nullptr;

  MlaHarness<double> layer(cfg, B, T);
  OwnedMlaWeights<double> grad = zero_weights_for<double>(cfg);
  std::vector<double> dx(x.size(), 0.0);
  layer.forward_backward(w, x, R, grad, dx, doc);

  auto loss = [&]() {
    const std::vector<double> y = layer.forward(w, x, doc);
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += y[i] * R[i];
    return l;
  };
  std::mt19937 rng(7);
  auto check = [&](std::vector<double>& values, const std::vector<double>& gradient,
                   const std::string& name) {
    if (values.empty()) return;
    double gradient_rms = 0;
    for (double g : gradient) gradient_rms += g * g;
    gradient_rms = std::sqrt(gradient_rms / double(gradient.size()));
    ASSERT_GT(gradient_rms, 0.0) << name << " gradient is identically zero";
    const size_t samples = std::min<size_t>(values.size(), 16);
    double max_relative_error = 0;
    for (size_t s = 0; s < samples; ++s) {
      const size_t i = values.size() <= 16 ? s : size_t(rng() % values.size());
      const double saved = values[i], h = 1e-6 * std::max(1.0, std::abs(saved));
      values[i] = saved + h;
      const double plus = loss();
      values[i] = saved - h;
      const double minus = loss();
      values[i] = saved;
      const double numeric = (plus - minus) / (2 * h);
      // Relative to the entry, floored at a tenth of the tensor's gradient RMS (entries whose
      // gradient is nearly zero are judged against the tensor's scale).
      max_relative_error =
          std::max(max_relative_error, std::abs(numeric - gradient[i]) /
                                           std::max(std::abs(gradient[i]), 0.1 * gradient_rms));
    }
    std::printf("  MLA %-8s packed=%d d%-9s max rel error %.3g\n", variant_name(variant),
                int(packed), name.c_str(), max_relative_error);
    EXPECT_LE(max_relative_error, 1e-6) << variant_name(variant) << " " << name;
  };
  const auto names = OwnedMlaWeights<double>::tensor_names();
  for (size_t t = 0; t < names.size(); ++t) check(w.tensors[t], grad.tensors[t], names[t]);
  check(x, dx, "x");
}

TEST(MlaLayerBackward, FiniteDifferencesK3) { check_layer_finite_differences(MlaVariant::K3, false); }
TEST(MlaLayerBackward, FiniteDifferencesDeepSeek) {
  check_layer_finite_differences(MlaVariant::DeepSeek, false);
}
TEST(MlaLayerBackward, FiniteDifferencesKimi) { check_layer_finite_differences(MlaVariant::Kimi, false); }
TEST(MlaLayerBackward, FiniteDifferencesPackedDocumentsK3) {
  check_layer_finite_differences(MlaVariant::K3, true);
}
TEST(MlaLayerBackward, FiniteDifferencesPackedDocumentsDeepSeek) {
  check_layer_finite_differences(MlaVariant::DeepSeek, true);
}

TEST(MlaLayerBackward, FloatAgreesWithDouble) {
  const int64_t B = 2, T = 11;
  for (MlaVariant variant : {MlaVariant::K3, MlaVariant::DeepSeek, MlaVariant::Kimi}) {
    const ModelConfig cfg = tiny_mla_config(variant);
    OwnedMlaWeights<double> w = random_weights_for(cfg, 400u);
    OwnedMlaWeights<float> wf = cast_weights<float>(w);
    const std::vector<double> x = random_doubles(size_t(B * T * cfg.hidden), 401u);
    const std::vector<double> dy = random_doubles(x.size(), 402u);
    const std::vector<float> xf(x.begin(), x.end()), dyf(dy.begin(), dy.end());

    MlaHarness<double> layer(cfg, B, T);
    MlaHarness<float> layer_float(cfg, B, T);
    OwnedMlaWeights<double> grad = zero_weights_for<double>(cfg);
    OwnedMlaWeights<float> grad_float = zero_weights_for<float>(cfg);
    std::vector<double> dx(x.size(), 0.0);
    std::vector<float> dx_float(x.size(), 0.0f);
    const std::vector<double> y = layer.forward_backward(w, x, dy, grad, dx);
    const std::vector<float> y_float = layer_float.forward_backward(wf, xf, dyf, grad_float, dx_float);

    auto err = [](const std::vector<float>& a, const std::vector<double>& b) {
      const std::vector<double> a_double(a.begin(), a.end());
      return test::rel_rms(a_double.data(), b.data(), b.size());
    };
    double worst = std::max(err(y_float, y), err(dx_float, dx));
    std::printf("  MLA %-8s float vs double: y %.3g dx %.3g", variant_name(variant),
                err(y_float, y), err(dx_float, dx));
    const auto names = OwnedMlaWeights<double>::tensor_names();
    for (size_t t = 0; t < names.size(); ++t) {
      if (grad.tensors[t].empty()) continue;
      const double e = err(grad_float.tensors[t], grad.tensors[t]);
      std::printf(" d%s %.2g", names[t].c_str(), e);
      worst = std::max(worst, e);
    }
    std::printf("\n");
    EXPECT_LE(worst, 1e-4) << variant_name(variant);

    // The inference forward (no saved) equals the training forward.
    const std::vector<float> y_inference = layer_float.forward(wf, xf);
    EXPECT_EQ(y_inference, y_float);
  }
}

// A batch whose rows pack several documents equals running every document as its own row:
// outputs and dx per token, and parameter gradients summed over documents. RoPE positions
// restart at each document (DeepSeek variant) and attention never crosses a boundary.
TEST(MlaLayerDocStart, PackedRowsEqualSeparateDocuments) {
  const int64_t B = 2, T = 11;
  const std::vector<std::vector<int>> lengths = {{4, 7}, {2, 6, 3}};
  std::vector<int32_t> doc_start;
  for (const auto& row : lengths) {
    int32_t start = 0;
    for (int length : row) {
      for (int i = 0; i < length; ++i) doc_start.push_back(start);
      start += length;
    }
  }
  for (MlaVariant variant : {MlaVariant::K3, MlaVariant::DeepSeek, MlaVariant::Kimi}) {
    const ModelConfig cfg = tiny_mla_config(variant);
    const int64_t d = cfg.hidden;
    OwnedMlaWeights<double> w = random_weights_for(cfg, 500u);
    const std::vector<double> x = random_doubles(size_t(B * T * d), 501u);
    const std::vector<double> dy = random_doubles(x.size(), 502u);

    MlaHarness<double> packed_layer(cfg, B, T);
    OwnedMlaWeights<double> packed_grad = zero_weights_for<double>(cfg);
    std::vector<double> packed_dx(x.size(), 0.0);
    const std::vector<double> packed_y =
        packed_layer.forward_backward(w, x, dy, packed_grad, packed_dx, doc_start.data());

    OwnedMlaWeights<double> summed_grad = zero_weights_for<double>(cfg);
    double max_y_error = 0, max_dx_error = 0;
    for (int64_t b = 0; b < B; ++b) {
      int64_t start = 0;
      for (int length : lengths[size_t(b)]) {
        const size_t first = size_t((b * T + start) * d), count = size_t(length * d);
        const std::vector<double> doc_x(x.begin() + first, x.begin() + first + count);
        const std::vector<double> doc_dy(dy.begin() + first, dy.begin() + first + count);
        MlaHarness<double> doc_layer(cfg, 1, length);
        std::vector<double> doc_dx(count, 0.0);
        const std::vector<double> doc_y =
            doc_layer.forward_backward(w, doc_x, doc_dy, summed_grad, doc_dx);
        for (size_t i = 0; i < count; ++i) {
          max_y_error = std::max(max_y_error, std::abs(doc_y[i] - packed_y[first + i]));
          max_dx_error = std::max(max_dx_error, std::abs(doc_dx[i] - packed_dx[first + i]));
        }
        start += length;
      }
    }
    double max_grad_error = 0;
    for (size_t t = 0; t < packed_grad.tensors.size(); ++t)
      for (size_t i = 0; i < packed_grad.tensors[t].size(); ++i)
        max_grad_error = std::max(max_grad_error,
                                  std::abs(packed_grad.tensors[t][i] - summed_grad.tensors[t][i]));
    std::printf("  MLA %-8s packed vs separate: y %.3g dx %.3g grads %.3g (max abs)\n",
                variant_name(variant), max_y_error, max_dx_error, max_grad_error);
    EXPECT_LE(max_y_error, 1e-12);
    EXPECT_LE(max_dx_error, 1e-12);
    EXPECT_LE(max_grad_error, 1e-11);
  }
}

TEST(MlaLayerBackward, GradientsAccumulate) {
  const int64_t B = 1, T = 11;
  const ModelConfig cfg = tiny_mla_config(MlaVariant::K3);
  OwnedMlaWeights<double> w = random_weights_for(cfg, 600u);
  const std::vector<double> x = random_doubles(size_t(B * T * cfg.hidden), 601u);
  const std::vector<double> dy = random_doubles(x.size(), 602u);
  MlaHarness<double> layer(cfg, B, T);
  OwnedMlaWeights<double> once = zero_weights_for<double>(cfg), twice = zero_weights_for<double>(cfg);
  std::vector<double> dx_once(x.size(), 0.0), dx_twice(x.size(), 0.0);
  layer.forward_backward(w, x, dy, once, dx_once);
  layer.forward_backward(w, x, dy, twice, dx_twice);
  layer.forward_backward(w, x, dy, twice, dx_twice);
  for (size_t i = 0; i < dx_once.size(); ++i)
    ASSERT_NEAR(dx_twice[i], 2 * dx_once[i], 1e-13 * (1 + std::abs(dx_once[i])));
  for (size_t t = 0; t < once.tensors.size(); ++t)
    for (size_t i = 0; i < once.tensors[t].size(); ++i)
      ASSERT_NEAR(twice.tensors[t][i], 2 * once.tensors[t][i],
                  1e-13 * (1 + std::abs(once.tensors[t][i])));
}

}  // namespace
}  // namespace dm
