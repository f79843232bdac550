// The training loop (SPEC §2): progressive-context stages, packed documents, gradient
// accumulation, warmup + cosine LR, global-norm clipping, spike / non-finite guard, Quantile
// Balancing of every MoE layer, metrics.jsonl, atomic checkpoints and bit-exact resume.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "train/optimizer.h"

namespace dm {

// One progressive-context stage: sequence length, token budget, LR multiplier (lowered at each
// transition), the fraction of rows replayed from the previous stage's data, and optionally its
// own rows per micro-batch (batch ramps; QB's per-step balance improves as ~1/√tokens-per-step).
struct TrainStage {
  int64_t seq_len = 256;
  int64_t tokens = 0;
  float lr_mult = 1.0f;
  double replay = 0.0;
  int64_t batch = 0;  // 0 = the run's batch
};

struct TrainerConfig {
  std::string model;            // config.json (fresh init) or a checkpoint folder (fine-tune)
  std::string data = "builtin"; // "builtin" or a folder of shards from `deltamoe data`
  std::string out;              // output folder
  bool resume = false;
  int64_t steps = 0;            // schedule length in steps (0 = when the stage budgets run out)
  int64_t stop_after = 0;       // end this run (with a checkpoint) at this step; 0 = at the end
  int64_t batch = 8;            // rows per micro-batch
  int64_t accum = 1;            // micro-batches per step
  float lr = 3e-3f, min_lr_ratio = 0.1f;
  int64_t warmup = 30;
  OptimizerConfig optimizer;
  float clip = 1.0f;            // global-norm clip (0 = off)
  float spike_factor = 3.0f;    // skip a step whose loss exceeds this × the running loss (0 = off)
  std::vector<TrainStage> stages;
  std::string balance = "qb";   // qb | qb-hist | sign | none
  float sign_rate = 1e-3f;
  double balance_ema = 0.0;     // QB: EMA of the per-expert quantiles across steps (0 = off)
  int balance_refine = 8;       // QB: fixed-point refinements of the bias on the batch (0 = one-shot)
  int balance_window = 1;       // QB: steps pooled into each estimate (1 = this step only)
  // QB updates on background threads as each layer's routing completes (same results): −1 = with
  // the GPU engine only (its host thread waits on the device), 0 = never, 1 = always.
  int balance_background = -1;
  bool recompute = true;
  std::string device = "cpu";   // cpu | cuda (train/train_engine.h)
  int kda_chunk = 64;
  int64_t checkpoint_every = 0; // steps (0 = only at the end)
  int64_t eval_every = 50;      // recall evaluation (builtin data)
  int64_t eval_tasks = 32;
  // Held-out rows of the stage's data mix on which MaxVio_global (summed loads, current bias) is
  // measured at every evaluation (0 = off).
  int64_t eval_balance_rows = 32;
  // MaxVio of the loads summed over consecutive steps until they hold this many tokens, logged
  // as maxvio_window when a window completes (0 = off). A step of N tokens has a counting floor:
  // even a perfect bias leaves max-over-layers MaxVio ≈ 0.21 at N = 1K tokens (k = 2, E = 16,
  // 7 layers), 0.05 at 16K (docs/training.md); the window shows the balance above that floor.
  int64_t maxvio_window_tokens = 16384;
  uint64_t seed = 0;
  // Builtin data: share of rows that are recall tasks (stratified per batch), pairs and queries
  // per task, and the span of one task as a fraction of the stage's sequence length (the
  // recall distance grows with it).
  double recall_fraction = 0.25;
  int recall_pairs = 2, recall_queries = 2;
  double recall_span = 0.25;
  bool progress = true;         // progress bar on stderr
};

// Parses a training config JSON (all fields optional except those the CLI sets); errors name the
// field and file.
TrainerConfig trainer_config_from_json(const std::string& json_text, const std::string& origin);

struct TrainSummary {
  int64_t steps = 0, tokens = 0, skipped = 0;
  double first_loss = 0, last_loss = 0;    // mean over the first / last 10 steps
  double unigram_entropy = 0;              // of the training data (nats/token; builtin data)
  double recall_acc = -1, recall_chance = 0;
  double last_maxvio = 0;                  // per-batch MaxVio of the last step (max over layers)
  double last_maxvio_global = -1;          // on held-out rows at the last evaluation (−1 = none)
  double last_maxvio_window = -1;          // of the last completed token window (−1 = none)
  int64_t first_window_step_below = -1;    // first step whose window MaxVio < 0.1 (−1 = none)
  double tokens_per_s = 0;
  size_t peak_activation_bytes = 0, weights_bytes = 0, optimizer_bytes = 0;
};

// Runs training; writes OUT/metrics.jsonl, OUT/checkpoint/, OUT/tokenizer.json (builtin data).
TrainSummary train(const TrainerConfig& cfg);

}  // namespace dm
