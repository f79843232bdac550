// Optimizers: AdamW's first step is lr·sign(g) plus decoupled decay only where decay applies;
// Muon's per-head update is orthogonalised (its squared Frobenius norm ≈ its rank) and training
// with Muon lowers the loss; the LR schedule has its warmup and cosine ends.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <fstream>

#include "io/config.h"
#include "test_util.h"
#include "train/optimizer.h"

using namespace dm;

namespace {
ModelConfig tiny() { return load_config(test::source_dir() + "/configs/test.json"); }
void fill_grad(ModelWeights& g, uint64_t seed) {
  uint64_t s = seed;
  for (auto& e : g.params)
    for (int64_t i = 0; i < e.numel(); ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      e.data[i] = float(int64_t(s >> 40) % 2001 - 1000) / 1000.0f;
    }
}
}  // namespace

TEST(Optimizer, AdamWFirstStepIsSignedLrPlusDecay) {
  const ModelConfig c = tiny();
  auto w = weights_allocate<float>(c), g = weights_allocate<float>(c);
  weights_init(*w, 1);
  auto before = weights_allocate<float>(c);
  weights_copy<float, float>(*w, *before);
  fill_grad(*g, 5);
  OptimizerConfig oc;
  Optimizer opt(c, oc);
  const float lr = 1e-2f;
  opt.step(*w, *g, lr);
  for (size_t i = 0; i < w->params.size(); ++i) {
    const auto& e = w->params[i];
    for (int64_t j = 0; j < std::min<int64_t>(e.numel(), 50); ++j) {
      const float p0 = before->params[i].data[j], gr = g->params[i].data[j];
      if (!e.trainable) {
        ASSERT_EQ(e.data[j], p0) << e.name;
        continue;
      }
      const float expect = p0 - lr * gr / (std::fabs(gr) + oc.eps) - (e.decay ? lr * oc.weight_decay * p0 : 0.0f);
      ASSERT_NEAR(e.data[j], expect, 1e-6f + 1e-5f * std::fabs(expect)) << e.name << "[" << j << "]";
    }
  }
}

TEST(Optimizer, MuonUpdatesAreOrthogonalPerHead) {
  const ModelConfig c = tiny();
  auto w = weights_allocate<float>(c), g = weights_allocate<float>(c);
  weights_init(*w, 1);
  auto before = weights_allocate<float>(c);
  weights_copy<float, float>(*w, *before);
  fill_grad(*g, 9);
  OptimizerConfig oc;
  oc.kind = OptimizerKind::Muon;
  oc.weight_decay = 0;
  Optimizer opt(c, oc);
  const float lr = 1e-3f;
  opt.step(*w, *g, lr);
  const ParamEntry* q = w->find("language_model.model.layers.0.self_attn.q_proj.weight");
  ASSERT_NE(q, nullptr);
  const ParamEntry* q0 = before->find(q->name);
  const int64_t K = c.kda.head_dim, d = q->shape[1];
  const float scale = 0.2f * std::sqrt(float(std::max(K, d)));
  for (int64_t h = 0; h < c.kda.num_heads; ++h) {
    double fro = 0;
    for (int64_t i = h * K * d; i < (h + 1) * K * d; ++i) {
      const double u = (q->data[i] - q0->data[i]) / (lr * scale);
      fro += u * u;
    }
    // An orthogonalised K×d block (K ≤ d) has K singular values near 1 (NS5 lands in ~[0.7, 1.2]).
    EXPECT_GT(fro, 0.4 * double(K)) << "head " << h;
    EXPECT_LT(fro, 1.5 * double(K)) << "head " << h;
  }
}

TEST(Optimizer, TrainingWithMuonLowersTheLoss) {
  const std::string out = test::temp_dir("muon");
  const auto r = test::run_cli("train --config " + test::source_dir() + "/configs/test.json --out " + out +
                               " --optimizer muon --batch 4 --stages 64:8K --lr 1e-2 --warmup 3 --quiet");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(out + "/metrics.jsonl");
  std::string line;
  std::vector<double> loss;
  while (std::getline(in, line)) loss.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  ASSERT_GE(loss.size(), 20u);
  double first = 0, last = 0;
  for (size_t i = 0; i < 5; ++i) first += loss[i] / 5, last += loss[loss.size() - 1 - i] / 5;
  EXPECT_LT(last, first - 1.0) << first << " -> " << last;
}

TEST(Optimizer, LrScheduleWarmupAndCosine) {
  EXPECT_FLOAT_EQ(lr_schedule(0, 10, 100, 1.0f, 0.1f), 0.1f);
  EXPECT_FLOAT_EQ(lr_schedule(9, 10, 100, 1.0f, 0.1f), 1.0f);
  EXPECT_NEAR(lr_schedule(10, 10, 100, 1.0f, 0.1f), 1.0f, 1e-6);
  EXPECT_NEAR(lr_schedule(55, 10, 100, 1.0f, 0.1f), 0.55f, 1e-6);
  EXPECT_NEAR(lr_schedule(100, 10, 100, 1.0f, 0.1f), 0.1f, 1e-6);
}
