// model/plan.h (the capacity and cost arithmetic), `deltamoe plan`, and `deltamoe bench train` /
// `bench decode` (train/train_bench.h, infer/decode_bench.h). Each
// quantity is checked against an independent count over the weights layout or a closed form, and
// against the limits that pin its assumptions (one expert set at batch 1, every expert at a huge
// batch).
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "infer/decode.h"
#include "infer/page_pool.h"
#include "infer/prefix_cache.h"
#include "io/config.h"
#include "model/params.h"
#include "model/plan.h"
#include "model/weights.h"
#include "test_util.h"
#include "train/train_bench.h"

namespace dm {
namespace {

std::string config_path(const std::string& name) {
  return test::source_dir() + "/configs/" + name + ".json";
}

// Σ over the layout's entries of (matrices: 2 B, element-wise: 4 B) — every weight read once.
double all_weights_read_once(const ModelWeights& W) {
  double bytes = 0;
  for (const ParamEntry& e : W.params)
    bytes += double(e.numel()) * (param_init_is_matrix(e.init) ? 2 : 4);
  return bytes;
}

TEST(Plan, DecodeStepBytesLimits) {
  for (const char* name : {"test", "kimi_linear_48b"}) {
    SCOPED_TRACE(name);
    const ModelConfig c = load_config(config_path(name));
    const ReservedWeights layout(c);
    const ModelWeights& W = layout.get();
    const int64_t k = c.moe.top_k, E = c.moe.num_experts;
    const DecodeStepBytes one = decode_step_bytes(W, 1, 1000);
    EXPECT_EQ(one.experts_per_layer, double(k));  // batch 1 hits exactly its k experts
    // A batch far past the vocabulary and the expert count reads every weight once (the whole
    // embedding, every expert): the same bytes as a plain pass over the layout.
    const DecodeStepBytes huge = decode_step_bytes(W, int64_t(1) << 22, 1000);
    EXPECT_NEAR(huge.experts_per_layer, double(E), 1e-6 * double(E));
    EXPECT_NEAR(huge.weights, all_weights_read_once(W), 1e-6 * all_weights_read_once(W));
    // Between them the expected experts grow with the batch; the per-sequence parts scale
    // linearly with the batch, the latent reads with the context.
    double previous = 0;
    for (int64_t B : {1, 2, 8, 64, 512}) {
      const DecodeStepBytes b = decode_step_bytes(W, B, 1000);
      EXPECT_GT(b.experts_per_layer, previous);
      EXPECT_LE(b.experts_per_layer, double(E));
      previous = b.experts_per_layer;
      EXPECT_DOUBLE_EQ(b.kda, double(B) * one.kda);
      EXPECT_DOUBLE_EQ(b.cache, double(B) * one.cache);
    }
    const DecodeStepBytes longer = decode_step_bytes(W, 1, 2001);
    EXPECT_DOUBLE_EQ(longer.cache, 2.0 * one.cache);  // (context + 1) rows per MLA layer
    EXPECT_DOUBLE_EQ(one.cache, 1001.0 * latent_bytes_per_token(c));
    EXPECT_DOUBLE_EQ(one.kda, 2.0 * kda_state_bytes_per_sequence(c));  // read + write
  }
}

TEST(Plan, CacheTrainingStateAndFlops) {
  const ModelConfig c = load_config(config_path("kimi_linear_48b"));
  // Kimi-Linear-48B: 27 layers, MLA every fourth (7), kv_lora 512 + rope 64 in bf16; KDA 32
  // heads of 128 with fp32 states and three bf16 conv tails of 3 rows.
  int64_t mla = 0;
  for (MixerKind m : c.mixers) mla += m == MixerKind::MLA;
  EXPECT_DOUBLE_EQ(latent_bytes_per_token(c),
                   double(mla) * double(c.mla.kv_lora_rank + c.mla.qk_rope_dim) * 2);
  const int64_t H = c.kda.num_heads, K = c.kda.head_dim;
  EXPECT_DOUBLE_EQ(kda_state_bytes_per_sequence(c),
                   double(c.num_layers - mla) *
                       (double(H * K * K) * 4 + 3.0 * double((c.kda.conv_kernel - 1) * H * K) * 2));
  // The cache of S slots: S sequences' states and whole pages of latent rows (plus tables).
  const double one = decode_cache_bytes(c, 1, 64), many = decode_cache_bytes(c, 8, 64);
  EXPECT_GE(one, kda_state_bytes_per_sequence(c) + 64 * latent_bytes_per_token(c));
  EXPECT_NEAR(many - one, 7 * (kda_state_bytes_per_sequence(c) + 64 * latent_bytes_per_token(c)),
              7 * 64.0);

  // Training state: 2 B per parameter (+4 per element-wise one) of compute copy, 4 + 4 + 8 of
  // master, gradient and AdamW moments.
  const ReservedWeights layout(c);
  const ParamCount pc = count_params(c);
  const TrainStateBytes ts = train_state_bytes(layout.get());
  EXPECT_DOUBLE_EQ(ts.master, 4.0 * double(pc.total));
  EXPECT_DOUBLE_EQ(ts.grads, 4.0 * double(pc.total));
  EXPECT_DOUBLE_EQ(ts.optimizer, 8.0 * double(pc.total));
  EXPECT_GE(ts.weights, 2.0 * double(pc.total));
  EXPECT_LT(ts.weights, 2.001 * double(pc.total));  // element-wise parameters are few

  // FLOPs per token: 6 per active parameter, plus the MLA layers' causal attention, which grows
  // linearly with T: 3·2·2·(T/2)·H·(d_qk + d_v) per layer.
  const double f0 = train_flops_per_token(c, pc.active, 0);
  EXPECT_DOUBLE_EQ(f0, 6.0 * double(pc.active));
  const double per_t = 6.0 * double(c.mla.num_heads) *
                       double(c.mla.qk_nope_dim + c.mla.qk_rope_dim + c.mla.v_head_dim) *
                       double(mla);
  EXPECT_DOUBLE_EQ(train_flops_per_token(c, pc.active, 4096), f0 + 4096 * per_t);
}

TEST(PlanCli, JsonAndTable) {
  const auto js = test::run_cli("plan --json --batch 1,64 --context 4096 --config " +
                                config_path("kimi_linear_48b"));
  ASSERT_EQ(js.exit_code, 0) << js.output;
  const nlohmann::json j = nlohmann::json::parse(js.output);
  const ModelConfig c = load_config(config_path("kimi_linear_48b"));
  EXPECT_EQ(j["params"]["total"].get<int64_t>(), count_params(c).total);
  EXPECT_FALSE(j["training"]["fits_memory"].get<bool>());  // 0.9 TB of state on one 141 GiB
  ASSERT_EQ(j["serving"]["decode"].size(), 2u);
  const auto& b1 = j["serving"]["decode"][0];
  EXPECT_EQ(b1["experts_per_moe_layer"].get<double>(), double(c.moe.top_k));
  // floor = bytes / bandwidth: 4.8 TB/s by default.
  EXPECT_NEAR(b1["floor_ms"].get<double>(), b1["bytes_per_step"].get<double>() / 4.8e12 * 1e3,
              1e-9);
  EXPECT_GT(j["serving"]["max_batch"].get<int64_t>(), 64);  // 98 GB of weights, ~0.1 GB a slot
  // Prefix cache entries: what the caches themselves divide their budgets by.
  LatentPagePool pool;
  const size_t gpu_page = size_t(kGpuPrefixGridTokens) * size_t(latent_bytes_per_token(c));
  const PrefixCache gpu_index(c, pool, kGpuPrefixGridTokens, gpu_page, 1, kGpuPrefixGridTokens);
  const PrefixCache cpu_index(c, pool, 64, DecodeState::page_bytes(c, 64), 1, 64);
  const auto& pc = j["serving"]["prefix_cache"];
  EXPECT_EQ(pc["cuda"]["grid_tokens"].get<int64_t>(), kGpuPrefixGridTokens);
  EXPECT_EQ(pc["cuda"]["entry_bytes"].get<double>(), double(gpu_index.entry_bytes()));
  EXPECT_EQ(pc["cpu"]["entry_bytes"].get<double>(), double(cpu_index.entry_bytes()));
  // Kimi-Linear-48B: 20 KDA layers of 32 heads × 128² fp32 states dominate (~42 MB).
  EXPECT_NEAR(pc["cuda"]["kda_checkpoint_bytes"].get<double>(),
              20.0 * (32 * 128 * 128 + 3 * 3 * 32 * 128) * 4, 1.0);
  EXPECT_EQ(pc["cuda"]["tokens_per_256_mib"].get<double>(),
            512.0 * std::floor(double(256 << 20) / double(gpu_index.entry_bytes())));
  const auto table = test::run_cli("plan --config " + config_path("gpu_1b"));
  EXPECT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("the state fits the device's memory"), std::string::npos)
      << table.output;
  EXPECT_NE(table.output.find("HBM floor"), std::string::npos) << table.output;
  // Bad input: a clear error, nonzero exit.
  const auto bad = test::run_cli("plan --batch 0 --config " + config_path("test"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--batch"), std::string::npos) << bad.output;
}

// `deltamoe bench train` on the CPU: a few steps of the test config, one JSON line whose
// throughput agrees with its own step time and FLOP count (also with --accum); the text form; a
// clear error for a GPU that is not there and for a sequence past the config's context.
TEST(BenchCli, TrainJsonTextAndErrors) {
  const std::string cfg = config_path("test");
  const auto js = test::run_cli("bench train --json --seq 32 --steps 2 --warmup 1 --config " + cfg);
  ASSERT_EQ(js.exit_code, 0) << js.output;
  const nlohmann::json j = nlohmann::json::parse(js.output);
  EXPECT_EQ(j["device"], "cpu");
  EXPECT_GT(j["tokens_per_s"].get<double>(), 0.0);
  EXPECT_NEAR(j["tokens_per_s"].get<double>(), 32.0 / (j["step_ms"].get<double>() * 1e-3),
              1e-6 * j["tokens_per_s"].get<double>());
  const ModelConfig c = load_config(cfg);
  EXPECT_NEAR(
      j["model_tflops"].get<double>(),
      train_flops_per_token(c, count_params(c).active, 32) * j["tokens_per_s"].get<double>() / 1e12,
      1e-6 * j["model_tflops"].get<double>());
  EXPECT_FALSE(j.contains("mfu"));  // no peak given on the CPU
  const double loss = j["loss"].get<double>();
  EXPECT_TRUE(std::isfinite(loss) && loss > 0) << loss;
  EXPECT_GT(j["optimizer_bytes"].get<double>(), 0.0);

  // --accum 3: three micro-batches per optimizer step, so three times the tokens per step.
  const auto accum =
      test::run_cli("bench train --json --seq 16 --accum 3 --steps 1 --warmup 0 --config " + cfg);
  ASSERT_EQ(accum.exit_code, 0) << accum.output;
  const nlohmann::json ja = nlohmann::json::parse(accum.output);
  EXPECT_EQ(ja["accum"], 3);
  EXPECT_NEAR(ja["tokens_per_s"].get<double>(), 48.0 / (ja["step_ms"].get<double>() * 1e-3),
              1e-6 * ja["tokens_per_s"].get<double>());
  EXPECT_LE(ja["forward_backward_ms"].get<double>(), ja["step_ms"].get<double>());

  const auto text = test::run_cli(
      "bench train --seq 16 --steps 1 --warmup 0 --peak-tflops 1 "
      "--config " +
      cfg);
  EXPECT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("tokens/s"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("MFU"), std::string::npos) << text.output;

  const auto too_long =
      test::run_cli("bench train --seq " + std::to_string(c.max_context + 1) + " --config " + cfg);
  EXPECT_NE(too_long.exit_code, 0);
  EXPECT_NE(too_long.output.find("context"), std::string::npos) << too_long.output;
}

// `deltamoe bench train --ab`: every value measured every round on one set-up, each value's
// median the middle of its own rounds (the larger of two); a malformed spec is refused before the
// model is built.
TEST(BenchCli, TrainAbMeasuresEveryValueEveryRound) {
  const std::string cfg = config_path("test");
  const auto js = test::run_cli(
      "bench train --json --seq 16 --steps 1 --warmup 0 --ab DM_BENCH_AB_PROBE=a,b,c --rounds 2 "
      "--config " +
      cfg);
  ASSERT_EQ(js.exit_code, 0) << js.output;
  const nlohmann::json j = nlohmann::json::parse(js.output);
  EXPECT_EQ(j["ab"], "DM_BENCH_AB_PROBE");
  EXPECT_EQ(j["values"], nlohmann::json::array({"a", "b", "c"}));
  ASSERT_EQ(j["step_ms"].size(), 3u);
  for (size_t v = 0; v < 3; ++v) {
    const std::vector<double> ms = j["step_ms"][v].get<std::vector<double>>();
    ASSERT_EQ(ms.size(), 2u);
    EXPECT_GT(ms[0], 0.0);
    EXPECT_EQ(j["median_step_ms"][v].get<double>(), std::max(ms[0], ms[1]));
  }
  const auto text = test::run_cli(
      "bench train --seq 16 --steps 1 --warmup 0 --ab DM_BENCH_AB_PROBE=x --rounds 1 --config " +
      cfg);
  EXPECT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("DM_BENCH_AB_PROBE=x: median step"), std::string::npos) << text.output;
  const auto bad = test::run_cli("bench train --ab =x --config " + cfg);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("NAME=v1"), std::string::npos) << bad.output;
}

// `deltamoe bench decode` on the CPU: random prompts into every slot, then timed steps; the
// floor fields appear once a bandwidth is given and agree with model/plan.h.
TEST(BenchCli, DecodeJsonAndErrors) {
  const std::string cfg = config_path("test");
  const auto js = test::run_cli(
      "bench decode --json --batch 2 --context 40 --steps 3 "
      "--bandwidth-tbs 1 --config " +
      cfg);
  ASSERT_EQ(js.exit_code, 0) << js.output;
  const nlohmann::json j = nlohmann::json::parse(js.output);
  EXPECT_EQ(j["batch"].get<int64_t>(), 2);
  EXPECT_NEAR(j["tokens_per_s"].get<double>(), 2.0 / (j["step_ms"].get<double>() * 1e-3),
              1e-6 * j["tokens_per_s"].get<double>());
  EXPECT_GT(j["prefill_tokens_per_s"].get<double>(), 0.0);
  const ModelConfig c = load_config(cfg);
  const ReservedWeights layout(c);
  const double bytes = decode_step_bytes(layout.get(), 2, 40).total();
  EXPECT_DOUBLE_EQ(j["bytes_per_step"].get<double>(), bytes);
  EXPECT_NEAR(j["floor_ms"].get<double>(), bytes / 1e12 * 1e3, 1e-12);
  EXPECT_NEAR(j["ratio_to_floor"].get<double>(),
              j["step_ms"].get<double>() / j["floor_ms"].get<double>(), 1e-9);
  const auto neither = test::run_cli("bench decode --batch 1");
  EXPECT_NE(neither.exit_code, 0);
  EXPECT_NE(neither.output.find("exactly one of --model"), std::string::npos) << neither.output;
  const auto too_long =
      test::run_cli("bench decode --context " + std::to_string(c.max_context) + " --config " + cfg);
  EXPECT_NE(too_long.exit_code, 0);
  EXPECT_NE(too_long.output.find("context"), std::string::npos) << too_long.output;
}

// `deltamoe env` names the threads, the BLAS kernels and what the GPU backend found (a reason
// when there is no device, as on CI).
TEST(EnvCli, PrintsThreadsBlasAndGpu) {
  const auto r = test::run_cli("env");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("threads:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("BLAS kernels:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("CUDA backend:"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace dm
