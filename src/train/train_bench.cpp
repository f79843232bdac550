// Training-step throughput (train_bench.h).
#include "train/train_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>
#include <vector>

#include "core/error.h"
#include "model/model.h"
#include "model/params.h"
#include "model/plan.h"
#include "train/train_engine.h"

namespace dm {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

struct TrainBench::State {
  ModelConfig cfg;
  TrainBenchOptions o;
  Model model;
  std::unique_ptr<TrainEngine> engine;
  std::vector<int64_t> tokens, targets;
  State(const ModelConfig& c, const TrainBenchOptions& opts,
        std::unique_ptr<ModelWeightsT<float>> w)
      : cfg(c), o(opts), model(std::move(w)) {}
};

namespace {

std::unique_ptr<ModelWeightsT<float>> checked_init(const ModelConfig& cfg,
                                                   const TrainBenchOptions& o) {
  DM_CHECK(o.batch >= 1 && o.seq >= 2 && o.steps >= 1 && o.warmup >= 0 && o.accum >= 1,
           "bench train: need batch ≥ 1, seq ≥ 2, steps ≥ 1, warmup ≥ 0 and accum ≥ 1, got batch ",
           o.batch, " seq ", o.seq, " steps ", o.steps, " warmup ", o.warmup, " accum ", o.accum);
  DM_CHECK(o.seq <= cfg.max_context, "bench train: seq ", o.seq, " exceeds the config's context ",
           cfg.max_context);
  auto w = weights_allocate<float>(cfg);
  weights_init(*w, o.seed);
  return w;
}

}  // namespace

TrainBench::TrainBench(const ModelConfig& cfg, const TrainBenchOptions& o)
    : state_(std::make_unique<State>(cfg, o, checked_init(cfg, o))) {
  State& st = *state_;
  st.engine = make_train_engine(o.device, st.model, OptimizerConfig{});
  const int64_t N = o.batch * o.seq, T = o.seq;
  // Random tokens; each row's targets are its next tokens (the last position has none).
  std::mt19937_64 rng(o.seed + 2);
  st.tokens.resize(static_cast<size_t>(N));
  st.targets.resize(static_cast<size_t>(N));
  for (auto& t : st.tokens) t = int64_t(rng() % uint64_t(cfg.vocab_size));
  for (int64_t i = 0; i < N; ++i)
    st.targets[size_t(i)] = (i + 1) % T ? st.tokens[size_t(i + 1)] : -1;
}

TrainBench::~TrainBench() = default;

TrainBenchResult TrainBench::measure() {
  State& st = *state_;
  const TrainBenchOptions& o = st.o;
  TrainEngine& engine = *st.engine;
  const int64_t B = o.batch, T = o.seq, N = B * T;
  TrainOptions options;
  options.recompute = o.recompute;

  TrainBenchResult r;
  std::vector<double> steps, forward_backward;
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  // A step runs from its start to the next one's, as in `train`: the host does not wait for the
  // optimizer update (the next step's host work and uploads queue behind it), only for the loss
  // and the gradient norm; the last step ends when the device is done.
  Clock::time_point next_start = Clock::now();
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    const auto t0 = next_start;
    engine.zero_grads();
    TrainStepResult step;
    for (int64_t m = 0; m < o.accum; ++m)  // the same tokens each time: only the timing matters
      step = engine.forward_backward(st.tokens.data(), st.targets.data(), nullptr, B, T,
                                     1.0 / double(o.accum * (N - B)), options, nullptr);
    const auto t1 = Clock::now();
    const double norm = engine.grad_norm();  // synchronises on the GPU
    if (norm > 1.0) engine.scale_grads(float(1.0 / norm));
    engine.optimizer_step(1e-4f);
    if (s + 1 == o.warmup + o.steps) engine.synchronize();
    const auto t2 = Clock::now();
    next_start = t2;
    if (s >= o.warmup) {
      steps.push_back(seconds(t0, t2));
      forward_backward.push_back(seconds(t0, t1));
    }
    r.loss = step.loss_sum / double(std::max<int64_t>(step.count, 1));
  }
  const ParamCount pc = count_params(st.cfg);
  r.step_s = median(steps);
  r.forward_backward_s = median(forward_backward);
  r.tokens_per_step = o.accum * N;
  r.params = pc.total;
  r.active_params = pc.active;
  r.flops_per_token = train_flops_per_token(st.cfg, pc.active, T);
  r.optimizer_bytes = engine.optimizer_bytes();
  r.activation_peak = engine.activation_peak();
  return r;
}

TrainBenchResult run_train_bench(const ModelConfig& cfg, const TrainBenchOptions& o) {
  return TrainBench(cfg, o).measure();
}

double TrainBenchAb::median_ms(size_t value) const { return median(step_ms.at(value)); }

TrainBenchAb parse_train_bench_ab(const std::string& spec) {
  const size_t eq = spec.find('=');
  DM_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < spec.size(),
           "bench train --ab: want NAME=v1,v2,…, got '", spec, "'");
  TrainBenchAb ab;
  ab.name = spec.substr(0, eq);
  for (size_t at = eq + 1;;) {
    const size_t comma = spec.find(',', at);
    ab.values.push_back(
        spec.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return ab;
}

void run_train_bench_ab(TrainBench& bench, TrainBenchAb& ab, int rounds,
                        const std::function<void(int, size_t, const TrainBenchResult&)>& each) {
  DM_CHECK(rounds >= 1, "bench train --ab: need rounds ≥ 1, got ", rounds);
  ab.step_ms.assign(ab.values.size(), {});
  for (int round = 0; round < rounds; ++round)
    for (size_t v = 0; v < ab.values.size(); ++v) {
      setenv(ab.name.c_str(), ab.values[v].c_str(), 1);
      const TrainBenchResult r = bench.measure();
      ab.step_ms[v].push_back(r.step_s * 1e3);
      if (each) each(round, v, r);
    }
}

}  // namespace dm
