// Training end to end through the CLI: bit-exact resume, loss going down, metrics and plots,
// and bad training input rejected cleanly.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io/safetensors.h"
#include "test_util.h"
#if DELTAMOE_HAVE_CUDA
#include "ops/cuda/device.h"
#endif

using namespace dm;

namespace {
std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
std::vector<nlohmann::json> metrics(const std::string& dir) {
  std::vector<nlohmann::json> v;
  std::ifstream in(dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) v.push_back(nlohmann::json::parse(line));
  return v;
}
const std::string kArgs = " --batch 2 --stages 48:600,96:600:0.5:0.2 --warmup 2 --quiet --seed 3 ";
}  // namespace

TEST(Train, ResumeIsBitExact) {
  const std::string cfg = test::source_dir() + "/configs/test.json";
  const std::string a = test::temp_dir("train_a"), b = test::temp_dir("train_b");
  // A QB pooling window of 3 steps (the kept scores travel in the checkpoint) and MaxVio windows
  // of 300 tokens (~3 steps; the open window's loads travel in trainer_state.json).
  std::filesystem::create_directories(a);
  std::ofstream(a + "/tc.json") << R"({"maxvio_window_tokens": 300})";
  const std::string kArgs = ::kArgs + "--balance-window 3 --train-config " + a + "/tc.json ";
  auto r = test::run_cli("train --config " + cfg + " --out " + a + kArgs);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ma = metrics(a);
  ASSERT_GE(ma.size(), 8u);
  // Same schedule, interrupted inside the first stage, then resumed across the stage change.
  r = test::run_cli("train --config " + cfg + " --out " + b + kArgs + "--stop-after 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(metrics(b).size(), 3u);
  EXPECT_TRUE(std::filesystem::exists(b + "/checkpoint/balance_window.safetensors"));
  r = test::run_cli("train --config " + cfg + " --out " + b + kArgs + "--resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto mb = metrics(b);
  ASSERT_EQ(mb.size(), ma.size());
  int windows = 0;
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_EQ(ma[i]["loss"], mb[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(ma[i].value("maxvio_window", -1.0), mb[i].value("maxvio_window", -1.0)) << "step " << i + 1;
    windows += ma[i].contains("maxvio_window");
  }
  EXPECT_GE(windows, 2);
  EXPECT_EQ(slurp(a + "/checkpoint/model.safetensors"), slurp(b + "/checkpoint/model.safetensors"));
  EXPECT_EQ(slurp(a + "/checkpoint/optimizer.safetensors"), slurp(b + "/checkpoint/optimizer.safetensors"));
  // Every step logs the required fields; the second stage runs at its own length.
  for (const auto& m : ma)
    for (const char* f : {"step", "loss", "lr", "grad_norm", "tokens_per_s", "maxvio"})
      EXPECT_TRUE(m.contains(f)) << f;
  EXPECT_EQ(ma.back()["seq_len"], 96);
  // The plot renders.
  r = test::run_cli("plot " + a);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(slurp(a + "/metrics.svg").find("<polyline"), std::string::npos);
}

// QB updates computed on background threads as each layer's routing completes give the same
// biases and metrics as the synchronous ones, with two micro-batches per step (the update waits
// for the second) and a pooling window (the layer state travels through the copy).
TEST(Train, BackgroundBalanceMatchesSynchronous) {
  const std::string cfg = test::source_dir() + "/configs/test.json";
  std::string out[2];
  for (int background = 0; background < 2; ++background) {
    out[background] = test::temp_dir(background ? "train_bg1" : "train_bg0");
    std::filesystem::create_directories(out[background]);
    std::ofstream(out[background] + "/tc.json")
        << "{\"balance_background\": " << background << "}";
    auto r = test::run_cli("train --config " + cfg + " --out " + out[background] + kArgs +
                           "--accum 2 --balance-window 2 --stop-after 4 --train-config " +
                           out[background] + "/tc.json");
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  const auto m0 = metrics(out[0]), m1 = metrics(out[1]);
  ASSERT_EQ(m0.size(), 4u);
  ASSERT_EQ(m1.size(), m0.size());
  for (size_t i = 0; i < m0.size(); ++i) {
    EXPECT_EQ(m0[i]["loss"], m1[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(m0[i]["maxvio"], m1[i]["maxvio"]) << "step " << i + 1;
  }
  EXPECT_EQ(slurp(out[0] + "/checkpoint/model.safetensors"),
            slurp(out[1] + "/checkpoint/model.safetensors"));
  // And the updates did something: without balancing the checkpoint differs (its biases stay 0).
  const std::string none = test::temp_dir("train_bg_none");
  auto r = test::run_cli("train --config " + cfg + " --out " + none + kArgs +
                         "--accum 2 --balance none --stop-after 4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(slurp(none + "/checkpoint/model.safetensors"),
            slurp(out[1] + "/checkpoint/model.safetensors"));
}

TEST(Train, LossFallsAndGenerateRuns) {
  const std::string cfg = test::source_dir() + "/configs/test.json";
  const std::string out = test::temp_dir("train_c");
  auto r = test::run_cli("train --config " + cfg + " --out " + out +
                         " --batch 4 --stages 64:16K --lr 3e-3 --warmup 5 --quiet");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto m = metrics(out);
  double first = 0, last = 0;
  for (size_t i = 0; i < 5; ++i) first += m[i]["loss"].get<double>() / 5;
  for (size_t i = m.size() - 5; i < m.size(); ++i) last += m[i]["loss"].get<double>() / 5;
  EXPECT_LT(last, first - 1.0) << "loss " << first << " -> " << last;
  r = test::run_cli("generate --model " + out + "/checkpoint --prompt 'the' --max-new-tokens 8");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = test::run_cli("generate --model " + out + "/checkpoint --prompt-ids 1,2,3 --max-new-tokens 4 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["output_ids"].size(), 4u);
}

TEST(Train, BadTrainingInputFailsCleanly) {
  const std::string cfg = test::source_dir() + "/configs/test.json";
  const std::string out = test::temp_dir("train_bad");
  auto r = test::run_cli("train --config " + cfg + " --out " + out + " --stages 48:x --quiet");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("--stages"), std::string::npos) << r.output;
  r = test::run_cli("train --config " + cfg + " --out " + out + " --resume --quiet");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("checkpoint"), std::string::npos) << r.output;
  std::ofstream(out + "/t.json") << R"({"batch": 2, "bogus": 1})";
  r = test::run_cli("train --config " + cfg + " --out " + out + " --train-config " + out + "/t.json --quiet");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("bogus"), std::string::npos) << r.output;
  r = test::run_cli("train --config " + cfg + " --out " + out + " --data /nonexistent/shards --quiet");
  EXPECT_EQ(r.exit_code, 1) << r.output;
}

// --device cuda where there is no GPU (CI: nvcc but no device; or a build without the backend):
// one clear line, exit 1, nothing trained. Skipped where a GPU answers.
TEST(Train, DeviceCudaWithoutAGpuFailsCleanly) {
#if DELTAMOE_HAVE_CUDA
  if (cuda::device_available()) GTEST_SKIP() << "a GPU is present: tests/test_cuda_train.cpp";
#endif
  const std::string cfg = test::source_dir() + "/configs/test.json";
  const std::string out = test::temp_dir("train_nogpu");
  auto r = test::run_cli("train --config " + cfg + " --out " + out + kArgs + "--device cuda");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("--device cuda"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(out + "/checkpoint")) << r.output;
  std::ofstream(out + "/t.json") << R"({"device": "tpu"})";
  r = test::run_cli("train --config " + cfg + " --out " + out + " --train-config " + out + "/t.json --quiet");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("device"), std::string::npos) << r.output;
}

TEST(Train, OnShardsFromTheDataCommand) {
  const std::string shards = test::temp_dir("shards"), out = test::temp_dir("train_sh");
  auto r = test::run_cli("data --synthetic-english 200 --out " + shards + " --vocab-size 500 --overwrite --quiet");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = test::run_cli("train --config " + test::source_dir() + "/configs/test.json --data " + shards +
                    " --out " + out + " --batch 2 --stages 64:2K --quiet");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(metrics(out).size(), 16u);
  r = test::run_cli("generate --model " + out + "/checkpoint --prompt 'Anna' --max-new-tokens 4");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}
