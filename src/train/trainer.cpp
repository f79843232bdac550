#include "train/trainer.h"

#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <chrono>
#include <numeric>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "data/builtin.h"
#include "data/sampler.h"
#include "data/shard.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "io/tokenizer.h"
#include "model/model.h"
#include "train/balance.h"
#include "train/train_engine.h"

namespace dm {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// ---- training data ---------------------------------------------------------------------------

struct StageData {
  std::vector<SamplerSource> sources;  // the stage's mixture (weights already applied)
  bool has_recall = false;
  RecallTaskOptions recall;
};

struct TrainData {
  std::vector<StageData> stages;
  double unigram_entropy = 0;
};

// Recall tasks spanning `span` of the stage's sequence length (each row packs several), ids in a
// reserved top range.
RecallTaskOptions recall_options_for(const TrainerConfig& tc, int64_t vocab, int64_t seq_len,
                                     uint64_t seed) {
  RecallTaskOptions o;
  o.vocab_size = vocab;
  // Small alphabets and every pair queried: many answer tokens per document, so a small model
  // learns the lookup within a few hundred steps (chance = 1/num_values).
  o.num_keys = 16;
  o.num_values = 16;
  o.num_filler = 64;
  o.num_pairs = tc.recall_pairs;
  o.num_queries = tc.recall_queries;
  o.token_base = int32_t(vocab - (4 + o.num_keys + o.num_values + o.num_filler));
  o.seed = seed;
  o.filler_length = 0;
  const int64_t overhead = recall_task_length(o);
  o.filler_length = std::max<int64_t>(8, int64_t(tc.recall_span * double(seq_len)) - overhead);
  return o;
}

TrainData build_builtin_data(const TrainerConfig& tc, const ModelConfig& mc,
                             const std::vector<TrainStage>& stages) {
  std::vector<int64_t> stage_seq;
  for (const TrainStage& st : stages) stage_seq.push_back(st.seq_len);
  TrainData td;
  const std::string tok_path = tc.out + "/tokenizer.json";
  SyntheticEnglishOptions so;
  so.num_documents = 4000;
  so.seed = tc.seed;
  const std::vector<std::string> corpus = synthetic_english_corpus(so);
  Tokenizer tok;
  if (fs::exists(tok_path)) {
    tok = Tokenizer::load(tok_path);
  } else {
    // Leave the top of the vocabulary to the recall tasks' reserved ids.
    const int64_t tok_vocab = std::min<int64_t>(mc.vocab_size - 160, 4096);
    DM_CHECK(tok_vocab >= 300, "builtin data needs a model vocabulary of at least 460 tokens");
    tok = Tokenizer::train(corpus, tok_vocab);
    tok.save(tok_path);
  }
  DM_CHECK(tok.vocab_size() <= mc.vocab_size, tok_path, ": tokenizer has ", tok.vocab_size(),
           " tokens, more than the model's vocabulary ", mc.vocab_size);
  std::vector<std::vector<int32_t>> english;
  english.reserve(corpus.size());
  std::vector<int32_t> all;
  const int32_t eot = tok.special_id("<|endoftext|>");
  for (const std::string& doc : corpus) {
    english.push_back(tok.encode(doc));
    english.back().push_back(eot);
    all.insert(all.end(), english.back().begin(), english.back().end());
  }
  td.unigram_entropy = unigram_entropy_nats(all);
  const double english_tokens = double(all.size());
  // Text and each stage's recall tasks are separate sources, mixed per batch in fixed shares
  // (data/sampler.h): stage s = text (1 − r), its own tasks r·(1 − replay), stage s−1's tasks
  // r·replay. A steady mix keeps the expert loads that QB predicts steady from step to step.
  auto text = TokenDataset::from_documents(english, mc.vocab_size, "builtin text");
  std::vector<std::shared_ptr<const TokenDataset>> recall_data;
  const double r = tc.recall_fraction;
  for (size_t s = 0; s < stage_seq.size(); ++s) {
    StageData sd;
    sd.sources.push_back({text, 1.0 - r});
    if (r > 0) {
      sd.has_recall = true;
      sd.recall = recall_options_for(tc, mc.vocab_size, stage_seq[s], tc.seed * 1000 + s);
      const int64_t len = recall_task_length(sd.recall);
      const int64_t count = std::max<int64_t>(16, int64_t(r / (1 - r) * english_tokens / double(len)));
      std::vector<std::vector<int32_t>> docs;
      for (RecallTask& t : generate_recall_tasks(sd.recall, count)) docs.push_back(std::move(t.tokens));
      recall_data.push_back(TokenDataset::from_documents(docs, mc.vocab_size,
                                                         "builtin recall stage " + std::to_string(s)));
      const double replay = s > 0 ? stages[s].replay : 0.0;
      sd.sources.push_back({recall_data[s], r * (1 - replay)});
      if (replay > 0) sd.sources.push_back({recall_data[s - 1], r * replay});
    }
    td.stages.push_back(std::move(sd));
  }
  return td;
}

// ---- routing collection for Quantile Balancing and balance metrics ---------------------------

class BalanceCollector : public RoutingSink {
 public:
  explicit BalanceCollector(const ModelConfig& c) : E_(c.moe.num_experts), k_(c.moe.top_k) {
    layers_.resize(c.num_layers);
  }
  ~BalanceCollector() { wait_all(); }
  // Background QB (the GPU engine, whose host thread only waits on the device during a step):
  // once a layer's routing of the step is complete (its last micro-batch's forward), its QB
  // update runs on a thread of its own, on copies of the layer's bias and state, while the rest of
  // the forward and the backward run; quantile_update() applies the result after the step. The
  // update is the same function on the same inputs: the bias and state are those of a
  // synchronous run, bit for bit (measured on 2 cores: 18 ms per layer at N = 4096, E = 32,
  // refine 8, which a 15-layer step would otherwise add after the GPU work).
  void run_in_background(const BalanceOptions* options, const ModelWeights* weights,
                         const std::vector<BalanceLayerState>* state) {
    options_ = options;
    weights_ = weights;
    state_ = state;
  }
  // QB with the histogram estimator on the GPU (one batch, no refinement): the trainer asks the
  // model for each layer's histogram and loads instead of its [N, E] scores. The range comes from
  // the bias the forward routes with (weights' router_bias, uploaded after every update).
  void use_device_histograms(const ModelWeights* weights, int bins) {
    weights_ = weights;
    bins_ = bins;
  }
  // A new step whose routing arrives over `micro_batches` forwards.
  void begin_step(int64_t micro_batches) {
    wait_all();
    micro_batches_ = micro_batches;
    for (auto& l : layers_) {
      l.scores.clear();
      l.cutoff.clear();
      l.counts.clear();
      l.loads.assign(size_t(E_), 0);
      l.tokens = 0;
      l.deliveries = 0;
    }
  }
  void on_routing(int layer, const float* scores, const float* cutoff, const int32_t* idx,
                  int64_t N, int E, int k) override {
    Layer& l = layers_[layer];
    l.scores.insert(l.scores.end(), scores, scores + N * E);
    l.cutoff.insert(l.cutoff.end(), cutoff, cutoff + N);
    if (l.loads.empty()) l.loads.assign(size_t(E), 0);
    for (int64_t i = 0; i < N * k; ++i) l.loads[size_t(idx[i])] += 1;
    l.tokens += N;
    if (options_ && ++l.deliveries == micro_batches_) start_update(layer);
  }
  bool routing_histogram_range(int layer, double* low, double* high, int* bins) override {
    if (bins_ == 0) return false;
    Layer& l = layers_[layer];
    l.range = qb_histogram_range(weights_->layers[size_t(layer)].moe.router_bias, E_, bins_);
    *low = l.range.low;
    *high = l.range.high;
    *bins = l.range.bins;
    return true;
  }
  void on_routing_histogram(int layer, const int64_t* counts, const int64_t* loads, int64_t N,
                            int E, int k) override {
    (void)k;
    Layer& l = layers_[layer];
    const size_t n = size_t(E) * size_t(l.range.bins);
    if (l.counts.empty()) l.counts.assign(n, 0);  // micro-batches of one step add
    for (size_t i = 0; i < n; ++i) l.counts[i] += counts[i];
    if (l.loads.empty()) l.loads.assign(size_t(E), 0);
    for (int e = 0; e < E; ++e) l.loads[size_t(e)] += loads[e];
    l.tokens += N;
  }
  // Layer i's QB update of this step into bias and *state: the background result when one ran,
  // the histogram estimator's pick when the model built the histogram, else computed here.
  void quantile_update(int i, const BalanceOptions& options, BalanceLayerState* state,
                       float* bias) {
    Layer& l = layers_[size_t(i)];
    if (l.job.valid()) {
      l.job.get();  // rethrows what the update threw
      std::copy(l.new_bias.begin(), l.new_bias.end(), bias);
      *state = std::move(l.new_state);
      return;
    }
    if (!l.counts.empty()) {
      std::vector<double> raw(static_cast<size_t>(E_));
      if (qb_raw_bias_from_histogram(l.counts.data(), E_, k_, l.range, raw.data()) > 0)
        qb_set_bias(raw.data(), E_, options, state, bias);
      return;
    }
    quantile_balance_update(l.scores.data(), l.cutoff.data(), l.tokens, E_, k_, options, state,
                            bias);
  }
  struct Layer {
    std::vector<float> scores, cutoff;
    std::vector<int64_t> counts;  // [E, bins] when the model built the histogram
    QbHistogramRange range;
    std::vector<int64_t> loads;
    int64_t tokens = 0, deliveries = 0;
    std::future<void> job;  // the background update (valid until applied or waited for)
    std::vector<float> new_bias;
    BalanceLayerState new_state;
  };
  std::vector<Layer> layers_;
  int E_, k_;

 private:
  void start_update(int layer) {
    Layer& l = layers_[size_t(layer)];
    const float* bias = weights_->layers[size_t(layer)].moe.router_bias;
    if (bias == nullptr || l.tokens == 0) return;
    l.new_bias.assign(bias, bias + E_);
    l.new_state = (*state_)[size_t(layer)];
    l.job = std::async(std::launch::async, [this, layer] {
      Layer& job = layers_[size_t(layer)];
#ifdef _OPENMP
      omp_set_num_threads(1);  // this thread's regions only: the layers run side by side
#endif
      quantile_balance_update(job.scores.data(), job.cutoff.data(), job.tokens, E_, k_, *options_,
                              &job.new_state, job.new_bias.data());
    });
  }
  // Joins every background update not applied (a skipped step drops them).
  void wait_all() {
    for (auto& l : layers_)
      if (l.job.valid()) l.job.wait();
    for (auto& l : layers_) l.job = std::future<void>();
  }
  const BalanceOptions* options_ = nullptr;  // non-null: background updates
  const ModelWeights* weights_ = nullptr;
  const std::vector<BalanceLayerState>* state_ = nullptr;
  int64_t micro_batches_ = 1;
  int bins_ = 0;  // > 0: the model builds QB histograms of this many bins
};

// ---- small utilities -------------------------------------------------------------------------

std::string human_count(double v) {
  char b[32];
  if (v >= 1e9) std::snprintf(b, sizeof b, "%.2fB", v / 1e9);
  else if (v >= 1e6) std::snprintf(b, sizeof b, "%.2fM", v / 1e6);
  else if (v >= 1e3) std::snprintf(b, sizeof b, "%.1fK", v / 1e3);
  else std::snprintf(b, sizeof b, "%.0f", v);
  return b;
}

void progress_line(bool tty, int64_t step, int64_t total, const std::string& body) {
  const int width = 24;
  const int filled = total > 0 ? int(double(step) / double(total) * width) : 0;
  std::string bar(size_t(filled), '#');
  bar.resize(size_t(width), '.');
  if (tty) std::fprintf(stderr, "\r[%s] %lld/%lld %s\x1b[K", bar.c_str(), (long long)step, (long long)total, body.c_str());
  else std::fprintf(stderr, "[%s] %lld/%lld %s\n", bar.c_str(), (long long)step, (long long)total, body.c_str());
  std::fflush(stderr);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  DM_CHECK(in.good(), path, ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TrainerConfig trainer_config_from_json(const std::string& text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(str_cat(origin, ": not valid JSON (", e.what(), ")"));
  }
  DM_CHECK(j.is_object(), origin, ": expected a JSON object");
  TrainerConfig c;
  auto num = [&](const json& o, const char* key, auto& dst, const std::string& path) {
    if (!o.contains(key)) return;
    DM_CHECK(o[key].is_number(), origin, ": field '", path, key, "' must be a number");
    dst = o[key].get<std::remove_reference_t<decltype(dst)>>();
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    static const char* known[] = {"model", "data", "steps", "batch", "accum", "lr", "min_lr_ratio",
                                  "warmup", "optimizer", "weight_decay", "clip", "spike_factor",
                                  "stages", "balance", "sign_rate", "recompute", "kda_chunk", "device",
                                  "checkpoint_every", "eval_every", "eval_tasks", "seed",
                                  "recall_fraction", "recall_pairs", "recall_queries",
                                  "recall_span", "balance_ema", "balance_refine", "balance_window", "balance_background", "maxvio_window_tokens",
                                  "eval_balance_rows"};
    DM_CHECK(std::find_if(std::begin(known), std::end(known), [&](const char* k) { return it.key() == k; }) !=
                 std::end(known),
             origin, ": unknown field '", it.key(), "'");
  }
  if (j.contains("model")) c.model = j["model"].get<std::string>();
  if (j.contains("data")) c.data = j["data"].get<std::string>();
  num(j, "steps", c.steps, "");
  num(j, "batch", c.batch, "");
  num(j, "accum", c.accum, "");
  num(j, "lr", c.lr, "");
  num(j, "min_lr_ratio", c.min_lr_ratio, "");
  num(j, "warmup", c.warmup, "");
  num(j, "weight_decay", c.optimizer.weight_decay, "");
  num(j, "clip", c.clip, "");
  num(j, "spike_factor", c.spike_factor, "");
  num(j, "sign_rate", c.sign_rate, "");
  num(j, "kda_chunk", c.kda_chunk, "");
  num(j, "checkpoint_every", c.checkpoint_every, "");
  num(j, "eval_every", c.eval_every, "");
  num(j, "eval_tasks", c.eval_tasks, "");
  num(j, "seed", c.seed, "");
  num(j, "recall_fraction", c.recall_fraction, "");
  num(j, "recall_pairs", c.recall_pairs, "");
  num(j, "recall_queries", c.recall_queries, "");
  num(j, "recall_span", c.recall_span, "");
  DM_CHECK(c.recall_fraction >= 0 && c.recall_fraction < 1, origin,
           ": field 'recall_fraction' must be in [0, 1)");
  DM_CHECK(c.recall_pairs >= 1 && c.recall_pairs <= 16 && c.recall_queries >= 1 &&
               c.recall_queries <= c.recall_pairs,
           origin, ": fields 'recall_pairs' (1..16) and 'recall_queries' (1..pairs) out of range");
  DM_CHECK(c.recall_span > 0 && c.recall_span <= 1, origin, ": field 'recall_span' must be in (0, 1]");
  num(j, "balance_ema", c.balance_ema, "");
  DM_CHECK(c.balance_ema >= 0 && c.balance_ema < 1, origin, ": field 'balance_ema' must be in [0, 1)");
  num(j, "balance_refine", c.balance_refine, "");
  DM_CHECK(c.balance_refine >= 0 && c.balance_refine <= 64, origin,
           ": field 'balance_refine' must be in [0, 64]");
  num(j, "balance_background", c.balance_background, "");
  DM_CHECK(c.balance_background >= -1 && c.balance_background <= 1, origin,
           ": field 'balance_background' must be -1 (auto), 0 or 1");
  num(j, "balance_window", c.balance_window, "");
  DM_CHECK(c.balance_window >= 1 && c.balance_window <= 64, origin,
           ": field 'balance_window' must be in [1, 64]");
  num(j, "maxvio_window_tokens", c.maxvio_window_tokens, "");
  DM_CHECK(c.maxvio_window_tokens >= 0, origin, ": field 'maxvio_window_tokens' must be >= 0");
  num(j, "eval_balance_rows", c.eval_balance_rows, "");
  DM_CHECK(c.eval_balance_rows >= 0, origin, ": field 'eval_balance_rows' must be >= 0");
  if (j.contains("device")) {
    DM_CHECK(j["device"].is_string(), origin, ": field 'device' must be \"cpu\" or \"cuda\"");
    c.device = j["device"].get<std::string>();
    DM_CHECK(c.device == "cpu" || c.device == "cuda", origin, ": field 'device' must be cpu or cuda");
  }
  if (j.contains("recompute")) {
    DM_CHECK(j["recompute"].is_boolean(), origin, ": field 'recompute' must be true/false");
    c.recompute = j["recompute"].get<bool>();
  }
  if (j.contains("optimizer")) {
    const std::string o = j["optimizer"].get<std::string>();
    DM_CHECK(o == "adamw" || o == "muon", origin, ": field 'optimizer' must be \"adamw\" or \"muon\"");
    c.optimizer.kind = o == "muon" ? OptimizerKind::Muon : OptimizerKind::AdamW;
  }
  if (j.contains("balance")) {
    c.balance = j["balance"].get<std::string>();
    DM_CHECK(c.balance == "qb" || c.balance == "qb-hist" || c.balance == "sign" || c.balance == "none",
             origin, ": field 'balance' must be qb, qb-hist, sign or none");
  }
  if (j.contains("stages")) {
    DM_CHECK(j["stages"].is_array() && !j["stages"].empty(), origin, ": field 'stages' must be a non-empty array");
    for (size_t i = 0; i < j["stages"].size(); ++i) {
      const json& s = j["stages"][i];
      const std::string p = "stages[" + std::to_string(i) + "].";
      DM_CHECK(s.is_object(), origin, ": field '", p, "' must be an object");
      TrainStage st;
      num(s, "seq_len", st.seq_len, p);
      num(s, "tokens", st.tokens, p);
      num(s, "lr_mult", st.lr_mult, p);
      num(s, "replay", st.replay, p);
      num(s, "batch", st.batch, p);
      DM_CHECK(st.batch >= 0, origin, ": ", p, "batch must be >= 0 (0 = the run's batch)");
      DM_CHECK(st.seq_len > 0 && st.tokens > 0, origin, ": ", p, "seq_len and tokens must be > 0");
      DM_CHECK(st.replay >= 0 && st.replay < 1, origin, ": ", p, "replay must be in [0, 1)");
      c.stages.push_back(st);
    }
  }
  DM_CHECK(c.batch > 0 && c.accum > 0, origin, ": batch and accum must be > 0");
  DM_CHECK(c.kda_chunk == 0 || c.kda_chunk == 16 || c.kda_chunk == 32 || c.kda_chunk == 64, origin,
           ": field 'kda_chunk' must be 16, 32, 64 or 0");
  return c;
}

TrainSummary train(const TrainerConfig& tc) {
  DM_CHECK(!tc.out.empty(), "train: no output folder");
  fs::create_directories(tc.out);
  const std::string ckpt = tc.out + "/checkpoint";
  const bool resuming = tc.resume && fs::exists(ckpt + "/trainer_state.json");
  DM_CHECK(!tc.resume || resuming, ckpt, ": no checkpoint to resume from");

  // ---- model ----
  std::unique_ptr<Model> model;
  if (resuming) {
    model = Model::load(ckpt);
  } else if (fs::is_directory(tc.model) && fs::exists(tc.model + "/model.safetensors")) {
    model = Model::load(tc.model);
  } else {
    auto w = weights_allocate<float>(load_config(tc.model));
    weights_init(*w, tc.seed);
    model = std::make_unique<Model>(std::move(w));
  }
  const ModelConfig& mc = model->config();
  ModelWeights& W = model->weights();

  // ---- schedule ----
  std::vector<TrainStage> stages = tc.stages;
  if (stages.empty()) {
    TrainStage s;
    s.seq_len = 256;
    s.tokens = std::max<int64_t>(1, tc.steps) * tc.batch * tc.accum * s.seq_len;
    stages.push_back(s);
  }
  auto stage_batch = [&](int s) { return stages[size_t(s)].batch > 0 ? stages[size_t(s)].batch : tc.batch; };
  std::vector<int64_t> stage_first_step;  // step index where each stage begins
  int64_t total_steps = 0;
  for (size_t i = 0; i < stages.size(); ++i) {
    const TrainStage& s = stages[i];
    DM_CHECK(s.seq_len <= mc.max_context, "stage seq_len ", s.seq_len, " exceeds the model context ", mc.max_context);
    stage_first_step.push_back(total_steps);
    const int64_t step_tokens = stage_batch(int(i)) * tc.accum * s.seq_len;
    total_steps += std::max<int64_t>(1, (s.tokens + step_tokens - 1) / step_tokens);
  }
  const int64_t run_steps = tc.steps > 0 ? std::min(tc.steps, total_steps) : total_steps;
  auto stage_of = [&](int64_t step) {
    int s = 0;
    while (s + 1 < int(stages.size()) && step >= stage_first_step[s + 1]) ++s;
    return s;
  };

  // ---- data ----
  TrainData td;
  if (tc.data == "builtin") {
    td = build_builtin_data(tc, mc, stages);
  } else {
    auto ds = TokenDataset::open(tc.data);
    // Keep the data's tokenizer with the run so `generate --model OUT/checkpoint` can take text.
    if (fs::exists(tc.data + "/tokenizer.json"))
      fs::copy_file(tc.data + "/tokenizer.json", tc.out + "/tokenizer.json",
                    fs::copy_options::overwrite_existing);
    // One dataset for every stage: rows differ only in length, so there is nothing to replay.
    for (size_t s = 0; s < stages.size(); ++s) td.stages.push_back({{{ds, 1.0}}, false, {}});
  }
  auto make_sampler = [&](int s) {
    PackedSamplerOptions o;
    o.batch_size = stage_batch(s);
    o.seq_len = stages[s].seq_len;
    o.seed = tc.seed * 7919 + uint64_t(s);
    return std::make_unique<PackedSampler>(td.stages[s].sources, o);
  };

  // ---- optimizer, balance, state ----
  OptimizerConfig oc = tc.optimizer;
  std::unique_ptr<TrainEngine> engine = make_train_engine(tc.device, *model, oc);
  BalanceOptions bo;
  bo.estimator = tc.balance == "qb-hist" ? QuantileEstimator::Histogram : QuantileEstimator::Exact;
  bo.rule = tc.balance == "sign" ? BalanceRule::Sign : BalanceRule::Quantile;
  bo.sign_rate = tc.sign_rate;
  bo.quantile_ema = tc.balance_ema;
  // The refinement re-derives cutoffs over all experts: only for ungrouped routing.
  const bool grouped_routing = mc.moe.n_group > 1 && mc.moe.topk_group < mc.moe.n_group;
  bo.refine_iterations = grouped_routing ? 0 : tc.balance_refine;
  bo.window = grouped_routing ? 1 : tc.balance_window;
  std::vector<BalanceLayerState> bstate(size_t(mc.num_layers));
  BalanceCollector collector(mc);
  // On the GPU the histogram estimator keeps each layer's routing on the device (the [N, E]
  // scores of every MoE layer would otherwise cross to the host each micro-batch); the other QB
  // forms run on background threads there.
  if (tc.device == "cuda" && bo.rule == BalanceRule::Quantile &&
      bo.estimator == QuantileEstimator::Histogram && bo.window == 1 && bo.refine_iterations == 0)
    collector.use_device_histograms(&W, bo.histogram_bins);
  const bool background_balance =
      tc.balance_background > 0 || (tc.balance_background < 0 && tc.device == "cuda");
  if (background_balance && bo.rule == BalanceRule::Quantile)
    collector.run_in_background(&bo, &W, &bstate);
  // Loads per layer summed over the steps of the current MaxVio window, and its token count.
  std::vector<std::vector<int64_t>> window_loads(size_t(mc.num_layers),
                                                 std::vector<int64_t>(size_t(mc.moe.num_experts), 0));
  int64_t window_tokens = 0;

  int64_t step = 0, tokens_seen = 0, skipped = 0;
  double loss_ema = 0, elapsed = 0;
  int cur_stage = stage_of(0);
  std::unique_ptr<PackedSampler> sampler = make_sampler(cur_stage);
  if (resuming) {
    engine->load_optimizer(ckpt + "/optimizer.safetensors");
    const json st = json::parse(read_text(ckpt + "/trainer_state.json"));
    step = st.at("step").get<int64_t>();
    tokens_seen = st.at("tokens").get<int64_t>();
    skipped = st.at("skipped").get<int64_t>();
    loss_ema = st.at("loss_ema").get<double>();
    elapsed = st.at("elapsed_s").get<double>();
    cur_stage = st.at("stage").get<int>();
    sampler = make_sampler(cur_stage);
    sampler->restore(st.at("sampler"));
    if (st.contains("maxvio_window")) {
      window_tokens = st["maxvio_window"].at("tokens").get<int64_t>();
      window_loads = st["maxvio_window"].at("loads").get<std::vector<std::vector<int64_t>>>();
      DM_CHECK(window_loads.size() == size_t(mc.num_layers), ckpt,
               "/trainer_state.json: maxvio_window has ", window_loads.size(), " layers, expected ",
               mc.num_layers);
    }
    const json& bs = st.at("balance_ema");
    for (size_t i = 0; i < bstate.size() && i < bs.size(); ++i)
      bstate[i].smoothed_raw_bias = bs[i].get<std::vector<double>>();
    // The QB pooling window (scores of the last W − 1 steps per layer), when one was kept.
    if (fs::exists(ckpt + "/balance_window.safetensors")) {
      const SafetensorsReader r = SafetensorsReader::open(ckpt + "/balance_window.safetensors");
      for (const std::string& name : r.names()) {
        int layer = -1, slot = -1;
        DM_CHECK(std::sscanf(name.c_str(), "layer%d.step%d", &layer, &slot) == 2 && layer >= 0 &&
                     layer < mc.num_layers && slot >= 0 && slot < 64,
                 ckpt, "/balance_window.safetensors: unexpected tensor '", name, "'");
        const Tensor& t = r.get(name);
        DM_CHECK(t.dtype == DType::F32 && t.shape.ndim == 2 && t.shape[1] == mc.moe.num_experts,
                 ckpt, "/balance_window.safetensors: tensor '", name, "' must be F32 [N, ",
                 mc.moe.num_experts, "]");
        auto& past = bstate[size_t(layer)].past_scores;
        if (past.size() <= size_t(slot)) past.resize(size_t(slot) + 1);
        const float* d = static_cast<const float*>(t.data);
        past[size_t(slot)].assign(d, d + t.numel());
      }
    }
    // Keep metrics.jsonl consistent with the checkpoint: drop lines past its step.
    std::ifstream in(tc.out + "/metrics.jsonl");
    std::string line, kept;
    while (std::getline(in, line)) {
      try {
        if (json::parse(line).at("step").get<int64_t>() <= step) kept += line + "\n";
      } catch (const std::exception&) {
      }
    }
    write_file_atomic(tc.out + "/metrics.jsonl", kept.data(), kept.size());
  } else {
    std::ofstream(tc.out + "/metrics.jsonl", std::ios::trunc);
  }
  std::ofstream metrics(tc.out + "/metrics.jsonl", std::ios::app);

  auto save_checkpoint = [&]() {
    const std::string tmp = tc.out + "/checkpoint.tmp";
    std::error_code ec;
    fs::remove_all(tmp, ec);
    engine->sync_host_weights();
    weights_save(W, tmp);
    engine->save_optimizer(tmp + "/optimizer.safetensors");
    if (fs::exists(tc.out + "/tokenizer.json"))  // so `generate --model OUT/checkpoint` finds it
      fs::copy_file(tc.out + "/tokenizer.json", tmp + "/tokenizer.json", fs::copy_options::overwrite_existing);
    json bs = json::array();
    for (const auto& b : bstate) bs.push_back(b.smoothed_raw_bias);
    const json st = {{"step", step},         {"tokens", tokens_seen}, {"skipped", skipped},
                     {"loss_ema", loss_ema}, {"elapsed_s", elapsed},   {"stage", cur_stage},
                     {"sampler", sampler->state_json()}, {"balance_ema", bs},
                     {"maxvio_window", {{"tokens", window_tokens}, {"loads", window_loads}}}};
    const std::string s = st.dump(1);
    write_file_atomic(tmp + "/trainer_state.json", s.data(), s.size());
    SafetensorsWriter window;
    for (size_t i = 0; i < bstate.size(); ++i)
      for (size_t w = 0; w < bstate[i].past_scores.size(); ++w) {
        const auto& sc = bstate[i].past_scores[w];
        window.add_f32(str_cat("layer", i, ".step", w), sc.data(),
                       Shape{int64_t(sc.size()) / mc.moe.num_experts, mc.moe.num_experts});
      }
    const bool window_kept = std::any_of(bstate.begin(), bstate.end(),
                                         [](const BalanceLayerState& b) { return !b.past_scores.empty(); });
    if (window_kept) window.write(tmp + "/balance_window.safetensors");
    const std::string old = tc.out + "/checkpoint.old";
    fs::remove_all(old, ec);
    if (fs::exists(ckpt)) fs::rename(ckpt, old);
    fs::rename(tmp, ckpt);
    fs::remove_all(old, ec);
  };

  // Recall evaluation: held-out tasks at the current stage's distance, argmax at answer positions.
  auto eval_recall = [&](int s) -> double {
    if (!td.stages[s].has_recall || tc.eval_tasks <= 0) return -1;
    RecallTaskOptions o = td.stages[s].recall;
    o.seed += 0x5eed;
    const auto tasks = generate_recall_tasks(o, tc.eval_tasks);
    std::vector<float> logits;
    std::vector<int64_t> ids;
    const NextTokenArgmaxFn predict = [&](std::span<const int32_t> prompt) {
      const int64_t T = int64_t(prompt.size()), V = mc.vocab_size;
      ids.assign(prompt.begin(), prompt.end());
      logits.resize(size_t(T * V));
      ForwardOptions fo;
      fo.kda_chunk = tc.kda_chunk;
      model->forward(ids.data(), 1, T, logits.data(), nullptr, fo);
      std::vector<int32_t> arg(static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t) {
        const float* z = logits.data() + t * V;
        arg[size_t(t)] = int32_t(std::max_element(z, z + V) - z);
      }
      return arg;
    };
    return recall_accuracy(predict, tasks).accuracy();
  };

  // MaxVio_global: expert loads summed over held-out rows of stage s's mix (a sampler with its own
  // seed), routed with the current bias. A batch's MaxVio also carries that batch's composition
  // (which documents it happens to hold); this isolates how well the bias balances the data.
  auto eval_balance = [&](int s) -> double {
    if (tc.eval_balance_rows <= 0 || tc.balance == "none" || mc.num_moe_layers() == 0) return -1;
    PackedSamplerOptions o;
    o.batch_size = tc.eval_balance_rows;
    o.seq_len = stages[s].seq_len;
    o.seed = tc.seed * 7919 + uint64_t(s) + 0xba1a;
    PackedSampler held_out(td.stages[s].sources, o);
    PackedBatch b;
    held_out.next_batch(b);
    struct LoadCounter : ForwardObserver {
      std::vector<std::vector<int64_t>> loads;
      void on_router(int layer, const int32_t* idx, const float*, int64_t N, int k) override {
        auto& l = loads[size_t(layer)];
        for (int64_t i = 0; i < N * k; ++i) ++l[size_t(idx[i])];
      }
    } counter;
    counter.loads.assign(size_t(mc.num_layers), std::vector<int64_t>(size_t(mc.moe.num_experts), 0));
    ForwardOptions fo;
    fo.kda_chunk = tc.kda_chunk;
    const int64_t T = b.seq_len, rows_per_call = 4;
    std::vector<float> logits(size_t(rows_per_call * T * mc.vocab_size));
    for (int64_t r0 = 0; r0 < b.batch_size; r0 += rows_per_call) {
      const int64_t rows = std::min(rows_per_call, b.batch_size - r0);
      model->forward(b.tokens.data() + r0 * T, rows, T, logits.data(), &counter, fo,
                     b.doc_start.data() + r0 * T);
    }
    double worst = 0;
    for (int i = 0; i < mc.num_layers; ++i)
      if (mc.ffns[i] == FfnKind::MoE)
        worst = std::max(worst, balance_metrics(counter.loads[size_t(i)].data(), mc.moe.num_experts).max_violation);
    return worst;
  };

  TrainSummary sum;
  sum.unigram_entropy = td.unigram_entropy;
  sum.weights_bytes = W.arena.capacity();
  sum.optimizer_bytes = engine->optimizer_bytes();
  const bool tty = tc.progress && isatty(2);
  std::vector<PackedBatch> micro(size_t(tc.accum));
  std::vector<double> losses;
  TrainOptions to;
  to.kda_chunk = tc.kda_chunk;
  to.recompute = tc.recompute;

  const int64_t last_step = tc.stop_after > 0 ? std::min(tc.stop_after, run_steps) : run_steps;
  while (step < last_step) {
    const int s = stage_of(step);
    if (s != cur_stage) {  // stage transition: new length, new data mix; the LR multiplier drops
      cur_stage = s;
      sampler = make_sampler(s);
    }
    const TrainStage& st = stages[s];
    const auto t0 = std::chrono::steady_clock::now();
    int64_t targets = 0, step_tokens = 0;
    for (auto& b : micro) {
      sampler->next_batch(b);
      if (td.stages[s].has_recall) recall_keep_only_answer_targets(b, recall_task_layout(td.stages[s].recall), /*text_source=*/0);
      targets += b.num_targets();
      step_tokens += b.batch_size * b.seq_len;
    }
    engine->zero_grads();
    collector.begin_step(int64_t(micro.size()));
    double loss_sum = 0;
    int64_t correct = 0;
    for (const auto& b : micro) {
      const TrainStepResult r = engine->forward_backward(b.tokens.data(), b.targets.data(), b.doc_start.data(),
                                                         b.batch_size, b.seq_len,
                                                         1.0 / double(std::max<int64_t>(1, targets)), to,
                                                         tc.balance == "none" ? nullptr : &collector);
      loss_sum += r.loss_sum;
      correct += r.correct;
    }
    const double loss = loss_sum / double(std::max<int64_t>(1, targets));
    const double gnorm = engine->grad_norm();
    const float lr = lr_schedule(step, tc.warmup, run_steps, tc.lr, tc.min_lr_ratio) * st.lr_mult;
    bool skip = !std::isfinite(loss) || !std::isfinite(gnorm);
    if (!skip && tc.spike_factor > 0 && step >= 20 && loss > tc.spike_factor * loss_ema) skip = true;
    double maxvio = 0, cv = 0;
    int64_t window_moe_tokens = 0;
    int dead = 0, moe_layers = 0;
    json per_layer = json::array();
    if (!skip) {
      if (tc.clip > 0 && gnorm > tc.clip) engine->scale_grads(float(tc.clip / gnorm));
      engine->optimizer_step(lr);
      loss_ema = step == 0 ? loss : 0.95 * loss_ema + 0.05 * loss;
    } else {
      ++skipped;
      std::fprintf(stderr, "\nstep %lld skipped: loss %.4g (running %.4g), grad norm %.4g\n",
                   (long long)step, loss, loss_ema, gnorm);
    }
    for (int i = 0; i < mc.num_layers; ++i) {
      if (mc.ffns[i] != FfnKind::MoE || tc.balance == "none") continue;
      auto& l = collector.layers_[size_t(i)];
      if (l.tokens == 0) continue;
      const BalanceMetrics bm = balance_metrics(l.loads.data(), mc.moe.num_experts);
      maxvio = std::max(maxvio, bm.max_violation);
      cv += bm.coefficient_of_variation;
      dead += bm.dead_experts;
      ++moe_layers;
      per_layer.push_back({{"layer", i}, {"maxvio", bm.max_violation}, {"cv", bm.coefficient_of_variation}, {"dead", bm.dead_experts}});
      for (int e = 0; e < mc.moe.num_experts; ++e) window_loads[size_t(i)][size_t(e)] += l.loads[size_t(e)];
      window_moe_tokens = l.tokens;
      if (skip) continue;
      float* bias = W.layers[size_t(i)].moe.router_bias;
      if (bo.rule == BalanceRule::Sign)
        sign_balance_update(l.loads.data(), mc.moe.num_experts, bo.sign_rate, bias);
      else
        collector.quantile_update(i, bo, &bstate[size_t(i)], bias);
    }
    if (!skip && moe_layers && tc.balance != "none") engine->after_bias_update();
    if (moe_layers) cv /= moe_layers;
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    elapsed += dt;
    tokens_seen += step_tokens;
    ++step;
    json m = {{"step", step},        {"stage", s},        {"seq_len", st.seq_len}, {"loss", loss},
              {"lr", lr},            {"grad_norm", gnorm}, {"tokens_per_s", double(step_tokens) / dt},
              {"tokens", tokens_seen}, {"token_acc", double(correct) / double(std::max<int64_t>(1, targets))},
              {"maxvio", maxvio},    {"cv", cv},           {"dead_experts", dead},  {"skipped", skip},
              {"elapsed_s", elapsed}};
    if (!per_layer.empty()) m["balance"] = per_layer;
    window_tokens += window_moe_tokens;
    if (tc.maxvio_window_tokens > 0 && window_tokens >= tc.maxvio_window_tokens) {
      double worst = 0;
      for (int i = 0; i < mc.num_layers; ++i)
        if (mc.ffns[i] == FfnKind::MoE)
          worst = std::max(worst, balance_metrics(window_loads[size_t(i)].data(), mc.moe.num_experts).max_violation);
      m["maxvio_window"] = worst;
      m["maxvio_window_tokens"] = window_tokens;
      sum.last_maxvio_window = worst;
      if (worst < 0.1 && sum.first_window_step_below < 0) sum.first_window_step_below = step;
      for (auto& l : window_loads) std::fill(l.begin(), l.end(), int64_t(0));
      window_tokens = 0;
    }
    const bool stage_ends = step == run_steps || stage_of(step) != s;
    if (tc.eval_every > 0 && (step % tc.eval_every == 0 || stage_ends)) {
      engine->sync_host_weights();  // evaluations run the host model
      const double acc = eval_recall(s);
      if (acc >= 0) {
        m["recall_acc"] = acc;
        m["recall_distance"] = td.stages[s].recall.filler_length;
        sum.recall_acc = acc;
        sum.recall_chance = 1.0 / td.stages[s].recall.num_values;
      }
      const double mvg = eval_balance(s);
      if (mvg >= 0) {
        m["maxvio_global"] = mvg;
        sum.last_maxvio_global = mvg;
      }
    }
    metrics << m.dump() << "\n";
    metrics.flush();
    losses.push_back(loss);
    sum.last_maxvio = maxvio;
    if (tc.progress) {
      char body[256];
      std::snprintf(body, sizeof body, "T=%lld %s tok/s loss %.3f lr %.2e gnorm %.2f maxvio %.3f",
                    (long long)st.seq_len, human_count(double(step_tokens) / dt).c_str(), loss, lr,
                    gnorm, maxvio);
      if (tty || step % 10 == 0 || step == run_steps) progress_line(tty, step, run_steps, body);
    }
    if ((tc.checkpoint_every > 0 && step % tc.checkpoint_every == 0) || step == last_step) save_checkpoint();
  }
  if (tty) std::fprintf(stderr, "\n");
  auto mean_of = [](const std::vector<double>& v, size_t from, size_t to) {
    double s = 0;
    for (size_t i = from; i < to; ++i) s += v[i];
    return to > from ? s / double(to - from) : 0.0;
  };
  const size_t n = losses.size(), w = std::min<size_t>(10, n);
  sum.steps = step;
  sum.tokens = tokens_seen;
  sum.skipped = skipped;
  sum.first_loss = mean_of(losses, 0, w);
  sum.last_loss = mean_of(losses, n - w, n);
  sum.tokens_per_s = elapsed > 0 ? double(tokens_seen) / elapsed : 0;
  sum.peak_activation_bytes = engine->activation_peak();
  return sum;
}

}  // namespace dm
