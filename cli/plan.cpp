// `deltamoe plan --config FILE [--context T] [--batch B,…] [--train-seq T] [--memory-gib G]
// [--bandwidth-tbs BW] [--peak-tflops P] [--mfu F] [--json]`: what training and serving a config on
// one device take (model/plan.h): memory of the training state and of the serving cache, model
// FLOPs per training token, and the HBM floor of a decode step. Arithmetic only: nothing is
// allocated but address space for the weights layout.
#include "model/plan.h"

#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "command.h"
#include "core/error.h"
#include "infer/decode.h"
#include "infer/prefix_cache.h"
#include "io/config.h"
#include "model/params.h"
#include "model/weights.h"
#if DELTAMOE_HAVE_CUDA
#include "model/cuda/model_train_gpu.h"
#include "ops/cuda/device.h"
#endif

namespace {

struct PlanOptions {
  std::string config;
  std::string batches = "1,64";
  int64_t context = 32768;
  int64_t train_seq = 4096;
  int64_t train_batch = 1;
  double memory_gib = 141.0;   // one H200
  double bandwidth_tbs = 4.8;  // its HBM3e, peak
  double peak_tflops = 989.0;  // its dense bf16 tensor-core peak
  double mfu = 0.4;
  bool json = false;
};

std::vector<int64_t> parse_batches(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    DM_CHECK(!item.empty() && *end == '\0' && v >= 1 && v <= (1ll << 24),
             "--batch: expected positive integers separated by commas, got '", s, "'");
    out.push_back(v);
  }
  DM_CHECK(!out.empty(), "--batch: no batch size given");
  return out;
}

double gb(double bytes) { return bytes / 1e9; }

void run_plan(const PlanOptions& o) {
  const dm::ModelConfig cfg = dm::load_config(o.config);
  DM_CHECK(o.context >= 1 && o.train_seq >= 1, "plan: --context and --train-seq must be ≥ 1");
  DM_CHECK(
      o.memory_gib > 0 && o.bandwidth_tbs > 0 && o.peak_tflops > 0 && o.mfu > 0 && o.mfu <= 1,
      "plan: --memory-gib, --bandwidth-tbs and --peak-tflops must be positive, --mfu in (0, 1]");
  const std::vector<int64_t> batches = parse_batches(o.batches);
  const dm::ParamCount pc = dm::count_params(cfg);
  const dm::ReservedWeights layout(cfg);
  const dm::ModelWeights& W = layout.get();
  const double memory = o.memory_gib * double(1ull << 30);

  const dm::TrainStateBytes ts = dm::train_state_bytes(W);
  const double flops = dm::train_flops_per_token(cfg, pc.active, o.train_seq);
  const double train_tokens_per_s = o.mfu * o.peak_tflops * 1e12 / flops;

  // Serving: bf16 weights (+ fp32 element-wise copies) and the cache at the context.
  const double weights = ts.weights;
  const double per_sequence = dm::decode_cache_bytes(cfg, 1, o.context);
  const double free_for_cache = memory - weights;
  const int64_t max_batch = free_for_cache > 0 ? int64_t(free_for_cache / per_sequence) : 0;

  nlohmann::ordered_json js;
  js["config"] = o.config;
  js["params"] = {{"total", pc.total}, {"active", pc.active}};
  // Activations of one GPU's training step: the engine's own byte counts, in CUDA builds on a
  // machine with a GPU (cub sizes its sort scratch through the device).
  double act_recompute = 0, act_kept = 0;
#if DELTAMOE_HAVE_CUDA
  if (dm::cuda::device_available()) {
    act_recompute =
        double(dm::cuda::train_activation_plan_bytes(cfg, o.train_batch, o.train_seq, true));
    act_kept =
        double(dm::cuda::train_activation_plan_bytes(cfg, o.train_batch, o.train_seq, false));
  }
#endif
  js["training"] = {{"state_bytes",
                     {{"weights", ts.weights},
                      {"master", ts.master},
                      {"grads", ts.grads},
                      {"adamw", ts.optimizer},
                      {"total", ts.total()}}},
                    {"fits_memory", ts.total() <= memory},
                    {"batch", o.train_batch},
                    {"seq_len", o.train_seq},
                    {"flops_per_token", flops},
                    {"tokens_per_s_at_mfu", train_tokens_per_s},
                    {"mfu", o.mfu}};
  nlohmann::ordered_json decode = nlohmann::ordered_json::array();
  for (int64_t B : batches) {
    const dm::DecodeStepBytes sb = dm::decode_step_bytes(W, B, o.context);
    const double floor_s = sb.total() / (o.bandwidth_tbs * 1e12);
    decode.push_back({{"batch", B},
                      {"bytes_per_step", sb.total()},
                      {"weights", sb.weights},
                      {"experts_per_moe_layer", sb.experts_per_layer},
                      {"kda_state", sb.kda},
                      {"latent_cache", sb.cache},
                      {"floor_ms", floor_s * 1e3},
                      {"tokens_per_s_ceiling", double(B) / floor_s},
                      {"fits_memory", weights + double(B) * per_sequence <= memory}});
  }
  if (act_recompute > 0)
    js["training"]["activation_bytes"] = {{"recompute_on", act_recompute},
                                          {"recompute_off", act_kept}};
  // Prefix cache entries: one per cached grid point of a prompt (infer/prefix_cache.h). CPU:
  // a 64-token grid whose pages are the decode state's fp32 latent pages; GPU: a 512-token grid,
  // bf16 latent rows on the device and the KDA checkpoint in host memory.
  nlohmann::ordered_json prefix;
  const double latent_bf16 = dm::latent_bytes_per_token(cfg);
  const struct {
    const char* device;
    int64_t grid;
    double page_bytes;
  } caches[] = {{"cpu", 64, double(dm::DecodeState::page_bytes(cfg, 64))},
                {"cuda", dm::kGpuPrefixGridTokens, double(dm::kGpuPrefixGridTokens) * latent_bf16}};
  for (const auto& pc_dev : caches) {
    const double entry = double(
        dm::PrefixCache::entry_bytes_for(cfg, pc_dev.grid, size_t(pc_dev.page_bytes), pc_dev.grid));
    prefix[pc_dev.device] = {
        {"grid_tokens", pc_dev.grid},
        {"entry_bytes", entry},
        {"kda_checkpoint_bytes", double(dm::PrefixCache::kda_checkpoint_bytes(cfg))},
        {"latent_bytes", pc_dev.page_bytes},
        {"tokens_per_256_mib", double(pc_dev.grid) * std::floor(double(256ull << 20) / entry)}};
  }
  js["serving"] = {{"context", o.context},
                   {"weights_bytes", weights},
                   {"cache_bytes_per_sequence", per_sequence},
                   {"max_batch", max_batch},
                   {"decode", decode},
                   {"prefix_cache", prefix}};
  js["device"] = {{"memory_gib", o.memory_gib},
                  {"bandwidth_tbs", o.bandwidth_tbs},
                  {"peak_tflops", o.peak_tflops}};
  if (o.json) {
    std::printf("%s\n", js.dump(2).c_str());
    return;
  }

  std::printf("%s: %s parameters, %s active per token\n", o.config.c_str(),
              dm::format_param_count(pc.total).c_str(), dm::format_param_count(pc.active).c_str());
  std::printf("device: %.0f GiB, %.1f TB/s, %.0f TFLOP/s dense bf16\n\n", o.memory_gib,
              o.bandwidth_tbs, o.peak_tflops);
  std::printf("training on one device (bf16 compute, fp32 master, AdamW)\n");
  std::printf("  state %8.1f GB = weights %.1f + master %.1f + grads %.1f + AdamW moments %.1f\n",
              gb(ts.total()), gb(ts.weights), gb(ts.master), gb(ts.grads), gb(ts.optimizer));
  if (ts.total() <= memory)
    std::printf("  the state fits the device's memory\n");
  else
    std::printf("  does not fit: %.1fx the device's memory\n", ts.total() / memory);
  if (act_recompute == 0) {
    std::printf("  activations: not counted (they need a CUDA build on a machine with a GPU)\n");
  } else {
    std::printf(
        "  activations of a %lld x %lld step on the GPU: %.1f GB with recompute (total "
        "%.1f GB), %.1f GB without (total %.1f GB)\n",
        (long long)o.train_batch, (long long)o.train_seq, gb(act_recompute),
        gb(ts.total() + act_recompute), gb(act_kept), gb(ts.total() + act_kept));
  }
  std::printf("  %.2f GFLOP per token at T = %lld -> %.0f tokens/s at %.0f%% MFU\n\n", flops / 1e9,
              (long long)o.train_seq, train_tokens_per_s, 100 * o.mfu);
  std::printf("serving at %lld tokens of context (bf16 weights)\n", (long long)o.context);
  std::printf(
      "  weights %.1f GB; cache %.3f GB per sequence (KDA state %.1f MB + %.0f B of latent "
      "rows per token)\n",
      gb(weights), gb(per_sequence), dm::kda_state_bytes_per_sequence(cfg) / 1e6,
      dm::latent_bytes_per_token(cfg));
  if (weights > memory)
    std::printf(
        "  the weights alone need %.1fx the device's memory (one device only: no "
        "multi-device serving yet)\n",
        weights / memory);
  else
    std::printf("  largest batch in memory: %lld\n", (long long)max_batch);
  for (const char* device : {"cpu", "cuda"}) {
    const auto& p = prefix[device];
    std::printf(
        "  prefix cache (%s): %.1f MB per cached %lld-token prefix point (KDA checkpoint %.1f MB, "
        "latent rows %.1f MB); 256 MiB holds %.0f tokens of prefixes\n",
        device, p["entry_bytes"].get<double>() / 1e6, (long long)p["grid_tokens"].get<int64_t>(),
        p["kda_checkpoint_bytes"].get<double>() / 1e6, p["latent_bytes"].get<double>() / 1e6,
        p["tokens_per_256_mib"].get<double>());
  }
  std::printf("  decode step at the HBM floor (bytes it must move / bandwidth):\n");
  std::printf("  %6s %10s %14s %10s %12s\n", "batch", "GB/step", "experts/layer", "floor ms",
              "tokens/s");
  for (const auto& d : decode)
    std::printf("  %6lld %10.2f %14.1f %10.3f %12.0f%s\n", (long long)d["batch"].get<int64_t>(),
                gb(d["bytes_per_step"].get<double>()), d["experts_per_moe_layer"].get<double>(),
                d["floor_ms"].get<double>(), d["tokens_per_s_ceiling"].get<double>(),
                d["fits_memory"].get<bool>() ? "" : "  (cache does not fit)");
}

dm::cli::Registrar reg(
    "plan", "Memory, FLOPs and the HBM floor of training and serving a config on one device",
    [](CLI::App* app) {
      auto opt = std::make_shared<PlanOptions>();
      app->add_option("--config", opt->config, "config.json (or a checkpoint directory)")
          ->required();
      app->add_option("--context", opt->context, "Serving context length in tokens")
          ->default_val(32768);
      app->add_option("--batch", opt->batches, "Decode batch sizes, comma-separated")
          ->default_val("1,64");
      app->add_option("--train-seq", opt->train_seq, "Training sequence length")->default_val(4096);
      app->add_option("--train-batch", opt->train_batch,
                      "Sequences per training step (the activations scale with it)")
          ->default_val(1)
          ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
      app->add_option("--memory-gib", opt->memory_gib, "Device memory (default: one H200)")
          ->default_val(141.0);
      app->add_option("--bandwidth-tbs", opt->bandwidth_tbs, "Device memory bandwidth, TB/s")
          ->default_val(4.8);
      app->add_option("--peak-tflops", opt->peak_tflops, "Dense bf16 peak, TFLOP/s")
          ->default_val(989.0);
      app->add_option("--mfu", opt->mfu, "Model FLOPs utilisation for the training estimate")
          ->default_val(0.4);
      app->add_flag("--json", opt->json, "print JSON instead of tables");
      app->callback([opt] { run_plan(*opt); });
    });

}  // namespace
