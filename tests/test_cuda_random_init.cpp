// Device-side random initialisation (DeviceWeights(host, RandomInit), ops/cuda/random_fill.h) and
// the benchmark-only GpuDecoder::fill_for_benchmark, on configs/test.json:
//   - every large matrix of the bf16 mirror has mean ≈ 0 and a std within 5% of the host
//     weights_init's (and of the rule's σ); the host matrices stay untouched (zero);
//   - the element-wise parameters equal the host values weights_init_elementwise wrote, in both
//     mirrors; Ones / Zeros equal weights_init's exactly; the random ones (conv kernels, A_log,
//     dt_bias) come from weights_init's distributions but their own generator, so they are
//     checked for range, not equality with weights_init;
//   - the same seed gives identical bytes twice (on a ReservedWeights and a weights_allocate
//     layout: the same offsets), another seed does not;
//   - a filled decoder steps with finite logits.
// Skips without a GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <vector>

#include "cuda_test_util.h"
#include "io/config.h"
#include "model/cuda/decode_gpu.h"
#include "model/cuda/gpu_run.h"
#include "ops/cuda/device.h"
#include "test_util.h"

using namespace dm;

namespace {

ModelConfig test_config() { return load_config(test::source_dir() + "/configs/test.json"); }

int64_t arena_end(const ModelWeights& w) {
  int64_t end = 0;
  for (const auto& e : w.params) end = std::max(end, w.offset_of(e.data) + e.numel());
  return end;
}

std::vector<uint16_t> download_bf16(const cuda::DeviceWeights& dw, const float* view, int64_t n) {
  std::vector<uint16_t> h(static_cast<size_t>(n));
  cuda::synchronize();
  cuda::copy_to_host(h.data(), dw.bf16(view), size_t(n) * sizeof(uint16_t));
  return h;
}

std::vector<float> download_f32(const cuda::DeviceWeights& dw, const float* view, int64_t n) {
  std::vector<float> h(static_cast<size_t>(n));
  cuda::synchronize();
  cuda::copy_to_host(h.data(), dw.f32(view), size_t(n) * sizeof(float));
  return h;
}

struct Moments {
  double mean = 0, std = 0;
};
template <typename F>
Moments moments(int64_t n, F value) {
  double s = 0, s2 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = value(i);
    s += v;
    s2 += v * v;
  }
  Moments m;
  m.mean = s / double(n);
  m.std = std::sqrt(std::max(0.0, s2 / double(n) - m.mean * m.mean));
  return m;
}

// A view and its length: single parameters, or a layer's stacked expert block of one projection.
struct Block {
  const char* what;
  const float* view;
  int64_t n;
  ParamInit init;
  Shape shape;
};

std::vector<Block> large_matrices(const ModelWeights& w) {
  std::vector<Block> out;
  for (const auto& e : w.params)
    if (param_init_is_matrix(e.init) && e.numel() >= 4096)
      out.push_back({e.name.c_str(), e.data, e.numel(), e.init, e.shape});
  const ModelConfig& c = w.cfg;
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.ffns[i] != FfnKind::MoE) continue;
    const MoeWeights& m = w.layers[size_t(i)].moe;
    const int64_t E = c.moe.num_experts, F = c.moe.expert_ffn;
    const int64_t l = c.moe.latent_dim ? c.moe.latent_dim : c.hidden;
    out.push_back({"expert_gate", m.expert_gate, E * F * l, ParamInit::Normal, Shape{F, l}});
    out.push_back({"expert_up", m.expert_up, E * F * l, ParamInit::Normal, Shape{F, l}});
    out.push_back({"expert_down", m.expert_down, E * F * l, ParamInit::NormalOut, Shape{l, F}});
  }
  return out;
}

}  // namespace

TEST(CudaRandomInit, MatricesMatchTheHostInitStatistics) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = test_config();
  auto ref = weights_allocate<float>(c);
  weights_init(*ref, 3);
  ReservedWeights reserved(c);
  ModelWeights& W = reserved.get();
  cuda::DeviceWeights dw(W, cuda::RandomInit{11});
  const std::vector<Block> ref_blocks = large_matrices(*ref), blocks = large_matrices(W);
  ASSERT_EQ(ref_blocks.size(), blocks.size());
  ASSERT_FALSE(blocks.empty());
  for (size_t b = 0; b < blocks.size(); ++b) {
    const Block& k = blocks[b];
    SCOPED_TRACE(k.what);
    const std::vector<uint16_t> dev = download_bf16(dw, k.view, k.n);
    const Moments d = moments(k.n, [&](int64_t i) { return double(cuda::bf16_to_float(dev[size_t(i)])); });
    const Moments h = moments(k.n, [&](int64_t i) { return double(ref_blocks[b].view[i]); });
    const double sigma = param_init_std(c, k.init, k.shape);
    EXPECT_LT(std::abs(d.mean), 5.0 * sigma / std::sqrt(double(k.n)));
    EXPECT_NEAR(d.std / sigma, 1.0, 0.05);
    if (k.n >= 8192) EXPECT_NEAR(d.std / h.std, 1.0, 0.05);  // two samples: ≥ 8192 each
    // The host matrix was never written (a ReservedWeights layout: still zero pages).
    EXPECT_TRUE(std::all_of(k.view, k.view + k.n, [](float v) { return v == 0.0f; }));
  }
}

TEST(CudaRandomInit, ElementwiseParametersFollowTheHostRules) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = test_config();
  auto ref = weights_allocate<float>(c);
  weights_init(*ref, 5);
  auto W = weights_allocate<float>(c);
  cuda::DeviceWeights dw(*W, cuda::RandomInit{5});
  const double dt_lo = 1e-3 + std::log(-std::expm1(-1e-3)), dt_hi = 0.1 + std::log(-std::expm1(-0.1));
  int checked = 0;
  for (size_t p = 0; p < W->params.size(); ++p) {
    const ParamEntry& e = W->params[p];
    if (param_init_is_matrix(e.init)) continue;
    SCOPED_TRACE(e.name);
    const int64_t n = e.numel();
    const std::vector<float> f = download_f32(dw, e.data, n);
    const std::vector<uint16_t> b = download_bf16(dw, e.data, n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(f[size_t(i)], e.data[i]) << i;
      ASSERT_EQ(b[size_t(i)], cuda::float_to_bf16(e.data[i])) << i;
      switch (e.init) {
        case ParamInit::Ones:
        case ParamInit::Zeros: ASSERT_EQ(e.data[i], ref->params[p].data[i]) << i; break;
        case ParamInit::KdaALog:
          ASSERT_TRUE(e.data[i] >= 0.0f && e.data[i] <= std::log(16.0f) + 1e-6f) << e.data[i];
          break;
        case ParamInit::KdaDtBias:
          ASSERT_TRUE(e.data[i] >= float(dt_lo) - 1e-5f && e.data[i] <= float(dt_hi) + 1e-5f)
              << e.data[i];
          break;
        case ParamInit::ConvNormal:
          ASSERT_TRUE(std::isfinite(e.data[i]) &&
                      std::abs(e.data[i]) < 7.0f * param_init_std(c, e.init, e.shape))
              << e.data[i];
          break;
        default: FAIL() << "unexpected init kind";
      }
    }
    ++checked;
  }
  EXPECT_GT(checked, 0);
  // Deterministic for a seed, and a function of the seed.
  auto again = weights_allocate<float>(c);
  weights_init_elementwise(*again, 5);
  for (size_t p = 0; p < W->params.size(); ++p)
    if (!param_init_is_matrix(W->params[p].init))
      ASSERT_TRUE(std::equal(W->params[p].data, W->params[p].data + W->params[p].numel(),
                             again->params[p].data))
          << W->params[p].name;
}

TEST(CudaRandomInit, SameSeedSameBytes) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = test_config();
  ReservedWeights a(c);
  auto b = weights_allocate<float>(c);
  auto other = weights_allocate<float>(c);
  // The reserved layout has the same offsets as an Arena one.
  ASSERT_EQ(a.get().params.size(), b->params.size());
  for (size_t p = 0; p < b->params.size(); ++p)
    ASSERT_EQ(a.get().offset_of(a.get().params[p].data), b->offset_of(b->params[p].data));
  cuda::DeviceWeights da(a.get(), cuda::RandomInit{42}), db(*b, cuda::RandomInit{42}),
      dother(*other, cuda::RandomInit{43});
  const int64_t n = arena_end(*b);
  const float* base_a = a.get().params.front().data;
  const float* base_b = b->params.front().data;
  const float* base_o = other->params.front().data;
  const std::vector<uint16_t> ma = download_bf16(da, base_a, n), mb = download_bf16(db, base_b, n),
                              mo = download_bf16(dother, base_o, n);
  EXPECT_TRUE(ma == mb);
  EXPECT_FALSE(ma == mo);
  for (size_t p = 0; p < b->params.size(); ++p) {
    const ParamEntry& e = b->params[p];
    if (param_init_is_matrix(e.init)) continue;
    EXPECT_TRUE(download_f32(da, a.get().params[p].data, e.numel()) ==
                download_f32(db, e.data, e.numel()))
        << e.name;
  }
}

TEST(CudaRandomInit, FilledDecoderSteps) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = test_config();
  auto W = weights_allocate<float>(c);
  cuda::DeviceWeights dw(*W, cuda::RandomInit{9});
  cuda::GpuDecoder dec(dw, 3, 300);
  dec.fill_for_benchmark(0, 130, 1);  // crosses two page boundaries
  dec.fill_for_benchmark(2, 5, 2);
  EXPECT_EQ(dec.length(0), 130);
  EXPECT_EQ(dec.length(1), 0);
  EXPECT_EQ(dec.length(2), 5);
  const int64_t V = c.vocab_size;
  std::vector<int32_t> tokens = {3, 7, 11};
  std::vector<float> logits(size_t(3 * V));
  for (int s = 0; s < 3; ++s) {
    dec.step(tokens.data(), logits.data());
    EXPECT_TRUE(test::all_finite(logits));
  }
  EXPECT_EQ(dec.length(0), 133);
  EXPECT_EQ(dec.length(1), 3);
  EXPECT_EQ(dec.length(2), 8);
  EXPECT_THROW(dec.fill_for_benchmark(0, 301, 1), Error);
}
#endif
