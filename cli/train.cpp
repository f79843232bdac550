// `deltamoe train`: train a model from scratch (or continue one) on built-in or sharded data.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "command.h"
#include "core/error.h"
#include "train/trainer.h"

namespace {

// "T:tokens[:lr_mult[:replay[:batch]]],..." → stages; tokens accept K/M suffixes.
std::vector<dm::TrainStage> parse_stages(const std::string& spec) {
  std::vector<dm::TrainStage> out;
  std::stringstream ss(spec);
  std::string item;
  auto count = [&](const std::string& s) {
    DM_CHECK(!s.empty(), "--stages: empty number in '", spec, "'");
    double mult = 1;
    std::string num = s;
    if (s.back() == 'K' || s.back() == 'k') mult = 1e3, num.pop_back();
    else if (s.back() == 'M' || s.back() == 'm') mult = 1e6, num.pop_back();
    try {
      return std::stod(num) * mult;
    } catch (const std::exception&) {
      throw dm::Error(dm::str_cat("--stages: '", s, "' is not a number"));
    }
  };
  while (std::getline(ss, item, ',')) {
    std::vector<std::string> f;
    std::stringstream is(item);
    std::string x;
    while (std::getline(is, x, ':')) f.push_back(x);
    DM_CHECK(f.size() >= 2 && f.size() <= 5, "--stages: '", item,
             "' must be T:tokens[:lr_mult[:replay[:batch]]]");
    dm::TrainStage s;
    s.seq_len = int64_t(count(f[0]));
    s.tokens = int64_t(count(f[1]));
    if (f.size() > 2) s.lr_mult = float(count(f[2]));
    if (f.size() > 3) s.replay = count(f[3]);
    if (f.size() > 4) s.batch = int64_t(count(f[4]));
    DM_CHECK(s.seq_len > 0 && s.tokens > 0 && s.lr_mult > 0 && s.replay >= 0 && s.replay < 1 && s.batch >= 0,
             "--stages: bad values in '", item, "'");
    out.push_back(s);
  }
  return out;
}

dm::cli::Registrar reg("train", "Train a model (progressive context, QB balancing, checkpoints)", [](CLI::App* app) {
  static std::string model, data = "builtin", out, train_config, stages, optimizer, balance, device;
  static int64_t stop_after = 0;
  static int64_t steps = 0, batch = 0, accum = 0, ckpt_every = -1, warmup = -1;
  static float lr = 0;
  static double balance_ema = -1;
  static int balance_refine = -1, balance_window = -1;
  static bool resume = false, no_recompute = false, quiet = false;
  static uint64_t seed = 0;
  app->add_option("--config", model, "Model config.json, or a checkpoint folder to continue from")->required();
  app->add_option("--data", data, "'builtin' (synthetic English + recall tasks) or a shard folder from `deltamoe data`");
  app->add_option("--out", out, "Output folder (metrics.jsonl, checkpoint/, tokenizer.json)")->required();
  app->add_option("--train-config", train_config, "Training JSON (batch, lr, stages, optimizer, ...)");
  app->add_option("--steps", steps, "Stop after N steps (default: when the stage token budgets are used)");
  app->add_option("--stop-after", stop_after, "End this run at step N with a checkpoint (resume later with --resume)");
  app->add_option("--batch", batch, "Rows per micro-batch");
  app->add_option("--accum", accum, "Micro-batches per optimizer step");
  app->add_option("--lr", lr, "Peak learning rate");
  app->add_option("--warmup", warmup, "Warmup steps");
  app->add_option("--stages", stages, "Progressive context: T:tokens[:lr_mult[:replay[:batch]]],... e.g. 128:150K,512:150K:0.5:0.1:16");
  app->add_option("--optimizer", optimizer, "adamw or muon")->check(CLI::IsMember({"adamw", "muon"}));
  app->add_option("--balance", balance, "qb, qb-hist, sign or none")->check(CLI::IsMember({"qb", "qb-hist", "sign", "none"}));
  app->add_option("--balance-ema", balance_ema, "QB: EMA of the expert quantiles across steps, in [0,1) (0 = off)")
      ->check(CLI::Range(0.0, 0.999));
  app->add_option("--balance-refine", balance_refine,
                  "QB: fixed-point refinements of the bias on each batch (0 = the one-shot rule; default 8)")
      ->check(CLI::Range(0, 64));
  app->add_option("--balance-window", balance_window,
                  "QB: pool the routing scores of the last W steps into each estimate (default 1 = this step)")
      ->check(CLI::Range(1, 64));
  app->add_option("--checkpoint-every", ckpt_every, "Checkpoint every N steps (always at the end)");
  app->add_option("--seed", seed, "Seed (init, data order)");
  app->add_flag("--resume", resume, "Continue from OUT/checkpoint (bit-exact)");
  app->add_flag(
      "--no-recompute", no_recompute,
      "Keep every layer's activations instead of recomputing them (--device cuda: the KDA, "
      "MLA and MoE layers' internals; more memory, ~15% faster on the 1B config)");
  app->add_option("--device", device, "cpu or cuda (forward, backward and optimizer on one GPU; QB and evaluations stay on the host)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app->add_flag("--quiet", quiet, "No progress bar");
  app->callback([] {
    dm::TrainerConfig c;
    if (!train_config.empty()) {
      std::ifstream in(train_config);
      DM_CHECK(in.good(), train_config, ": cannot open");
      std::stringstream s;
      s << in.rdbuf();
      c = dm::trainer_config_from_json(s.str(), train_config);
    }
    c.model = model;
    c.data = data;
    c.out = out;
    c.resume = resume;
    if (steps) c.steps = steps;
    if (stop_after) c.stop_after = stop_after;
    if (batch) c.batch = batch;
    if (accum) c.accum = accum;
    if (lr > 0) c.lr = lr;
    if (warmup >= 0) c.warmup = warmup;
    if (!stages.empty()) c.stages = parse_stages(stages);
    if (!optimizer.empty()) c.optimizer.kind = optimizer == "muon" ? dm::OptimizerKind::Muon : dm::OptimizerKind::AdamW;
    if (!balance.empty()) c.balance = balance;
    if (ckpt_every >= 0) c.checkpoint_every = ckpt_every;
    if (balance_ema >= 0) c.balance_ema = balance_ema;
    if (balance_refine >= 0) c.balance_refine = balance_refine;
    if (balance_window >= 0) c.balance_window = balance_window;
    if (seed) c.seed = seed;
    if (no_recompute) c.recompute = false;
    if (!device.empty()) c.device = device;
    c.progress = !quiet;
    const dm::TrainSummary s = dm::train(c);
    std::printf("trained %lld steps, %lld tokens (%lld skipped) at %.0f tokens/s\n", (long long)s.steps,
                (long long)s.tokens, (long long)s.skipped, s.tokens_per_s);
    std::printf("loss %.3f -> %.3f nats/token", s.first_loss, s.last_loss);
    if (s.unigram_entropy > 0) std::printf(" (unigram entropy of the data %.3f)", s.unigram_entropy);
    std::printf("\n");
    if (s.recall_acc >= 0)
      std::printf("recall accuracy at the last stage's distance: %.3f (chance %.3f)\n", s.recall_acc, s.recall_chance);
    std::printf("MaxVio: last batch %.3f", s.last_maxvio);
    if (s.last_maxvio_global >= 0) std::printf(", held-out (global) %.3f", s.last_maxvio_global);
    if (s.last_maxvio_window >= 0) {
      std::printf(", last token window %.3f", s.last_maxvio_window);
      if (s.first_window_step_below > 0)
        std::printf(" (first window below 0.1 at step %lld)", (long long)s.first_window_step_below);
    }
    std::printf("; memory: weights %.1f MB, optimizer %.1f MB, activations peak %.1f MB\n",
                s.weights_bytes / 1e6, s.optimizer_bytes / 1e6, s.peak_activation_bytes / 1e6);
    std::printf("metrics: %s/metrics.jsonl, checkpoint: %s/checkpoint (plot: deltamoe plot %s)\n",
                out.c_str(), out.c_str(), out.c_str());
  });
});

}  // namespace
