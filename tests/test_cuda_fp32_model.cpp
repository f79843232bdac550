// The fp32 GPU mode (model/cuda/model_gpu.h with WeightPrecision::F32) against the CPU float
// engine: the same random fp32 weights on both sides (not rounded to bf16), logits within 1e-5
// relative RMS over config variants that cover every layer branch (KDA gate kinds and output
// gate ranks, MLA with and without q LoRA, RoPE and the output gate, latent and plain MoE with
// and without shared experts, dense FFN, AttnRes and plain residuals, packed documents); greedy
// continuations token for token; and the public reference goldens (../shared/goldens) as the CPU
// reproduces them (logits within 1e-4 of the reference, greedy outputs identical). Skips without
// a GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cuda_test_util.h"
#include "infer/generate.h"
#include "io/config.h"
#include "model/cuda/generate_gpu.h"
#include "model/cuda/model_gpu.h"
#include "model/model.h"
#include "test_util.h"

using namespace dm;

namespace {

constexpr double kFp32Tolerance = 1e-5;  // issue: fp32 paths within 1e-5 relative RMS

ModelConfig test_config() { return load_config(dm::test::source_dir() + "/configs/test.json"); }

std::vector<int64_t> random_ids(const ModelConfig& c, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (auto& t : ids) t = int64_t(rng() % uint64_t(c.vocab_size));
  return ids;
}

// GPU fp32 logits against the CPU's for B sequences of T random tokens (packed: every row holds
// a second document from T/3 on).
void expect_fp32_forward_matches(const ModelConfig& c, int64_t B, int64_t T, bool packed,
                                 const char* what) {
  auto W = weights_allocate<float>(c);
  weights_init(*W, 23);
  const std::vector<int64_t> ids = random_ids(c, B * T, 7);
  std::vector<int32_t> doc(size_t(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) doc[size_t(b * T + t)] = int32_t(t >= T / 3 ? T / 3 : 0);
  const int64_t V = c.vocab_size;
  std::vector<float> cpu(size_t(B * T * V)), gpu(cpu.size());
  cuda::GpuModel g(*W, cuda::WeightPrecision::F32);
  Model m(std::move(W));
  m.forward(ids.data(), B, T, cpu.data(), nullptr, {}, packed ? doc.data() : nullptr);
  g.forward(ids.data(), B, T, gpu.data(), packed ? doc.data() : nullptr);
  ASSERT_TRUE(test::all_finite(gpu)) << what;
  const double e = test::rel_rms(gpu.data(), cpu.data(), cpu.size());
  std::printf("[          ] fp32 %s B=%lld T=%lld: logits rel RMS %.2e\n", what, (long long)B,
              (long long)T, e);
  EXPECT_LE(e, kFp32Tolerance) << what;
}

}  // namespace

TEST(CudaFp32Model, ForwardMatchesCpuOnTestConfig) {
  DM_SKIP_WITHOUT_GPU();
  // KDA safe gate + full-rank output gate, NoPE MLA with q LoRA and the output gate, latent MoE
  // with its norm and a shared expert, a dense first layer, Block AttnRes.
  const ModelConfig c = test_config();
  expect_fp32_forward_matches(c, 2, 100, false, "test config");
  expect_fp32_forward_matches(c, 1, 300, true, "test config, packed documents");
}

TEST(CudaFp32Model, ForwardMatchesCpuOnOtherBranches) {
  DM_SKIP_WITHOUT_GPU();
  // The other side of every switch: softplus gate, low-rank output gate, RoPE, no q LoRA, no
  // MLA output gate, plain MoE without shared experts, plain residual, SwiGLU.
  ModelConfig c = test_config();
  c.kda.gate = KdaGateKind::Softplus;
  c.kda.full_rank_output_gate = false;
  c.mla.use_rope = true;
  c.mla.q_lora_rank = 0;
  c.mla.output_gate = false;
  c.moe.latent_dim = 0;
  c.moe.latent_norm = false;
  c.moe.num_shared = 0;
  c.moe.shared_ffn = 0;
  c.residual = ResidualKind::Plain;
  c.attn_res_block = 0;
  c.activation = Activation::SwiGLU;
  expect_fp32_forward_matches(c, 2, 70, false, "other branches");
  expect_fp32_forward_matches(c, 2, 90, true, "other branches, packed documents");
}

TEST(CudaFp32Model, WeightsHaveNoBf16Copy) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = test_config();
  auto W = weights_allocate<float>(c);
  weights_init(*W, 3);
  cuda::DeviceWeights dw(*W, cuda::WeightPrecision::F32);
  EXPECT_EQ(dw.precision(), cuda::WeightPrecision::F32);
  EXPECT_THROW(dw.bf16(W->lm_head), Error);
  std::vector<float> back(size_t(c.hidden));
  cuda::copy_to_host(back.data(), dw.f32(W->lm_head), back.size() * sizeof(float));
  EXPECT_TRUE(std::equal(back.begin(), back.end(), W->lm_head));  // bit for bit
}

TEST(CudaFp32Model, RejectsOutOfRangeTokensAndLongContexts) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = test_config();
  auto W = weights_allocate<float>(c);
  weights_init(*W, 1);
  cuda::GpuModel g(*W, cuda::WeightPrecision::F32);
  std::vector<int64_t> ids = {1, 2, int64_t(c.vocab_size)};
  std::vector<float> logits(size_t(3 * c.vocab_size));
  EXPECT_THROW(g.forward(ids.data(), 1, 3, logits.data()), Error);
  std::vector<int64_t> too_long(size_t(c.max_context) + 1, 1);
  EXPECT_THROW(g.forward_last(too_long.data(), int64_t(too_long.size()), logits.data()), Error);
}

// "Greedy continuations match in fp32 mode": the CPU engine's generate() against the GPU's fp32
// generation, token for token, on random weights.
TEST(CudaFp32Model, GreedyContinuationMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = test_config();
  auto W = weights_allocate<float>(c);
  weights_init(*W, 31);
  cuda::GpuModel g(*W, cuda::WeightPrecision::F32);
  Model m(std::move(W));
  for (uint64_t seed : {1u, 2u, 3u}) {
    const std::vector<int64_t> ids = random_ids(c, 9, seed);
    const std::vector<int32_t> prompt(ids.begin(), ids.end());
    GenerateOptions go;
    go.max_new_tokens = 24;
    go.sampling.temperature = 0.0f;
    const std::vector<int32_t> cpu = generate(m, prompt, go);
    const std::vector<int32_t> gpu = cuda::generate_gpu_fp32(g, prompt, go);
    ASSERT_EQ(cpu.size(), size_t(24));
    EXPECT_EQ(gpu, cpu) << "prompt seed " << seed;
  }
}

// The reference goldens in the fp32 mode: the CPU's numbers (logits within 1e-5 of the CPU
// engine, 1e-4 of the reference as tests/test_goldens.cpp asks of the CPU) and the reference
// greedy continuations token for token (generate_gpu_fp32, not teacher-forced).
class CudaFp32Goldens : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaFp32Goldens, LogitsAndGreedyReproduce) {
  DM_SKIP_WITHOUT_GPU();
  if (!test::goldens_available()) GTEST_SKIP() << "goldens not found";
  const std::string dir = test::goldens_dir() + "/" + GetParam();
  auto model = Model::load(dir);
  const SafetensorsReader golden = SafetensorsReader::open(dir + "/golden.safetensors");
  const Tensor& ids = golden.get("input_ids");
  const int64_t B = ids.shape[0], T = ids.shape[1], V = model->config().vocab_size;
  cuda::GpuModel g(model->weights(), cuda::WeightPrecision::F32);
  std::vector<float> gpu(size_t(B * T * V)), cpu(gpu.size());
  g.forward(ids.as<int64_t>(), B, T, gpu.data());
  model->forward(ids.as<int64_t>(), B, T, cpu.data());
  const std::vector<float> ref = test::to_f32(golden.get("logits"));
  const double e_ref = test::rel_rms(gpu.data(), ref.data(), ref.size());
  const double e_cpu = test::rel_rms(gpu.data(), cpu.data(), cpu.size());
  std::printf(
      "[          ] %s fp32 on the GPU: logits rel RMS %.2e vs the reference, %.2e vs "
      "the CPU\n",
      GetParam(), e_ref, e_cpu);
  EXPECT_LE(e_ref, 1e-4);
  EXPECT_LE(e_cpu, kFp32Tolerance);

  const Tensor& prompt = golden.get("greedy_prompt");
  const Tensor& want = golden.get("greedy_output");
  const int64_t rows = prompt.shape[0], P = prompt.shape[1], O = want.shape[1];
  for (int64_t b = 0; b < rows; ++b) {
    const std::vector<int32_t> p(prompt.as<int64_t>() + b * P, prompt.as<int64_t>() + (b + 1) * P);
    GenerateOptions go;
    go.max_new_tokens = O - P;
    go.sampling.temperature = 0.0f;
    const std::vector<int32_t> got = cuda::generate_gpu_fp32(g, p, go);
    const std::vector<int32_t> expected(want.as<int64_t>() + b * O + P,
                                        want.as<int64_t>() + (b + 1) * O);
    EXPECT_EQ(got, expected) << GetParam() << " greedy row " << b;
  }

  // The CLI's fp32 mode is this path: `forward` writes the same logits, `generate` the same
  // continuation of the first greedy prompt.
  const std::string out = test::temp_dir("fp32_forward") + "/logits.safetensors";
  const test::CliResult f = test::run_cli("forward --model " + dir + " --input " + dir +
                                          "/golden.safetensors --output " + out +
                                          " --device cuda --precision fp32");
  ASSERT_EQ(f.exit_code, 0) << f.output;
  const std::vector<float> cli_logits =
      test::to_f32(SafetensorsReader::open(out).get("logits"));
  ASSERT_EQ(cli_logits.size(), gpu.size());
  EXPECT_LE(test::rel_rms(cli_logits.data(), gpu.data(), gpu.size()), 1e-6);
  std::string csv;
  for (int64_t i = 0; i < P; ++i) csv += (i ? "," : "") + std::to_string(prompt.as<int64_t>()[i]);
  const test::CliResult r = test::run_cli(
      "generate --model " + dir + " --prompt-ids " + csv + " --max-new-tokens " +
      std::to_string(O - P) + " --temperature 0 --json --device cuda --precision fp32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output.substr(r.output.rfind("{\"output_ids\"")));
  const std::vector<int64_t> cli_ids = j["output_ids"].get<std::vector<int64_t>>();
  EXPECT_EQ(cli_ids, std::vector<int64_t>(want.as<int64_t>() + P, want.as<int64_t>() + O))
      << r.output;
}

INSTANTIATE_TEST_SUITE_P(All, CudaFp32Goldens,
                         ::testing::Values("kimi_linear_tiny", "deepseek_v3_tiny", "kimi_k3_tiny"));

#else
TEST(CudaFp32Model, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
