// Whole-model gradients: forward_backward in double against central finite differences of the
// summed cross-entropy, for the three residual/MoE variants (K3: AttnRes + latent SiTU MoE + safe
// KDA gate + gated NoPE MLA; Kimi-Linear: plain residual + plain SwiGLU MoE + softplus gate;
// DeepSeek-V3: all-MLA with RoPE/YaRN + grouped router), with packed documents; then float vs
// double, recompute vs stored activations, and the loss vs a plain forward.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "io/config.h"
#include "model/model.h"
#include "ops/cpu/loss.h"
#include "test_util.h"

using namespace dm;

namespace {

enum class Variant { K3, Kimi, Deepseek };

ModelConfig variant_config(Variant v) {
  ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  c.vocab_size = 96;
  c.max_context = 64;
  if (v == Variant::Kimi) {
    c.residual = ResidualKind::Plain;
    c.attn_res_block = 0;
    c.activation = Activation::SwiGLU;
    c.moe.latent_dim = 0;
    c.moe.latent_norm = false;
    c.moe.num_shared = 1;
    c.kda.gate = KdaGateKind::Softplus;
    c.kda.full_rank_output_gate = false;
    c.mla.output_gate = false;
    c.mla.q_lora_rank = 0;
  } else if (v == Variant::Deepseek) {
    c.residual = ResidualKind::Plain;
    c.attn_res_block = 0;
    c.activation = Activation::SwiGLU;
    c.moe.latent_dim = 0;
    c.moe.latent_norm = false;
    c.moe.num_shared = 1;
    c.moe.n_group = 4;
    c.moe.topk_group = 2;
    c.mla.output_gate = false;
    c.mla.use_rope = true;
    c.mla.yarn.enabled = true;
    c.mla.yarn.factor = 4;
    c.mla.yarn.original_max_position = 8;
    c.mla.yarn.mscale = 1.0;
    c.mla.yarn.mscale_all_dim = 0.7;
    for (auto& m : c.mixers) m = MixerKind::MLA;
  }
  validate_config(c, "test variant");
  return c;
}

struct Batch {
  int64_t B = 2, T = 12;
  std::vector<int64_t> tokens, targets;
  std::vector<int32_t> doc_start;
};

Batch make_batch(const ModelConfig& c, uint64_t seed) {
  Batch b;
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < b.B * b.T; ++i) {
    b.tokens.push_back(int64_t(rng() % uint64_t(c.vocab_size)));
    b.targets.push_back(i % 7 == 3 ? -1 : int64_t(rng() % uint64_t(c.vocab_size)));
  }
  for (int64_t r = 0; r < b.B; ++r)
    for (int64_t t = 0; t < b.T; ++t) b.doc_start.push_back(r == 1 && t >= 5 ? 5 : 0);
  return b;
}

// Σ CE from a plain forward pass (what the finite differences perturb).
double forward_loss(ModelT<double>& m, const Batch& b) {
  const int64_t V = m.config().vocab_size;
  std::vector<double> logits(size_t(b.B * b.T * V));
  ForwardOptions fo;
  fo.kda_chunk = 16;
  m.forward(b.tokens.data(), b.B, b.T, logits.data(), nullptr, fo, b.doc_start.data());
  return cross_entropy_forward_backward<double>(logits.data(), b.targets.data(), nullptr, b.B * b.T,
                                                V, 1.0)
      .loss_sum;
}

template <typename Real>
double loss_of(ModelT<Real>& m, const Batch& b, ModelWeightsT<Real>& scratch_grad,
               const TrainOptions& opt = {}) {
  return m.forward_backward(b.tokens.data(), b.targets.data(), b.doc_start.data(), b.B, b.T,
                            scratch_grad, 1.0, opt)
      .loss_sum;
}

void check_variant(Variant v) {
  const ModelConfig c = variant_config(v);
  auto w = weights_allocate<double>(c);
  weights_init(*w, 11);
  // Non-zero pseudo-queries and routing bias so every path carries gradient.
  std::mt19937_64 rng(3);
  std::normal_distribution<double> nd(0.0, 0.3);
  for (auto& e : w->params)
    if (e.name.find("res_proj") != std::string::npos || e.name.find("correction_bias") != std::string::npos)
      for (int64_t i = 0; i < e.numel(); ++i) e.data[i] = nd(rng);
  ModelT<double> m(std::move(w));
  const Batch b = make_batch(c, 5);
  auto grad = weights_allocate<double>(c);
  TrainOptions opt;
  opt.kda_chunk = 16;
  loss_of(m, b, *grad, opt);

  int checked = 0, bad = 0;
  double worst = 0;
  std::string worst_name;
  for (size_t pi = 0; pi < m.weights().params.size(); ++pi) {
    auto& e = m.weights().params[pi];
    if (!e.trainable) continue;
    for (int rep = 0; rep < 1; ++rep) {
      const int64_t i = int64_t(rng() % uint64_t(e.numel()));
      const double orig = e.data[i];
      const double h = 1e-6 * std::max(1.0, std::fabs(orig));
      e.data[i] = orig + h;
      const double lp = forward_loss(m, b);
      e.data[i] = orig - h;
      const double lm = forward_loss(m, b);
      e.data[i] = orig;
      const double fd = (lp - lm) / (2 * h);
      const double an = grad->params[pi].data[i];
      // Loss ≈ 100 and h = 1e-6 leave ~1e-8 of rounding in fd: judge tiny entries absolutely.
      const double err = std::fabs(fd - an) / (std::fabs(fd) + std::fabs(an) + 1e-3);
      ++checked;
      if (err > worst) worst = err, worst_name = e.name;
      if (err > 1e-4) {
        ++bad;
        ADD_FAILURE() << e.name << "[" << i << "]: analytic " << an << " vs finite difference " << fd;
      }
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_GT(checked, 40);
  std::printf("  %d gradient entries checked, worst relative error %.2e (%s)\n", checked, worst,
              worst_name.c_str());
}

}  // namespace

TEST(ModelGrad, K3VariantMatchesFiniteDifferences) { check_variant(Variant::K3); }
TEST(ModelGrad, KimiVariantMatchesFiniteDifferences) { check_variant(Variant::Kimi); }
TEST(ModelGrad, DeepseekVariantMatchesFiniteDifferences) { check_variant(Variant::Deepseek); }

TEST(ModelGrad, FloatMatchesDoubleAndRecomputeIsExact) {
  const ModelConfig c = variant_config(Variant::K3);
  auto wd = weights_allocate<double>(c);
  weights_init(*wd, 2);
  auto wf = weights_allocate<float>(c);
  weights_init(*wf, 2);
  ModelT<double> md(std::move(wd));
  Model mf(std::move(wf));
  const Batch b = make_batch(c, 9);
  auto gd = weights_allocate<double>(c);
  auto gf = weights_allocate<float>(c);
  auto gf2 = weights_allocate<float>(c);
  TrainOptions keep;
  keep.recompute = false;
  const double ld = loss_of(md, b, *gd);
  const double lf = loss_of(mf, b, *gf);
  const double lf2 = loss_of(mf, b, *gf2, keep);
  EXPECT_NEAR(lf, ld, 1e-4 * std::fabs(ld));
  EXPECT_EQ(lf, lf2);
  for (size_t i = 0; i < gf->params.size(); ++i) {
    const auto& a = gf->params[i];
    for (int64_t j = 0; j < a.numel(); ++j) ASSERT_EQ(a.data[j], gf2->params[i].data[j]) << a.name;
    std::vector<float> ref(gd->params[i].data, gd->params[i].data + a.numel());
    double norm = 0;
    for (float x : ref) norm += double(x) * x;
    if (norm == 0) continue;
    EXPECT_LE(test::rel_rms(a.data, ref.data(), ref.size()), 2e-3) << a.name;
  }
}

TEST(ModelGrad, TrainingLossEqualsForwardCrossEntropy) {
  const ModelConfig c = variant_config(Variant::Kimi);
  auto w = weights_allocate<float>(c);
  weights_init(*w, 4);
  Model m(std::move(w));
  Batch b = make_batch(c, 1);
  std::fill(b.doc_start.begin(), b.doc_start.end(), 0);
  auto g = weights_allocate<float>(c);
  const double train_loss = loss_of(m, b, *g);
  std::vector<float> logits(size_t(b.B * b.T * c.vocab_size));
  m.forward(b.tokens.data(), b.B, b.T, logits.data());
  const CrossEntropyResult ce = cross_entropy_forward_backward<float>(
      logits.data(), b.targets.data(), nullptr, b.B * b.T, c.vocab_size, 1.0);
  EXPECT_NEAR(train_loss, ce.loss_sum, 1e-4 * ce.loss_sum);
}
