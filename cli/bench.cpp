// `deltamoe bench train --config FILE [--device cpu|cuda] [--batch B] [--seq T] [--steps N]
// [--warmup W] [--recompute on|off] [--peak-tflops P] [--json]`: training-step throughput of a
// config (train/train_bench.h): tokens/s, model TFLOP/s and, given the device's peak, MFU; the
// optimizer state and the activations' peak. The component benchmarks (Google Benchmark) and the
// peers' side-by-side runs live in bench/ (docs/benchmarks.md).
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "command.h"
#include "io/config.h"
#include "model/params.h"
#include "train/train_bench.h"

namespace {

struct BenchTrainOptions {
  std::string config;
  dm::TrainBenchOptions bench;
  std::string recompute = "on";
  double peak_tflops = 0;  // 0: the device's default (989 for cuda: one H200), none on cpu
  bool json = false;
};

void run_bench_train(BenchTrainOptions& o) {
  const dm::ModelConfig cfg = dm::load_config(o.config);
  o.bench.recompute = o.recompute == "on";
  const double peak = o.peak_tflops > 0 ? o.peak_tflops : o.bench.device == "cuda" ? 989.0 : 0.0;
  const dm::TrainBenchResult r = dm::run_train_bench(cfg, o.bench);
  const double mfu = peak > 0 ? r.model_tflops() / peak : 0.0;
  if (o.json) {
    nlohmann::ordered_json js;
    js["impl"] = "deltamoe";
    js["device"] = o.bench.device;
    js["config"] = o.config;
    js["batch"] = o.bench.batch;
    js["seq"] = o.bench.seq;
    js["recompute"] = o.bench.recompute;
    js["step_ms"] = r.step_s * 1e3;
    js["forward_backward_ms"] = r.forward_backward_s * 1e3;
    js["tokens_per_s"] = r.tokens_per_s();
    js["model_tflops"] = r.model_tflops();
    if (peak > 0) {
      js["peak_tflops"] = peak;
      js["mfu"] = mfu;
    }
    js["loss"] = r.loss;
    js["optimizer_bytes"] = r.optimizer_bytes;
    js["activation_peak_bytes"] = r.activation_peak;
    std::printf("%s\n", js.dump().c_str());
    return;
  }
  std::printf("%s on %s: %s parameters, %s active; B=%lld T=%lld; recompute %s\n", o.config.c_str(),
              o.bench.device.c_str(), dm::format_param_count(r.params).c_str(),
              dm::format_param_count(r.active_params).c_str(), (long long)o.bench.batch,
              (long long)o.bench.seq, o.bench.recompute ? "on" : "off");
  std::printf("train step %.1f ms (forward+backward %.1f ms): %.0f tokens/s, %.2f model TFLOP/s",
              r.step_s * 1e3, r.forward_backward_s * 1e3, r.tokens_per_s(), r.model_tflops());
  if (peak > 0) std::printf(", MFU %.1f%% of %.0f", 100 * mfu, peak);
  auto size = [](size_t bytes) {
    char text[32];
    if (bytes >= 1000000000)
      std::snprintf(text, sizeof text, "%.2f GB", double(bytes) / 1e9);
    else
      std::snprintf(text, sizeof text, "%.1f MB", double(bytes) / 1e6);
    return std::string(text);
  };
  std::printf("\nloss %.3f; memory: optimizer state %s, activations peak %s\n", r.loss,
              size(r.optimizer_bytes).c_str(), size(r.activation_peak).c_str());
}

dm::cli::Registrar reg("bench", "Measure end-to-end throughput (bench train)", [](CLI::App* app) {
  app->require_subcommand(1);
  CLI::App* train = app->add_subcommand(
      "train", "Training steps on random tokens: tokens/s, model TFLOP/s, MFU, memory");
  auto opt = std::make_shared<BenchTrainOptions>();
  train->add_option("--config", opt->config, "config.json (or a checkpoint directory)")->required();
  train->add_option("--device", opt->bench.device, "cpu, or cuda (one GPU)")
      ->default_val("cpu")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  train->add_option("--batch", opt->bench.batch, "Sequences per step")
      ->default_val(1)
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  train->add_option("--seq", opt->bench.seq, "Tokens per sequence")
      ->default_val(256)
      ->check(CLI::Range(int64_t(2), int64_t(1) << 24));
  train->add_option("--steps", opt->bench.steps, "Timed steps (the median is reported)")
      ->default_val(5)
      ->check(CLI::Range(1, 1 << 20));
  train->add_option("--warmup", opt->bench.warmup, "Untimed steps first")
      ->default_val(2)
      ->check(CLI::Range(0, 1 << 20));
  train
      ->add_option("--recompute", opt->recompute,
                   "on: keep only each layer's input for the backward; off: keep the KDA and MoE "
                   "internals (faster, more memory)")
      ->default_val("on")
      ->check(CLI::IsMember({"on", "off"}));
  train
      ->add_option("--peak-tflops", opt->peak_tflops,
                   "Dense bf16 peak for MFU (default 989 on cuda: one H200; none on cpu)")
      ->default_val(0.0)
      ->check(CLI::Range(0.0, 1e7));
  train->add_flag("--json", opt->json, "print one JSON line instead of text");
  train->callback([opt] { run_bench_train(*opt); });
});

}  // namespace
