// Continuous-batching scheduler (SPEC §5): one engine thread owns the Model and a DecodeState
// of `max_concurrent` slots. Callers submit requests from any thread; every engine iteration
//   1. drops cancelled / timed-out requests (waiting or running),
//   2. admits waiting requests into free slots, FIFO, prefilling at most `prefill_token_budget`
//      prompt tokens per iteration (always at least one request) so that running sequences keep
//      decoding while long prompts arrive,
//   3. runs ONE decode step over all running slots, samples each sequence with its own Sampler,
//      hands the token to the request's callback and retires finished sequences, whose slot is
//      reused by the next iteration.
// Callbacks run on the engine thread, outside the scheduler's lock (they may call cancel or
// submit), and must be quick: they sit inside the batch loop.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "infer/sampler.h"
#include "model/model.h"

namespace dm {

enum class FinishReason { Stop, Length, Cancelled, Timeout, Error };
constexpr int kFinishReasonCount = 5;
// "stop", "length", "cancelled", "timeout", "error".
const char* finish_reason_name(FinishReason reason);

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;
};

// One generated token as the per-token callback sees it. `logprob` and `top` are filled when the
// request asked for log-probabilities (top_logprobs ≥ 0); they come from the unpenalised,
// temperature-1 distribution. `top` points into engine scratch valid during the callback only.
struct GeneratedToken {
  int32_t id = 0;
  int64_t index = 0;  // 0-based among this request's generated tokens
  float logprob = 0;
  std::span<const TokenLogprob> top;  // most likely first
};

struct RequestOutcome {
  FinishReason finish_reason = FinishReason::Stop;
  std::string error;  // why, for Error / Timeout / Cancelled
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens reused from the prefix cache
  int64_t completion_tokens = 0;
  double time_to_first_token_s = -1;  // −1: no token was generated
  double total_s = 0;                 // submit → finish
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int64_t max_tokens = 16;
  std::vector<int32_t> stop_ids;  // finish (reason stop) right after emitting one of these
  int top_logprobs = -1;          // −1: none; 0: the chosen token's; N: also the N most likely
  double timeout_s = 0;           // 0 = none; counted from submit, waiting time included
  // Every new token; return false to finish the request now with reason stop (e.g. a stop
  // string completed in the detokenised text).
  std::function<bool(const GeneratedToken&)> on_token;
  // Exactly once per accepted request (not for requests submit() rejects).
  std::function<void(const RequestOutcome&)> on_finish;
};

// What submit() throws for a request it does not accept.
class SubmitError : public Error {
 public:
  enum class Kind { Invalid, ContextLength, QueueFull, ShuttingDown };
  SubmitError(Kind kind, const std::string& what) : Error(what), kind(kind) {}
  Kind kind;
};

struct SchedulerOptions {
  int64_t max_concurrent = 16;          // decode slots (sequences decoded together)
  int64_t max_context = 0;              // tokens per sequence, prompt + max_tokens; 0 = model's
  int64_t max_queue = 256;              // waiting requests beyond the slots; more → QueueFull
  int64_t prefill_token_budget = 4096;  // prompt tokens prefilled per iteration (≥ 1 request)
  // Hybrid prefix cache (infer/prefix_cache.h): bytes for KDA checkpoints + the latent pages
  // they pin, on top of the slots' pages; 0 = off. Prompts sharing a cached prefix prefill only
  // the rest (RequestOutcome::cached_tokens).
  size_t prefix_cache_bytes = 0;
  // Where the cache lives and decoding runs (infer/decode_backend.h): "cpu", or "cuda" (the GPU
  // decoder: bf16 compute, chunked prefill, batched decode steps; no prefix cache).
  std::string device = "cpu";
};

// Fixed-bucket latency histogram in seconds (Prometheus `le` buckets; the last is +Inf).
struct LatencyHistogram {
  static constexpr std::array<double, 14> kBounds = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                     1.0,   2.5,  5.0,   10,   30,  60,  300};
  std::array<uint64_t, kBounds.size() + 1> counts{};  // per bucket (not cumulative)
  double sum = 0;
  uint64_t count = 0;
  void add(double seconds);
  // Upper bound of the bucket holding quantile q (0 when empty): coarse, for logs.
  double quantile_upper_bound(double q) const;
};

struct SchedulerStats {
  int64_t max_concurrent = 0;
  int64_t queued = 0;        // waiting for a slot
  int64_t active = 0;        // holding a slot
  int64_t peak_active = 0;   // most slots busy at once since start
  uint64_t requests_submitted = 0;
  std::array<uint64_t, kFinishReasonCount> requests_finished{};  // by FinishReason
  uint64_t prompt_tokens = 0;     // prefilled
  uint64_t generated_tokens = 0;  // sampled
  uint64_t decode_steps = 0;
  LatencyHistogram time_to_first_token;
  LatencyHistogram request_latency;
};

// Prometheus text exposition of the stats (metric names start with deltamoe_).
std::string scheduler_stats_prometheus(const SchedulerStats& stats);

class Scheduler {
 public:
  // Starts the engine thread. The cache holds max_concurrent × max_context tokens.
  explicit Scheduler(std::unique_ptr<Model> model, const SchedulerOptions& options = {});
  ~Scheduler();  // stop()
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Validates (prompt ids in the vocabulary, 1 ≤ max_tokens, prompt + max_tokens ≤
  // max_context, sampling ranges) and queues; returns the request id. Throws SubmitError.
  uint64_t submit(GenerationRequest request);
  // The checks submit() runs, without queueing.
  void validate(const GenerationRequest& request) const;
  // Finishes a waiting or running request with reason cancelled at the next iteration; false
  // when the id is unknown or already finished.
  bool cancel(uint64_t id);
  // Finishes every waiting and running request as cancelled and joins the engine thread; later
  // submits throw ShuttingDown. Idempotent.
  void stop();

  SchedulerStats stats() const;
  const ModelConfig& config() const;
  int64_t max_context() const;
  int64_t max_concurrent() const;

 private:
  struct Engine;
  std::unique_ptr<Engine> engine_;
};

}  // namespace dm
