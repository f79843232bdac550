// The whole model forward on the GPU (model/cuda/model_gpu.h) against the CPU model: random
// weights of configs/test.json (rounded to bf16 on the host, so both sides see the same model),
// with and without packed documents, and the public reference goldens (../shared/goldens) within
// bf16 tolerance plus greedy continuations. Skips without a GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "cuda_golden_util.h"
#include "cuda_test_util.h"
#include "io/config.h"
#include "model/cuda/model_gpu.h"
#include "model/model.h"
#include "ops/cuda/device.h"
#include "test_util.h"

using namespace dm;

namespace {

// Share of rows whose argmax agrees. A row also agrees when b's logit at a's argmax is within
// 3% of the row's RMS logit of b's maximum: a near-tie that bf16 noise (logits rel RMS ~1e-2)
// may flip either way. Random-weight models have many such rows; a real disagreement (a wrong
// token by more than the noise) still counts against.
double argmax_agreement(const std::vector<float>& a, const std::vector<float>& b, int64_t V) {
  const int64_t rows = int64_t(a.size()) / V;
  int64_t same = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = a.data() + r * V;
    const float* y = b.data() + r * V;
    const int64_t ax = std::max_element(x, x + V) - x, ay = std::max_element(y, y + V) - y;
    double sum_sq = 0.0;
    for (int64_t i = 0; i < V; ++i) sum_sq += double(y[i]) * y[i];
    const double tie_margin = 0.03 * std::sqrt(sum_sq / double(V));
    same += ax == ay || double(y[ay]) - double(y[ax]) <= tie_margin;
  }
  return double(same) / double(rows);
}

void compare_on_random_model(const ModelConfig& c, int64_t B, int64_t T, bool packed,
                             const char* what) {
  auto W = weights_allocate<float>(c);
  weights_init(*W, 11);
  test::round_weights_to_bf16(*W);
  std::mt19937_64 rng(5);
  std::vector<int64_t> ids(size_t(B * T));
  for (auto& t : ids) t = int64_t(rng() % uint64_t(c.vocab_size));
  std::vector<int32_t> doc(size_t(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) doc[size_t(b * T + t)] = int32_t(packed && t >= T / 3 ? T / 3 : 0);
  const int64_t V = c.vocab_size;
  std::vector<float> cpu(size_t(B * T * V)), gpu(cpu.size());
  cuda::GpuModel g(*W);
  Model m(std::move(W));
  m.forward(ids.data(), B, T, cpu.data(), nullptr, {}, packed ? doc.data() : nullptr);
  g.forward(ids.data(), B, T, gpu.data(), packed ? doc.data() : nullptr);
  ASSERT_TRUE(test::all_finite(gpu)) << what;
  const double e = dm::test::rel_rms(gpu.data(), cpu.data(), cpu.size());
  const double agree = argmax_agreement(gpu, cpu, V);
  std::printf("[          ] %s B=%lld T=%lld: logits rel RMS %.2e, argmax agreement %.4f\n", what,
              (long long)B, (long long)T, e, agree);
  EXPECT_LE(e, 2e-2) << what;
  EXPECT_GE(agree, 0.97) << what;
}

}  // namespace

TEST(CudaModel, ForwardMatchesCpuOnTestConfig) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = load_config(dm::test::source_dir() + "/configs/test.json");
  compare_on_random_model(c, 2, 100, false, "test config");
  compare_on_random_model(c, 1, 300, true, "test config, packed");
}

TEST(CudaModel, ForwardMatchesCpuWithPlainResidual) {
  DM_SKIP_WITHOUT_GPU();
  ModelConfig c = load_config(dm::test::source_dir() + "/configs/test.json");
  c.residual = ResidualKind::Plain;
  c.attn_res_block = 0;
  compare_on_random_model(c, 2, 65, false, "plain residual");
}

TEST(CudaModel, RejectsOutOfRangeTokens) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = load_config(dm::test::source_dir() + "/configs/test.json");
  auto W = weights_allocate<float>(c);
  weights_init(*W, 1);
  cuda::GpuModel g(*W);
  std::vector<int64_t> ids = {1, 2, int64_t(c.vocab_size)};
  std::vector<float> logits(size_t(3 * c.vocab_size));
  EXPECT_THROW(g.forward(ids.data(), 1, 3, logits.data()), Error);
}

// Goldens: logits and teacher-forced greedy continuations (full re-forward on the GPU) about as
// close to the reference as the CPU model with bf16 weights gets (cuda_golden_util.h).
class CudaGoldens : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaGoldens, LogitsAndGreedyReproduce) {
  DM_SKIP_WITHOUT_GPU();
  if (!dm::test::goldens_available()) GTEST_SKIP() << "goldens not found";
  const std::string dir = dm::test::goldens_dir() + "/" + GetParam();
  auto model = Model::load(dir);
  const SafetensorsReader golden = SafetensorsReader::open(dir + "/golden.safetensors");
  const Tensor& ids = golden.get("input_ids");
  const int64_t B = ids.shape[0], T = ids.shape[1], V = model->config().vocab_size;
  cuda::GpuModel g(model->weights());
  std::vector<float> logits(size_t(B * T * V));
  g.forward(ids.as<int64_t>(), B, T, logits.data());
  const std::vector<float> ref = dm::test::to_f32(golden.get("logits"));
  const double e = dm::test::rel_rms(logits.data(), ref.data(), ref.size());
  const double agree = argmax_agreement(logits, ref, V);
  const dm::test::Bf16GoldenReference cpu = dm::test::bf16_golden_reference(dir);
  std::printf("[          ] %s on the GPU: logits rel RMS %.2e, argmax agreement %.4f (CPU with bf16 "
              "weights: %.2e, %.4f)\n", GetParam(), e, agree, cpu.logits_rel_rms, cpu.argmax_agreement);
  // bf16 activations add to what bf16 weights alone do (deepseek_v3_tiny: 3.0e-2 against 4.0e-3).
  EXPECT_LE(e, std::max(5e-2, 1.5 * cpu.logits_rel_rms));
  EXPECT_GE(agree, std::min(0.97, cpu.argmax_agreement - 0.1));
  const Tensor& prompt = golden.get("greedy_prompt");
  const Tensor& want = golden.get("greedy_output");
  const int64_t rows = prompt.shape[0], P = prompt.shape[1], O = want.shape[1];
  int64_t matched = 0, total = 0;
  for (int64_t b = 0; b < rows; ++b) {
    std::vector<int64_t> seq(prompt.as<int64_t>() + b * P, prompt.as<int64_t>() + (b + 1) * P);
    std::vector<float> z;
    for (int64_t s = P; s < O; ++s) {
      const int64_t L = int64_t(seq.size());
      z.resize(size_t(L * V));
      g.forward(seq.data(), 1, L, z.data());
      const float* last = z.data() + (L - 1) * V;
      const int64_t next = std::max_element(last, last + V) - last;
      const int64_t expected = want.as<int64_t>()[b * O + s];
      matched += next == expected;
      ++total;
      seq.push_back(expected);  // teacher-forced: one flip does not derail the rest
    }
  }
  std::printf("[          ] %s greedy (teacher-forced) tokens matched %lld / %lld (CPU with bf16 "
              "weights: %lld)\n", GetParam(), (long long)matched, (long long)total,
              (long long)cpu.greedy_matched);
  EXPECT_GE(double(matched), std::min(0.9 * double(total), double(cpu.greedy_matched) - 0.15 * double(total)));
}

INSTANTIATE_TEST_SUITE_P(All, CudaGoldens,
                         ::testing::Values("kimi_linear_tiny", "deepseek_v3_tiny", "kimi_k3_tiny"));

#else
TEST(CudaModel, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
