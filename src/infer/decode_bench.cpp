// Cached-decode throughput (decode_bench.h).
#include "infer/decode_bench.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "core/error.h"
#include "infer/decode_backend.h"

namespace dm {

double DecodeBenchResult::tokens_per_s() const { return double(batch) / step_s; }
double DecodeBenchResult::prefill_tokens_per_s() const {
  return double(batch * context) / prefill_s;
}

DecodeBenchResult run_decode_bench(Model& model, const DecodeBenchOptions& o) {
  const ModelConfig& cfg = model.config();
  DM_CHECK(o.batch >= 1 && o.context >= 1 && o.steps >= 1 && o.warmup >= 0,
           "bench decode: need batch ≥ 1, context ≥ 1, steps ≥ 1 and warmup ≥ 0, got batch ",
           o.batch, " context ", o.context, " steps ", o.steps, " warmup ", o.warmup);
  const int64_t max_length = o.context + o.warmup + o.steps;
  DM_CHECK(max_length <= cfg.max_context, "bench decode: context ", o.context, " + ",
           o.warmup + o.steps, " steps exceeds the model's context ", cfg.max_context);
  auto backend = make_decode_backend(o.device, model, o.batch, max_length, 0);
  const int64_t V = cfg.vocab_size;
  std::mt19937_64 rng(o.seed);
  auto token = [&] { return int32_t(rng() % uint64_t(V)); };
  std::vector<float> logits(size_t(o.batch * V));
  using Clock = std::chrono::steady_clock;

  DecodeBenchResult r;
  r.batch = o.batch;
  r.context = o.context;
  std::vector<int32_t> prompt(static_cast<size_t>(o.context));
  const auto p0 = Clock::now();
  for (int64_t s = 0; s < o.batch; ++s) {
    for (auto& t : prompt) t = token();
    backend->prefill_slot(model, s, prompt, logits.data() + s * V);
  }
  r.prefill_s = std::chrono::duration<double>(Clock::now() - p0).count();

  std::vector<int32_t> next(static_cast<size_t>(o.batch));
  std::vector<int> active(static_cast<size_t>(o.batch), 1);
  std::vector<int64_t> row_of(static_cast<size_t>(o.batch));
  std::vector<double> times;
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    for (auto& t : next) t = token();
    const auto t0 = Clock::now();  // the server's call: logits left where the backend has them
    backend->decode_active_rows(model, next.data(), active.data(), logits.data(), row_of.data());
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i >= o.warmup) times.push_back(dt);
  }
  std::sort(times.begin(), times.end());
  r.step_s = times[times.size() / 2];
  return r;
}

}  // namespace dm
