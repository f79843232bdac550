// GPU MoE layer forward (model/cuda/layers.h moe_layer_forward_gpu) against the CPU layer
// (model/moe.h moe_layer_forward) on the same bf16-rounded weights and inputs: routing indices
// identical (ties within 1e-6 of biased score aside), scores / cutoffs within fp32 tolerance, and
// the layer output within rel RMS 1e-2. Variants of configs/test.json: latent + latent norm +
// shared experts (K3), no shared experts, latent without norm, plain (no latent, SwiGLU, expert
// groups, scaling 2.5), top_k 1 and 3; a random routing bias so the biased selection matters.
// N = 200 and 1000. Skips without a GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "io/config.h"
#include "model/cuda/layers.h"
#include "model/moe.h"
#include "model/weights.h"
#include "ops/cuda/device.h"
#include "test_util.h"

namespace dm {
namespace {

ModelConfig base_config() { return load_config(test::source_dir() + "/configs/test.json"); }

struct Variant {
  std::string name;
  std::function<void(ModelConfig&)> edit;
};

std::vector<Variant> variants() {
  return {
      {"k3", [](ModelConfig&) {}},
      {"no_shared",
       [](ModelConfig& c) {
         c.moe.num_shared = 0;
         c.moe.shared_ffn = 0;
       }},
      {"latent_no_norm", [](ModelConfig& c) { c.moe.latent_norm = false; }},
      {"plain_grouped",
       [](ModelConfig& c) {
         c.activation = Activation::SwiGLU;
         c.moe.latent_dim = 0;
         c.moe.latent_norm = false;
         c.moe.n_group = 4;
         c.moe.topk_group = 2;
         c.moe.routed_scaling = 2.5f;
       }},
      {"top_k_1", [](ModelConfig& c) { c.moe.top_k = 1; }},
      {"top_k_3", [](ModelConfig& c) { c.moe.top_k = 3; }},
  };
}

int first_moe_layer(const ModelConfig& c) {
  for (int i = 0; i < c.num_layers; ++i)
    if (c.ffns[size_t(i)] == FfnKind::MoE) return i;
  return -1;
}

// Every weight rounded through bf16 so the CPU (fp32) and the GPU (bf16 operands) see the same
// values; the routing bias first gets N(0, 0.05) values so selection depends on it.
void prepare_weights(ModelWeights& w, int layer, uint64_t seed) {
  weights_init(w, seed);
  std::mt19937_64 rng(seed + 1000);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  float* bias = w.layers[size_t(layer)].moe.router_bias;
  for (int e = 0; e < w.cfg.moe.num_experts; ++e) bias[e] = normal(rng);
  for (auto& p : w.params)
    for (int64_t i = 0; i < p.numel(); ++i)
      p.data[i] = cuda::bf16_to_float(cuda::float_to_bf16(p.data[i]));
}

// The k-th and (k+1)-th largest biased scores of a token are within `tol` (an ambiguous
// selection where a last-ulp difference between CPU and GPU scores may pick either expert).
bool selection_is_tie(const float* scores, const float* bias, int E, int k, double tol) {
  if (k >= E) return false;
  std::vector<double> biased(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) biased[size_t(e)] = double(scores[e]) + double(bias[e]);
  std::sort(biased.begin(), biased.end(), std::greater<double>());
  return biased[size_t(k - 1)] - biased[size_t(k)] <= tol;
}

void check_variant(const Variant& v, int64_t N) {
  ModelConfig cfg = base_config();
  v.edit(cfg);
  validate_config(cfg, v.name);
  const int layer = first_moe_layer(cfg);
  ASSERT_GE(layer, 0);
  const int64_t d = cfg.hidden, E = cfg.moe.num_experts, k = cfg.moe.top_k;
  SCOPED_TRACE(str_cat(v.name, " N=", N, " E=", E, " k=", k, " latent=", cfg.moe.latent_dim,
                       " shared=", cfg.moe.num_shared));

  auto w = weights_allocate<float>(cfg);
  prepare_weights(*w, layer, 17 + uint64_t(N));
  const MoeWeights& mw = w->layers[size_t(layer)].moe;
  const std::vector<float> x = test::round_bf16(test::random_normal(size_t(N * d), 99 + N));

  // CPU reference in fp32 on the rounded values.
  std::vector<float> y_cpu(size_t(N * d));
  Arena ws(moe_layer_workspace_bytes(cfg, N));
  MoeRouting routing_cpu;
  moe_layer_forward<float>(cfg, mw, x.data(), y_cpu.data(), N, ws, &routing_cpu);

  // GPU: scratch sized by the layer's own byte count (an overflow would throw).
  cuda::DeviceWeights dw(*w);
  cuda::GpuRun run(cuda::moe_layer_forward_gpu_bytes(cfg, N));
  test::DeviceScratch io(size_t(N * d) * 16 + 8192);  // x bf16, y, y2 and y3 fp32
  const uint16_t* x_dev = io.upload(test::to_bf16(x));
  float* y_dev = io.zeros<float>(size_t(N * d));
  cuda::MoeRoutingDevice routing;
  cuda::moe_layer_forward_gpu(run, dw, mw, x_dev, y_dev, N, &routing);
  const std::vector<float> y_gpu = test::DeviceScratch::download(y_dev, size_t(N * d));
  const std::vector<int32_t> idx = test::DeviceScratch::download(routing.idx, size_t(N * k));
  const std::vector<float> scores = test::DeviceScratch::download(routing.scores, size_t(N * E));
  const std::vector<float> cutoff = test::DeviceScratch::download(routing.cutoff, size_t(N));

  // Routing: indices identical except at ties of the biased scores.
  int64_t mismatched = 0, unexplained = 0;
  for (int64_t t = 0; t < N; ++t) {
    bool same = true;
    for (int64_t j = 0; j < k; ++j) same &= idx[size_t(t * k + j)] == routing_cpu.idx[t * k + j];
    if (same) continue;
    ++mismatched;
    if (!selection_is_tie(routing_cpu.scores + t * E, mw.router_bias, int(E), int(k), 1e-6))
      ++unexplained;
  }
  const double score_err = test::rel_rms(scores.data(), routing_cpu.scores, size_t(N * E));
  double cutoff_max_diff = 0.0;
  int64_t cutoff_inf_mismatch = 0;
  for (int64_t t = 0; t < N; ++t) {
    const float a = cutoff[size_t(t)], b = routing_cpu.cutoff[t];
    if (std::isfinite(a) && std::isfinite(b))
      cutoff_max_diff = std::max(cutoff_max_diff, double(std::fabs(a - b)));
    else if (!(std::isinf(a) && std::isinf(b) && a == b))
      ++cutoff_inf_mismatch;
  }
  const double y_err = test::rel_rms(y_gpu.data(), y_cpu.data(), y_cpu.size());
  std::printf("[CudaMoeLayer] %-15s N=%5lld k=%lld: idx mismatches %lld (unexplained %lld), "
              "score rel RMS %.3g, cutoff max |diff| %.3g, output rel RMS %.3e\n",
              v.name.c_str(), (long long)N, (long long)k, (long long)mismatched,
              (long long)unexplained, score_err, cutoff_max_diff, y_err);
  EXPECT_EQ(unexplained, 0);
  EXPECT_LE(mismatched, std::max<int64_t>(1, N / 500));
  EXPECT_LE(score_err, 1e-5);
  EXPECT_LE(cutoff_max_diff, 1e-5);
  EXPECT_EQ(cutoff_inf_mismatch, 0);
  EXPECT_TRUE(test::all_finite(y_gpu));
  EXPECT_LE(y_err, 1e-2);

  // Without routing outputs: same result, and the scope leaves the arena where it was.
  run.scratch.reset();
  const size_t mark = run.scratch.used();
  float* y2_dev = io.zeros<float>(size_t(N * d));
  cuda::moe_layer_forward_gpu(run, dw, mw, x_dev, y2_dev, N);
  EXPECT_EQ(run.scratch.used(), mark);
  const std::vector<float> y2 = test::DeviceScratch::download(y2_dev, size_t(N * d));
  EXPECT_LE(test::rel_rms(y2.data(), y_gpu.data(), y2.size()), 1e-6);

  // cuBLAS' grouped GEMMs (the decoder's middle batches; a plan with host offsets): the same
  // routing, expert outputs within bf16 roundings of the default path's.
  run.scratch.reset();
  float* y3_dev = io.zeros<float>(size_t(N * d));
  cuda::moe_layer_forward_gpu(run, dw, mw, x_dev, y3_dev, N, nullptr,
                              cuda::MoeExpertsPath::GroupedCublas);
  EXPECT_EQ(run.scratch.used(), mark);
  const std::vector<float> y3 = test::DeviceScratch::download(y3_dev, size_t(N * d));
  EXPECT_TRUE(test::all_finite(y3));
  EXPECT_LE(test::rel_rms(y3.data(), y_gpu.data(), y3.size()), 5e-3);
  EXPECT_LE(test::rel_rms(y3.data(), y_cpu.data(), y_cpu.size()), 1e-2);
}

TEST(CudaMoeLayer, MatchesCpuN200) {
  DM_SKIP_WITHOUT_GPU();
  for (const Variant& v : variants()) check_variant(v, 200);
}

TEST(CudaMoeLayer, MatchesCpuN1000) {
  DM_SKIP_WITHOUT_GPU();
  for (const Variant& v : variants()) check_variant(v, 1000);
}

// The latent up-projection and the shared experts' down-projection as two products adding into
// y (DM_MOE_ONE_OUTPUT_PRODUCT=0; the default makes them one product over [bf16(u') | h]).
TEST(CudaMoeLayer, TwoOutputProductsMatchCpu) {
  DM_SKIP_WITHOUT_GPU();
  const test::ScopedEnv env("DM_MOE_ONE_OUTPUT_PRODUCT", "0");
  for (const Variant& v : variants()) check_variant(v, 200);
}

TEST(CudaMoeLayer, EmptyBatchAndBytes) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig cfg = base_config();
  auto w = weights_allocate<float>(cfg);
  prepare_weights(*w, first_moe_layer(cfg), 5);
  cuda::DeviceWeights dw(*w);
  // The byte count grows with N (sizing run.scratch for the largest batch covers smaller ones).
  EXPECT_LE(cuda::moe_layer_forward_gpu_bytes(cfg, 100), cuda::moe_layer_forward_gpu_bytes(cfg, 1000));
  cuda::GpuRun run(cuda::moe_layer_forward_gpu_bytes(cfg, 0));
  cuda::MoeRoutingDevice routing;
  const MoeWeights& mw = w->layers[size_t(first_moe_layer(cfg))].moe;
  cuda::moe_layer_forward_gpu(run, dw, mw, static_cast<const uint16_t*>(nullptr), nullptr, 0,
                              &routing);
  cuda::synchronize();
  EXPECT_NE(routing.idx, nullptr);
}

}  // namespace
}  // namespace dm
#else
TEST(CudaMoeLayer, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
