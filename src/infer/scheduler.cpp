#include "infer/scheduler.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_set>

#include "core/gemm.h"
#include "infer/decode.h"
#include "infer/decode_backend.h"

namespace dm {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
    case FinishReason::Timeout: return "timeout";
    case FinishReason::Error: return "error";
  }
  return "error";
}

void LatencyHistogram::add(double seconds) {
  size_t b = 0;
  while (b < kBounds.size() && seconds > kBounds[b]) ++b;
  ++counts[b];
  sum += seconds;
  ++count;
}

double LatencyHistogram::quantile_upper_bound(double q) const {
  if (count == 0) return 0;
  const double target = q * double(count);
  uint64_t seen = 0;
  for (size_t b = 0; b < counts.size(); ++b) {
    seen += counts[b];
    if (double(seen) >= target) return b < kBounds.size() ? kBounds[b] : INFINITY;
  }
  return INFINITY;
}

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct WaitingRequest {
  uint64_t id = 0;
  GenerationRequest request;
  Clock::time_point submitted, deadline;
  bool has_deadline = false;
};

// A sequence holding a decode slot.
struct RunningSequence {
  bool busy = false;
  uint64_t id = 0;
  GenerationRequest request;
  std::optional<Sampler> sampler;
  std::vector<int32_t> context;  // prompt + generated (for the repetition penalty)
  int64_t generated = 0;
  int64_t cached_tokens = 0;  // prompt tokens the prefill took from the prefix cache
  int32_t next_token = 0;  // sampled, fed by the next decode step
  Clock::time_point submitted, deadline, first_token;
  bool has_deadline = false;
};

}  // namespace

struct Scheduler::Engine {
  Engine(std::unique_ptr<Model> m, const SchedulerOptions& o);
  void run();
  void validate(const GenerationRequest& r) const;
  // Engine-thread helpers (no lock held unless said).
  void start_sequence(int64_t slot, WaitingRequest&& w);
  // Samples the slot's next token from logits row [V], emits it and retires the sequence when
  // it is done.
  void sample_and_emit(int64_t slot, float* row);
  void retire(int64_t slot, FinishReason reason, std::string why);
  void finish_waiting(WaitingRequest& w, FinishReason reason, std::string why);
  void record_finish(const RequestOutcome& outcome, bool had_first_token);
  // Moves the engine-local token / step counts into `stats` (mu held).
  void flush_pending_stats() {
    stats.generated_tokens += pending_generated;
    stats.prompt_tokens += pending_prompt;
    stats.decode_steps += pending_steps;
    pending_generated = pending_prompt = pending_steps = 0;
  }
  int64_t busy_count() const;

  std::unique_ptr<Model> model;
  SchedulerOptions opt;
  int64_t S = 0, Lmax = 0, V = 0;
  int threads = 0;
  std::unique_ptr<DecodeBackend> backend;
  // Engine-thread buffers, sized once.
  std::vector<float> logits;            // [S, V]
  std::vector<float> logprob_scratch;   // [V]
  std::vector<TokenLogprob> top_scratch;  // [V]
  std::vector<int32_t> next_ids;        // [S]
  std::vector<int> active;              // [S]
  std::vector<int64_t> row_of;          // [S] a slot's row of the backend's logits rows
  std::vector<RunningSequence> slots;   // [S]
  std::vector<WaitingRequest> admitted, dropped;
  std::vector<uint64_t> cancels;
  uint64_t pending_generated = 0, pending_prompt = 0, pending_steps = 0;

  // Shared with submitting threads, under `mu`.
  mutable std::mutex mu;
  std::condition_variable wake;
  std::deque<WaitingRequest> waiting;
  std::vector<uint64_t> cancel_requests;
  std::unordered_set<uint64_t> live;  // ids waiting or running
  bool stopping = false;
  uint64_t next_id = 1;
  SchedulerStats stats;
  std::thread thread;
};

Scheduler::Engine::Engine(std::unique_ptr<Model> m, const SchedulerOptions& o)
    : model(std::move(m)), opt(o) {
  DM_CHECK(model, "scheduler: no model");
  const ModelConfig& c = model->config();
  DM_CHECK(opt.max_concurrent >= 1, "scheduler: max_concurrent must be ≥ 1 (got ",
           opt.max_concurrent, ")");
  DM_CHECK(opt.max_context >= 0 && opt.max_context <= c.max_context, "scheduler: max_context ",
           opt.max_context, " outside [1, ", c.max_context, "] (the model's context limit)");
  DM_CHECK(opt.max_queue >= 0, "scheduler: max_queue must be ≥ 0");
  DM_CHECK(opt.prefill_token_budget >= 1, "scheduler: prefill_token_budget must be ≥ 1");
  S = opt.max_concurrent;
  Lmax = opt.max_context > 0 ? opt.max_context : c.max_context;
  V = c.vocab_size;
  threads = num_threads();
  backend = make_decode_backend(opt.device, *model, S, Lmax, opt.prefix_cache_bytes);
  logits.assign(size_t(S * V), 0.0f);
  logprob_scratch.assign(size_t(V), 0.0f);
  top_scratch.assign(size_t(V), TokenLogprob{});
  next_ids.assign(size_t(S), 0);
  active.assign(size_t(S), 0);
  row_of.assign(size_t(S), -1);
  slots.resize(size_t(S));
  admitted.reserve(size_t(S));
  stats.max_concurrent = S;
}

int64_t Scheduler::Engine::busy_count() const {
  int64_t n = 0;
  for (const auto& s : slots) n += s.busy;
  return n;
}

void Scheduler::Engine::validate(const GenerationRequest& r) const {
  using K = SubmitError::Kind;
  if (r.prompt.empty()) throw SubmitError(K::Invalid, "the prompt is empty");
  for (size_t i = 0; i < r.prompt.size(); ++i)
    if (r.prompt[i] < 0 || r.prompt[i] >= V)
      throw SubmitError(K::Invalid, str_cat("prompt token ", r.prompt[i], " at position ", i,
                                            " is outside the vocabulary [0, ", V, ")"));
  if (r.max_tokens < 1)
    throw SubmitError(K::Invalid, str_cat("max_tokens must be ≥ 1 (got ", r.max_tokens, ")"));
  if (int64_t(r.prompt.size()) + r.max_tokens > Lmax)
    throw SubmitError(K::ContextLength,
                      str_cat("this model's maximum context length is ", Lmax,
                              " tokens; the request asks for ", r.prompt.size(),
                              " prompt + ", r.max_tokens, " completion tokens"));
  const SamplingParams& p = r.sampling;
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    throw SubmitError(K::Invalid, str_cat("temperature must be ≥ 0 (got ", p.temperature, ")"));
  if (!(p.top_p > 0 && p.top_p <= 1))
    throw SubmitError(K::Invalid, str_cat("top_p must be in (0, 1] (got ", p.top_p, ")"));
  if (p.top_k < 0) throw SubmitError(K::Invalid, str_cat("top_k must be ≥ 0 (got ", p.top_k, ")"));
  if (!(p.min_p >= 0 && p.min_p <= 1))
    throw SubmitError(K::Invalid, str_cat("min_p must be in [0, 1] (got ", p.min_p, ")"));
  if (!(p.repetition_penalty > 0) || !std::isfinite(p.repetition_penalty))
    throw SubmitError(K::Invalid, str_cat("repetition_penalty must be > 0 (got ",
                                          p.repetition_penalty, ")"));
  if (r.top_logprobs > V)
    throw SubmitError(K::Invalid, str_cat("top_logprobs ", r.top_logprobs,
                                          " exceeds the vocabulary size ", V));
  if (!(r.timeout_s >= 0)) throw SubmitError(K::Invalid, "timeout must be ≥ 0");
}

void Scheduler::Engine::record_finish(const RequestOutcome& outcome, bool had_first_token) {
  std::lock_guard<std::mutex> lk(mu);
  flush_pending_stats();  // so a finished request's tokens are counted when its caller looks
  ++stats.requests_finished[size_t(outcome.finish_reason)];
  if (had_first_token) stats.time_to_first_token.add(outcome.time_to_first_token_s);
  stats.request_latency.add(outcome.total_s);
}

void Scheduler::Engine::finish_waiting(WaitingRequest& w, FinishReason reason, std::string why) {
  RequestOutcome out;
  out.finish_reason = reason;
  out.error = std::move(why);
  out.prompt_tokens = int64_t(w.request.prompt.size());
  out.total_s = seconds_between(w.submitted, Clock::now());
  {
    std::lock_guard<std::mutex> lk(mu);
    live.erase(w.id);
  }
  record_finish(out, false);
  if (w.request.on_finish) w.request.on_finish(out);
}

void Scheduler::Engine::retire(int64_t slot, FinishReason reason, std::string why) {
  RunningSequence& s = slots[size_t(slot)];
  RequestOutcome out;
  out.finish_reason = reason;
  out.error = std::move(why);
  out.prompt_tokens = int64_t(s.request.prompt.size());
  out.cached_tokens = s.cached_tokens;
  out.completion_tokens = s.generated;
  const Clock::time_point now = Clock::now();
  out.total_s = seconds_between(s.submitted, now);
  if (s.generated > 0) out.time_to_first_token_s = seconds_between(s.submitted, s.first_token);
  backend->release_slot(slot);
  auto on_finish = std::move(s.request.on_finish);
  const uint64_t id = s.id;
  const bool had_first = s.generated > 0;
  s.busy = false;
  s.request = GenerationRequest{};
  s.sampler.reset();
  s.context.clear();
  {
    std::lock_guard<std::mutex> lk(mu);
    live.erase(id);
    stats.active = busy_count();
  }
  record_finish(out, had_first);
  if (on_finish) on_finish(out);
}

void Scheduler::Engine::start_sequence(int64_t slot, WaitingRequest&& w) {
  RunningSequence& s = slots[size_t(slot)];
  s.busy = true;
  s.id = w.id;
  s.request = std::move(w.request);
  s.sampler.emplace(s.request.sampling);
  s.context.clear();
  s.context.reserve(s.request.prompt.size() + size_t(s.request.max_tokens));
  s.context.assign(s.request.prompt.begin(), s.request.prompt.end());
  s.generated = 0;
  s.submitted = w.submitted;
  s.deadline = w.deadline;
  s.has_deadline = w.has_deadline;
  float* row = logits.data() + slot * V;
  try {
    backend->prefill_slot(*model, slot, s.request.prompt, row);
    s.cached_tokens = backend->cached_tokens(slot);
  } catch (const std::exception& e) {
    retire(slot, FinishReason::Error, str_cat("prefill failed: ", e.what()));
    return;
  }
  pending_prompt += s.request.prompt.size();
  sample_and_emit(slot, row);
}

void Scheduler::Engine::sample_and_emit(int64_t slot, float* row) {
  RunningSequence& s = slots[size_t(slot)];
  GeneratedToken ev;
  const int top_n = s.request.top_logprobs;
  // Log-probabilities come from the raw logits: sample() applies the penalties in place.
  if (top_n >= 0) Sampler::log_softmax(row, V, logprob_scratch.data());
  ev.id = s.sampler->sample(row, V, s.context);
  ev.index = s.generated;
  if (top_n >= 0) {
    ev.logprob = logprob_scratch[size_t(ev.id)];
    if (top_n > 0) {
      for (int64_t v = 0; v < V; ++v) top_scratch[size_t(v)] = {int32_t(v), logprob_scratch[size_t(v)]};
      std::partial_sort(top_scratch.begin(), top_scratch.begin() + top_n, top_scratch.end(),
                        [](const TokenLogprob& a, const TokenLogprob& b) {
                          return a.logprob > b.logprob || (a.logprob == b.logprob && a.id < b.id);
                        });
      ev.top = std::span<const TokenLogprob>(top_scratch.data(), size_t(top_n));
    }
  }
  s.context.push_back(ev.id);
  if (s.generated == 0) s.first_token = Clock::now();
  ++s.generated;
  ++pending_generated;
  bool keep_going = true;
  if (s.request.on_token) {
    try {
      keep_going = s.request.on_token(ev);
    } catch (const std::exception& e) {
      retire(slot, FinishReason::Error, str_cat("token callback failed: ", e.what()));
      return;
    }
  }
  const auto& stops = s.request.stop_ids;
  if (!keep_going || std::find(stops.begin(), stops.end(), ev.id) != stops.end())
    retire(slot, FinishReason::Stop, "");
  else if (s.generated >= s.request.max_tokens)
    retire(slot, FinishReason::Length, "");
  else
    s.next_token = ev.id;
}

void Scheduler::Engine::run() {
  set_num_threads(threads);  // OpenMP settings are per thread: take the creator's
  for (;;) {
    admitted.clear();
    dropped.clear();
    cancels.clear();
    bool stop_now = false;
    {
      std::unique_lock<std::mutex> lk(mu);
      flush_pending_stats();
      const int64_t busy = busy_count();
      // Sleep only when there is nothing to decode; the timeout bounds how late a waiting
      // request's deadline is noticed.
      wake.wait_for(lk, std::chrono::milliseconds(100), [&] {
        return stopping || !cancel_requests.empty() || busy > 0 || (!waiting.empty() && busy < S);
      });
      stop_now = stopping;
      cancels.swap(cancel_requests);
      const Clock::time_point now = Clock::now();
      // Cancelled / timed-out waiting requests leave the queue.
      for (auto it = waiting.begin(); it != waiting.end();) {
        const bool cancelled = std::find(cancels.begin(), cancels.end(), it->id) != cancels.end();
        if (stop_now || cancelled || (it->has_deadline && now >= it->deadline)) {
          dropped.push_back(std::move(*it));
          it = waiting.erase(it);
        } else {
          ++it;
        }
      }
      if (!stop_now) {
        int64_t free_slots = S - busy_count();
        int64_t budget = opt.prefill_token_budget;
        while (free_slots > 0 && !waiting.empty()) {
          const int64_t n = int64_t(waiting.front().request.prompt.size());
          if (!admitted.empty() && n > budget) break;  // FIFO: no overtaking by short prompts
          budget -= n;
          admitted.push_back(std::move(waiting.front()));
          waiting.pop_front();
          --free_slots;
        }
      }
      // Admitted requests hold their slots from here on: submit() must not see them as free
      // between leaving the queue and their prefill.
      stats.active = busy_count() + int64_t(admitted.size());
      stats.queued = int64_t(waiting.size());
    }
    const Clock::time_point now = Clock::now();
    for (auto& w : dropped) {
      const bool timed_out = !stop_now && w.has_deadline && now >= w.deadline &&
                             std::find(cancels.begin(), cancels.end(), w.id) == cancels.end();
      if (timed_out) finish_waiting(w, FinishReason::Timeout, "timed out waiting for a slot");
      else finish_waiting(w, FinishReason::Cancelled, stop_now ? "scheduler stopped" : "cancelled");
    }
    for (int64_t s = 0; s < S; ++s) {
      RunningSequence& q = slots[size_t(s)];
      if (!q.busy) continue;
      if (stop_now) retire(s, FinishReason::Cancelled, "scheduler stopped");
      else if (std::find(cancels.begin(), cancels.end(), q.id) != cancels.end())
        retire(s, FinishReason::Cancelled, "cancelled");
      else if (q.has_deadline && now >= q.deadline)
        retire(s, FinishReason::Timeout, "timed out while generating");
    }
    if (stop_now) break;

    // Admit: prefill each new sequence into a free slot and sample its first token.
    for (auto& w : admitted) {
      int64_t slot = 0;
      while (slots[size_t(slot)].busy) ++slot;
      start_sequence(slot, std::move(w));
    }
    {
      std::lock_guard<std::mutex> lk(mu);
      stats.active = busy_count();
      stats.peak_active = std::max(stats.peak_active, stats.active);
    }

    // One decode step over every running sequence.
    int64_t n_active = 0;
    for (int64_t s = 0; s < S; ++s) {
      active[size_t(s)] = slots[size_t(s)].busy ? 1 : 0;
      next_ids[size_t(s)] = slots[size_t(s)].next_token;
      n_active += active[size_t(s)];
    }
    if (n_active == 0) continue;
    float* rows = nullptr;
    try {
      rows = backend->decode_active_rows(*model, next_ids.data(), active.data(), logits.data(),
                                         row_of.data());
    } catch (const std::exception& e) {
      for (int64_t s = 0; s < S; ++s)
        if (active[size_t(s)]) retire(s, FinishReason::Error, str_cat("decode failed: ", e.what()));
      continue;
    }
    ++pending_steps;
    for (int64_t s = 0; s < S; ++s)
      if (active[size_t(s)] && slots[size_t(s)].busy)
        sample_and_emit(s, rows + row_of[size_t(s)] * V);
  }
  std::lock_guard<std::mutex> lk(mu);
  stats.active = 0;
  stats.queued = 0;
}

Scheduler::Scheduler(std::unique_ptr<Model> model, const SchedulerOptions& options)
    : engine_(std::make_unique<Engine>(std::move(model), options)) {
  engine_->thread = std::thread([e = engine_.get()] { e->run(); });
}

Scheduler::~Scheduler() { stop(); }

void Scheduler::stop() {
  {
    std::lock_guard<std::mutex> lk(engine_->mu);
    engine_->stopping = true;
  }
  engine_->wake.notify_all();
  if (engine_->thread.joinable()) engine_->thread.join();
}

void Scheduler::validate(const GenerationRequest& request) const { engine_->validate(request); }

uint64_t Scheduler::submit(GenerationRequest request) {
  engine_->validate(request);
  WaitingRequest w;
  w.submitted = Clock::now();
  if (request.timeout_s > 0) {
    w.has_deadline = true;
    w.deadline = w.submitted + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(request.timeout_s));
  }
  w.request = std::move(request);
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lk(engine_->mu);
    if (engine_->stopping)
      throw SubmitError(SubmitError::Kind::ShuttingDown, "the scheduler is shutting down");
    const int64_t free_slots = engine_->S - engine_->stats.active;
    if (int64_t(engine_->waiting.size()) >= engine_->opt.max_queue + std::max<int64_t>(free_slots, 0))
      throw SubmitError(SubmitError::Kind::QueueFull,
                        str_cat("too many requests: ", engine_->waiting.size(),
                                " are already waiting for one of ", engine_->S, " slots"));
    id = w.id = engine_->next_id++;
    engine_->live.insert(id);
    engine_->waiting.push_back(std::move(w));
    ++engine_->stats.requests_submitted;
    engine_->stats.queued = int64_t(engine_->waiting.size());
  }
  engine_->wake.notify_all();
  return id;
}

bool Scheduler::cancel(uint64_t id) {
  {
    std::lock_guard<std::mutex> lk(engine_->mu);
    if (!engine_->live.count(id)) return false;
    engine_->cancel_requests.push_back(id);
  }
  engine_->wake.notify_all();
  return true;
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard<std::mutex> lk(engine_->mu);
  return engine_->stats;
}

const ModelConfig& Scheduler::config() const { return engine_->model->config(); }
int64_t Scheduler::max_context() const { return engine_->Lmax; }
int64_t Scheduler::max_concurrent() const { return engine_->S; }

// ---------------------------------------------------------------------------------------------
// Prometheus text format (version 0.0.4).
namespace {
void prometheus_histogram(std::ostringstream& os, const char* name, const char* help,
                          const LatencyHistogram& h) {
  os << "# HELP " << name << ' ' << help << "\n# TYPE " << name << " histogram\n";
  uint64_t cumulative = 0;
  for (size_t b = 0; b < h.counts.size(); ++b) {
    cumulative += h.counts[b];
    os << name << "_bucket{le=\"";
    if (b < LatencyHistogram::kBounds.size()) os << LatencyHistogram::kBounds[b];
    else os << "+Inf";
    os << "\"} " << cumulative << '\n';
  }
  os << name << "_sum " << h.sum << '\n' << name << "_count " << h.count << '\n';
}

void prometheus_scalar(std::ostringstream& os, const char* name, const char* type,
                       const char* help, double value) {
  os << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n'
     << name << ' ' << value << '\n';
}
}  // namespace

std::string scheduler_stats_prometheus(const SchedulerStats& s) {
  std::ostringstream os;
  os.precision(10);
  prometheus_scalar(os, "deltamoe_slots", "gauge", "Decode slots (max concurrent sequences).",
                    double(s.max_concurrent));
  prometheus_scalar(os, "deltamoe_requests_queued", "gauge", "Requests waiting for a slot.",
                    double(s.queued));
  prometheus_scalar(os, "deltamoe_requests_active", "gauge", "Requests holding a slot.",
                    double(s.active));
  prometheus_scalar(os, "deltamoe_requests_active_peak", "gauge",
                    "Most requests holding a slot at once.", double(s.peak_active));
  prometheus_scalar(os, "deltamoe_requests_submitted_total", "counter", "Requests accepted.",
                    double(s.requests_submitted));
  os << "# HELP deltamoe_requests_finished_total Requests finished, by reason.\n"
        "# TYPE deltamoe_requests_finished_total counter\n";
  for (int r = 0; r < kFinishReasonCount; ++r)
    os << "deltamoe_requests_finished_total{finish_reason=\""
       << finish_reason_name(FinishReason(r)) << "\"} " << s.requests_finished[size_t(r)] << '\n';
  prometheus_scalar(os, "deltamoe_prompt_tokens_total", "counter", "Prompt tokens prefilled.",
                    double(s.prompt_tokens));
  prometheus_scalar(os, "deltamoe_generation_tokens_total", "counter", "Tokens generated.",
                    double(s.generated_tokens));
  prometheus_scalar(os, "deltamoe_decode_steps_total", "counter", "Batched decode steps run.",
                    double(s.decode_steps));
  prometheus_histogram(os, "deltamoe_time_to_first_token_seconds",
                       "Submit to first generated token.", s.time_to_first_token);
  prometheus_histogram(os, "deltamoe_request_latency_seconds", "Submit to finish.",
                       s.request_latency);
  return os.str();
}

}  // namespace dm
