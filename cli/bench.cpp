// End-to-end throughput from the CLI. The component benchmarks (Google Benchmark) and the peers'
// side-by-side runs live in bench/ (docs/benchmarks.md).
//   deltamoe bench train --config FILE [--device cpu|cuda] [--batch B] [--seq T] [--steps N]
//       [--warmup W] [--recompute on|off] [--peak-tflops P] [--ab NAME=v1,v2 [--rounds R]] [--json]
//     training-step throughput (train/train_bench.h): tokens/s, model TFLOP/s and, given the
//     device's peak, MFU; the optimizer state and the activations' peak. --ab: after one set-up,
//     R rounds of every value of an environment switch the kernels read at each call, and each
//     value's median step.
//   deltamoe bench decode (--model DIR | --config FILE) [--device cpu|cuda] [--batch B]
//       [--context L] [--steps N] [--warmup W] [--bandwidth-tbs BW] [--json]
//     cached decode (infer/decode_bench.h): prefill tokens/s, ms per batched step, tokens/s, and
//     against the step's HBM floor (model/plan.h) given the device's bandwidth.
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "command.h"
#include "core/error.h"
#include "infer/decode_bench.h"
#include "io/config.h"
#include "model/model.h"
#include "model/params.h"
#include "model/plan.h"
#include "model/weights.h"
#include "train/train_bench.h"

namespace {

// The first fields of every bench JSON line (scripts/device-summary.py reads "impl").
nlohmann::ordered_json result_json(const std::string& device) {
  nlohmann::ordered_json js;
  js["impl"] = "deltamoe";
  js["device"] = device;
  return js;
}

struct BenchTrainOptions {
  std::string config;
  dm::TrainBenchOptions bench;
  std::string recompute = "on";
  double peak_tflops = 0;  // 0: the device's default (989 for cuda: one H200), none on cpu
  std::string ab;          // NAME=v1,v2,…: an A/B of an environment switch
  int rounds = 2;
  bool json = false;
};

void run_bench_train_ab(const dm::ModelConfig& cfg, const BenchTrainOptions& o) {
  dm::TrainBenchAb ab = dm::parse_train_bench_ab(o.ab);  // before the set-up: fail fast
  dm::TrainBench bench(cfg, o.bench);
  dm::run_train_bench_ab(
      bench, ab, o.rounds, [&](int round, size_t v, const dm::TrainBenchResult& r) {
        if (o.json) return;
        std::printf("round %d %s=%s: step %.2f ms, %.0f tokens/s\n", round, ab.name.c_str(),
                    ab.values[v].c_str(), r.step_s * 1e3, r.tokens_per_s());
        std::fflush(stdout);
      });
  if (o.json) {
    nlohmann::ordered_json js = result_json(o.bench.device);
    js["config"] = o.config;
    js["ab"] = ab.name;
    js["values"] = ab.values;
    js["step_ms"] = ab.step_ms;
    std::vector<double> medians;
    for (size_t v = 0; v < ab.values.size(); ++v) medians.push_back(ab.median_ms(v));
    js["median_step_ms"] = medians;
    std::printf("%s\n", js.dump().c_str());
    return;
  }
  for (size_t v = 0; v < ab.values.size(); ++v)
    std::printf("%s=%s: median step %.2f ms over %d rounds\n", ab.name.c_str(),
                ab.values[v].c_str(), ab.median_ms(v), o.rounds);
}

void run_bench_train(BenchTrainOptions& o) {
  const dm::ModelConfig cfg = dm::load_config(o.config);
  o.bench.recompute = o.recompute == "on";
  if (!o.ab.empty()) return run_bench_train_ab(cfg, o);
  const double peak = o.peak_tflops > 0 ? o.peak_tflops : o.bench.device == "cuda" ? 989.0 : 0.0;
  const dm::TrainBenchResult r = dm::run_train_bench(cfg, o.bench);
  const double mfu = peak > 0 ? r.model_tflops() / peak : 0.0;
  if (o.json) {
    nlohmann::ordered_json js = result_json(o.bench.device);
    js["config"] = o.config;
    js["batch"] = o.bench.batch;
    js["accum"] = o.bench.accum;
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
  std::printf("%s on %s: %s parameters, %s active; B=%lld T=%lld accum=%lld; recompute %s\n",
              o.config.c_str(), o.bench.device.c_str(), dm::format_param_count(r.params).c_str(),
              dm::format_param_count(r.active_params).c_str(), (long long)o.bench.batch,
              (long long)o.bench.seq, (long long)o.bench.accum, o.bench.recompute ? "on" : "off");
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

struct BenchDecodeOptions {
  std::string model_dir, config;
  dm::DecodeBenchOptions bench;
  double bandwidth_tbs = 0;  // 0: the device's default (4.8 for cuda: one H200), none on cpu
  bool json = false;
};

void run_bench_decode(const BenchDecodeOptions& o) {
  DM_CHECK(o.model_dir.empty() != o.config.empty(),
           "bench decode: give exactly one of --model DIR and --config FILE");
  std::unique_ptr<dm::Model> model;
  if (!o.model_dir.empty()) {
    model = dm::Model::load(o.model_dir);
  } else {
    auto w = dm::weights_allocate<float>(dm::load_config(o.config));
    dm::weights_init(*w, o.bench.seed);
    model = std::make_unique<dm::Model>(std::move(w));
  }
  const double bw = o.bandwidth_tbs > 0 ? o.bandwidth_tbs : o.bench.device == "cuda" ? 4.8 : 0.0;
  const dm::DecodeBenchResult r = dm::run_decode_bench(*model, o.bench);
  const dm::DecodeStepBytes sb =
      dm::decode_step_bytes(model->weights(), o.bench.batch, o.bench.context);
  const double floor_s = bw > 0 ? sb.total() / (bw * 1e12) : 0.0;
  if (o.json) {
    nlohmann::ordered_json js = result_json(o.bench.device);
    js["batch"] = r.batch;
    js["context"] = r.context;
    js["prefill_tokens_per_s"] = r.prefill_tokens_per_s();
    js["step_ms"] = r.step_s * 1e3;
    js["tokens_per_s"] = r.tokens_per_s();
    js["bytes_per_step"] = sb.total();
    if (bw > 0) {
      js["bandwidth_tbs"] = bw;
      js["floor_ms"] = floor_s * 1e3;
      js["ratio_to_floor"] = r.step_s / floor_s;
    }
    std::printf("%s\n", js.dump().c_str());
    return;
  }
  std::printf("%s on %s: batch %lld at %lld tokens of context\n",
              o.model_dir.empty() ? o.config.c_str() : o.model_dir.c_str(), o.bench.device.c_str(),
              (long long)r.batch, (long long)r.context);
  std::printf("prefill %.0f tokens/s; decode %.3f ms per step, %.0f tokens/s",
              r.prefill_tokens_per_s(), r.step_s * 1e3, r.tokens_per_s());
  if (bw > 0)
    std::printf("; %.2f GB per step, floor %.3f ms at %.3g TB/s (%.2fx)", sb.total() / 1e9,
                floor_s * 1e3, bw, r.step_s / floor_s);
  std::printf("\n");
}

// The options both subcommands take: where they run, how many steps are timed after how many
// untimed ones, and JSON output.
void add_run_options(CLI::App* app, std::string* device, int* steps, int default_steps,
                     int* warmup, bool* json) {
  app->add_option("--device", *device, "cpu, or cuda (one GPU)")
      ->default_val("cpu")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app->add_option("--steps", *steps, "Timed steps (the median is reported)")
      ->default_val(default_steps)
      ->check(CLI::Range(1, 1 << 20));
  app->add_option("--warmup", *warmup, "Untimed steps first")
      ->default_val(2)
      ->check(CLI::Range(0, 1 << 20));
  app->add_flag("--json", *json, "print one JSON line instead of text");
}

dm::cli::Registrar reg(
    "bench", "Measure end-to-end throughput (bench train, bench decode)", [](CLI::App* app) {
      app->require_subcommand(1);
      CLI::App* train = app->add_subcommand(
          "train",
          "Training steps on random tokens, each timed from its start to the next one's as train "
          "runs them: tokens/s, model TFLOP/s, MFU, memory");
      auto opt = std::make_shared<BenchTrainOptions>();
      train->add_option("--config", opt->config, "config.json (or a checkpoint directory)")
          ->required();
      train->add_option("--batch", opt->bench.batch, "Sequences per micro-batch")
          ->default_val(1)
          ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
      train
          ->add_option("--accum", opt->bench.accum,
                       "Micro-batches per optimizer step (gradients accumulated, as train --accum)")
          ->default_val(1)
          ->check(CLI::Range(int64_t(1), int64_t(1) << 16));
      train->add_option("--seq", opt->bench.seq, "Tokens per sequence")
          ->default_val(256)
          ->check(CLI::Range(int64_t(2), int64_t(1) << 24));
      add_run_options(train, &opt->bench.device, &opt->bench.steps, 5, &opt->bench.warmup, &opt->json);
      train
          ->add_option(
              "--recompute", opt->recompute,
              "on: keep only each layer's input for the backward; off: keep the KDA, MLA and "
              "MoE internals (faster, more memory)")
          ->default_val("on")
          ->check(CLI::IsMember({"on", "off"}));
      train
          ->add_option("--peak-tflops", opt->peak_tflops,
                       "Dense bf16 peak for MFU (default 989 on cuda: one H200; none on cpu)")
          ->default_val(0.0)
          ->check(CLI::Range(0.0, 1e7));
      train->add_option("--ab", opt->ab,
                        "NAME=v1,v2,...: after one set-up, time each value of an environment "
                        "switch read at each call (docs/gpu.md), --rounds times, and report "
                        "each value's median step");
      train->add_option("--rounds", opt->rounds, "Rounds of --ab")
          ->default_val(2)
          ->check(CLI::Range(1, 1000));
      train->callback([opt] { run_bench_train(*opt); });

      CLI::App* decode = app->add_subcommand(
          "decode", "Cached decode after random prompts: prefill tokens/s, ms per step, HBM floor");
      auto dopt = std::make_shared<BenchDecodeOptions>();
      decode->add_option("--model", dopt->model_dir, "Checkpoint directory");
      decode->add_option("--config", dopt->config, "config.json (random weights)");
      decode->add_option("--batch", dopt->bench.batch, "Sequences decoded together")
          ->default_val(1)
          ->check(CLI::Range(int64_t(1), int64_t(1) << 16));
      decode->add_option("--context", dopt->bench.context, "Prompt tokens each sequence holds")
          ->default_val(512)
          ->check(CLI::Range(int64_t(1), int64_t(1) << 30));
      add_run_options(decode, &dopt->bench.device, &dopt->bench.steps, 16, &dopt->bench.warmup,
                      &dopt->json);
      decode
          ->add_option("--bandwidth-tbs", dopt->bandwidth_tbs,
                       "Memory bandwidth for the HBM floor, which counts bf16 weights as on the "
                       "GPU (default 4.8 on cuda: one H200; none on cpu)")
          ->default_val(0.0)
          ->check(CLI::Range(0.0, 1e4));
      decode->callback([dopt] { run_bench_decode(*dopt); });
    });

}  // namespace
