// Continuous-batching scheduler (infer/scheduler.h) against dm::generate, the one-sequence
// reference: batched greedy decoding gives each request exactly the tokens it gets alone, with
// all slots busy and with more requests than slots (queueing, slot reuse); late arrivals join a
// running batch; cancel frees the slot; seeds make sampling reproducible; bad requests are
// rejected before queueing; timeouts and logprobs.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>

#include "infer/generate.h"
#include "infer/scheduler.h"
#include "serve_test_util.h"

using namespace dm;

namespace {

// Collects what the callbacks of a batch of requests report.
struct SchedulerTestCollector {
  struct Result {
    std::vector<int32_t> tokens;
    std::vector<GeneratedToken> events;  // `top` not kept
    std::vector<std::vector<TokenLogprob>> tops;
    RequestOutcome outcome;
    bool done = false;
  };
  explicit SchedulerTestCollector(size_t n) : results(n) {}

  GenerationRequest make(size_t i, std::vector<int32_t> prompt, int64_t max_tokens,
                         SamplingParams sp = greedy()) {
    GenerationRequest r;
    r.prompt = std::move(prompt);
    r.max_tokens = max_tokens;
    r.sampling = sp;
    r.on_token = [this, i](const GeneratedToken& t) {
      std::lock_guard<std::mutex> lk(mu);
      results[i].tokens.push_back(t.id);
      results[i].events.push_back(t);
      results[i].tops.emplace_back(t.top.begin(), t.top.end());
      cv.notify_all();
      return true;
    };
    r.on_finish = [this, i](const RequestOutcome& o) {
      std::lock_guard<std::mutex> lk(mu);
      results[i].outcome = o;
      results[i].done = true;
      cv.notify_all();
    };
    return r;
  }
  static SamplingParams greedy() {
    SamplingParams sp;
    sp.temperature = 0;
    return sp;
  }
  // Waits (≤ 60 s) until request i is done.
  bool wait_done(size_t i) {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, std::chrono::seconds(60), [&] { return results[i].done; });
  }
  bool wait_tokens(size_t i, size_t n) {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, std::chrono::seconds(60),
                       [&] { return results[i].tokens.size() >= n || results[i].done; });
  }
  size_t tokens_of(size_t i) {
    std::lock_guard<std::mutex> lk(mu);
    return results[i].tokens.size();
  }

  std::mutex mu;
  std::condition_variable cv;
  std::vector<Result> results;
};

std::vector<int32_t> random_prompt(std::mt19937& rng, int64_t length, int64_t vocab) {
  std::uniform_int_distribution<int32_t> id(0, int32_t(vocab - 1));
  std::vector<int32_t> p(static_cast<size_t>(length));
  for (auto& t : p) t = id(rng);
  return p;
}

// 16 requests of different prompt lengths and budgets submitted together: each gets exactly
// the greedy tokens of generate() alone. With `slots` < 16 the rest queue and reuse slots.
void expect_batched_greedy_equals_alone(int64_t slots) {
  auto reference = test::serve_test_model();
  const int64_t V = reference->config().vocab_size;
  std::mt19937 rng(1234);
  const size_t N = 16;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> budgets;
  std::vector<std::vector<int32_t>> expected;
  for (size_t i = 0; i < N; ++i) {
    prompts.push_back(random_prompt(rng, int64_t(1 + (i * 7) % 37), V));
    budgets.push_back(int64_t(6 + (i * 5) % 19));
    GenerateOptions go;
    go.max_new_tokens = budgets.back();
    go.sampling.temperature = 0;
    expected.push_back(generate(*reference, prompts.back(), go));
  }
  SchedulerOptions so;
  so.max_concurrent = slots;
  so.max_context = 128;
  so.prefill_token_budget = 64;  // several iterations of admission when all arrive at once
  Scheduler sched(test::serve_test_model(), so);
  SchedulerTestCollector col(N);
  for (size_t i = 0; i < N; ++i) sched.submit(col.make(i, prompts[i], budgets[i]));
  for (size_t i = 0; i < N; ++i) {
    ASSERT_TRUE(col.wait_done(i)) << "request " << i;
    const auto& r = col.results[i];
    EXPECT_EQ(r.tokens, expected[i]) << "request " << i << " (prompt " << prompts[i].size()
                                     << " tokens, slots " << slots << ")";
    EXPECT_EQ(r.outcome.finish_reason, FinishReason::Length);
    EXPECT_EQ(r.outcome.completion_tokens, budgets[i]);
    EXPECT_EQ(r.outcome.prompt_tokens, int64_t(prompts[i].size()));
    EXPECT_GE(r.outcome.time_to_first_token_s, 0.0);
    EXPECT_GE(r.outcome.total_s, r.outcome.time_to_first_token_s);
  }
  const SchedulerStats st = sched.stats();
  EXPECT_EQ(st.requests_finished[size_t(FinishReason::Length)], N);
  // Admission is spread over iterations by the prefill budget, and short requests finish
  // meanwhile, so not all 16 need to run at once; a full queue keeps every slot busy.
  EXPECT_LE(st.peak_active, slots);
  EXPECT_GE(st.peak_active, std::min<int64_t>(slots, 5));
  int64_t generated = 0;
  for (auto b : budgets) generated += b;
  EXPECT_EQ(int64_t(st.generated_tokens), generated);
  // Batching: far fewer decode steps than tokens (each step serves every running sequence).
  EXPECT_LT(int64_t(st.decode_steps), generated / 2);
  EXPECT_EQ(st.request_latency.count, N);
  std::printf("  slots %lld: %llu decode steps for %lld tokens of 16 requests\n", (long long)slots,
              (unsigned long long)st.decode_steps, (long long)generated);
}

}  // namespace

TEST(Scheduler, SixteenGreedyRequestsTogetherEqualGenerateAlone) {
  expect_batched_greedy_equals_alone(16);
}

// Prompts sharing a long prefix: with the prefix cache on, later ones reuse the cached grid
// prefix (cached_tokens > 0) and still give exactly the tokens of a cold `generate`.
TEST(Scheduler, PrefixCacheHitsGiveColdTokens) {
  auto reference = test::serve_test_model();
  const int64_t V = reference->config().vocab_size;
  std::mt19937 rng(77);
  const std::vector<int32_t> shared = random_prompt(rng, 70, V);  // one 64-token grid prefix
  std::vector<std::vector<int32_t>> prompts, expected;
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> p = shared;
    const auto tail = random_prompt(rng, 3 + i, V);
    p.insert(p.end(), tail.begin(), tail.end());
    prompts.push_back(p);
    GenerateOptions go;
    go.max_new_tokens = 8;
    go.sampling.temperature = 0;
    expected.push_back(generate(*reference, p, go));
  }
  SchedulerOptions so;
  so.max_concurrent = 2;
  so.max_context = 128;
  so.prefix_cache_bytes = size_t(8) << 20;
  Scheduler sched(test::serve_test_model(), so);
  SchedulerTestCollector col(prompts.size());
  int64_t cached = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {  // one after another: each can hit the last
    sched.submit(col.make(i, prompts[i], 8));
    ASSERT_TRUE(col.wait_done(i));
    EXPECT_EQ(col.results[i].tokens, expected[i]) << "request " << i;
    if (i == 0) EXPECT_EQ(col.results[i].outcome.cached_tokens, 0);
    cached += col.results[i].outcome.cached_tokens;
  }
  EXPECT_EQ(cached, 3 * 64);  // requests 1..3 reuse the 64-token grid prefix
}

TEST(Scheduler, MoreRequestsThanSlotsQueueAndReuseSlots) {
  expect_batched_greedy_equals_alone(5);
}

TEST(Scheduler, LateArrivalsJoinTheRunningBatch) {
  auto reference = test::serve_test_model();
  const std::vector<int32_t> long_prompt = {3, 1, 4, 1, 5}, late_prompt = {9, 2, 6, 5, 3, 5, 8};
  GenerateOptions go;
  go.max_new_tokens = 12;
  go.sampling.temperature = 0;
  const auto late_expected = generate(*reference, late_prompt, go);

  SchedulerOptions so;
  so.max_concurrent = 4;
  so.max_context = 4096;
  Scheduler sched(test::serve_test_model(), so);
  SchedulerTestCollector col(3);
  // A runs until cancelled (4000 tokens are far more than the late requests need).
  const uint64_t a = sched.submit(col.make(0, long_prompt, 4000));
  ASSERT_TRUE(col.wait_tokens(0, 3));
  sched.submit(col.make(1, late_prompt, 12));
  sched.submit(col.make(2, late_prompt, 12));
  ASSERT_TRUE(col.wait_done(1));
  ASSERT_TRUE(col.wait_done(2));
  {
    std::lock_guard<std::mutex> lk(col.mu);
    // The late requests finished while A was still decoding, i.e. inside A's batch.
    ASSERT_FALSE(col.results[0].done);
  }
  EXPECT_TRUE(sched.cancel(a));
  ASSERT_TRUE(col.wait_done(0));
  EXPECT_EQ(col.results[0].outcome.finish_reason, FinishReason::Cancelled);
  EXPECT_GE(sched.stats().peak_active, 3);
  EXPECT_EQ(col.results[1].tokens, late_expected);
  EXPECT_EQ(col.results[2].tokens, late_expected);
  // A's tokens + 12 + 12 in about A's steps: had the late ones run after A (or after each
  // other) there would be ≥ 11 more.
  EXPECT_LE(sched.stats().decode_steps, uint64_t(col.results[0].outcome.completion_tokens) + 2);
}

TEST(Scheduler, CancelFreesTheSlot) {
  auto reference = test::serve_test_model();
  const std::vector<int32_t> prompt = {7, 7, 7};
  GenerateOptions go;
  go.max_new_tokens = 5;
  go.sampling.temperature = 0;
  const auto expected = generate(*reference, prompt, go);

  SchedulerOptions so;
  so.max_concurrent = 1;  // one slot: B and C wait until A's slot frees
  so.max_context = 4096;
  Scheduler sched(test::serve_test_model(), so);
  SchedulerTestCollector col(3);
  const uint64_t a = sched.submit(col.make(0, prompt, 4000));
  ASSERT_TRUE(col.wait_tokens(0, 2));
  const uint64_t b = sched.submit(col.make(1, prompt, 5));
  const uint64_t c = sched.submit(col.make(2, prompt, 5));
  EXPECT_TRUE(sched.cancel(c));  // still waiting
  EXPECT_TRUE(sched.cancel(a));  // running
  ASSERT_TRUE(col.wait_done(0));
  ASSERT_TRUE(col.wait_done(1));
  ASSERT_TRUE(col.wait_done(2));
  EXPECT_EQ(col.results[0].outcome.finish_reason, FinishReason::Cancelled);
  EXPECT_LT(col.results[0].outcome.completion_tokens, 4000);
  EXPECT_EQ(col.results[2].outcome.finish_reason, FinishReason::Cancelled);
  EXPECT_EQ(col.results[2].outcome.completion_tokens, 0);
  EXPECT_EQ(col.results[1].outcome.finish_reason, FinishReason::Length);
  EXPECT_EQ(col.results[1].tokens, expected);  // the freed slot serves B from a clean prefill
  EXPECT_FALSE(sched.cancel(a));               // already finished
  EXPECT_FALSE(sched.cancel(b + 1000));        // never existed
  EXPECT_EQ(sched.stats().requests_finished[size_t(FinishReason::Cancelled)], 2u);
}

TEST(Scheduler, SeedsMakeSampledOutputsReproducible) {
  auto reference = test::serve_test_model();
  const std::vector<int32_t> prompt = {10, 20, 30, 40};
  SamplingParams sp;
  sp.temperature = 1.0f;
  sp.top_k = 64;
  sp.top_p = 0.95f;
  sp.seed = 42;
  GenerateOptions go;
  go.max_new_tokens = 24;
  go.sampling = sp;
  const auto expected = generate(*reference, prompt, go);

  Scheduler sched(test::serve_test_model(), SchedulerOptions{4, 128, 16, 4096});
  SchedulerTestCollector col(3);
  SamplingParams other = sp;
  other.seed = 43;
  sched.submit(col.make(0, prompt, 24, sp));
  sched.submit(col.make(1, prompt, 24, other));
  sched.submit(col.make(2, prompt, 24, sp));
  for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(col.wait_done(i));
  EXPECT_EQ(col.results[0].tokens, col.results[2].tokens);  // same seed, batched together
  EXPECT_EQ(col.results[0].tokens, expected);               // and as generate() alone
  EXPECT_NE(col.results[0].tokens, col.results[1].tokens);  // another seed, another sample
}

TEST(Scheduler, RejectsInvalidRequestsBeforeQueueing) {
  SchedulerOptions so;
  so.max_concurrent = 1;
  so.max_context = 4096;
  so.max_queue = 0;
  Scheduler sched(test::serve_test_model(), so);
  const int64_t V = sched.config().vocab_size;
  auto kind_of = [&](GenerationRequest r) {
    try {
      sched.submit(std::move(r));
    } catch (const SubmitError& e) {
      EXPECT_FALSE(std::string(e.what()).empty());
      return int(e.kind);
    }
    return -1;
  };
  auto request = [](std::vector<int32_t> prompt, int64_t max_tokens) {
    GenerationRequest r;
    r.prompt = std::move(prompt);
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    return r;
  };
  using K = SubmitError::Kind;
  EXPECT_EQ(kind_of(request({}, 4)), int(K::Invalid));
  EXPECT_EQ(kind_of(request({1, int32_t(V)}, 4)), int(K::Invalid));
  EXPECT_EQ(kind_of(request({1, -3}, 4)), int(K::Invalid));
  EXPECT_EQ(kind_of(request({1, 2}, 0)), int(K::Invalid));
  EXPECT_EQ(kind_of(request({1, 2}, -5)), int(K::Invalid));
  EXPECT_EQ(kind_of(request(std::vector<int32_t>(4000, 1), 97)), int(K::ContextLength));
  GenerationRequest bad_sampling = request({1}, 2);
  bad_sampling.sampling.top_p = 0;
  EXPECT_EQ(kind_of(std::move(bad_sampling)), int(K::Invalid));
  EXPECT_EQ(sched.stats().requests_submitted, 0u);
  // One slot and no queue: the first fits, the second is turned away.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  GenerationRequest first = request({1, 2, 3}, 4000);  // runs until cancelled below
  first.on_finish = [&](const RequestOutcome&) {
    std::lock_guard<std::mutex> lk(mu);
    done = true;
    cv.notify_all();
  };
  EXPECT_EQ(kind_of(std::move(first)), -1);
  EXPECT_EQ(kind_of(request({1, 2, 3}, 50)), int(K::QueueFull));
  EXPECT_TRUE(sched.cancel(1));  // ids count from 1
  std::unique_lock<std::mutex> lk(mu);
  ASSERT_TRUE(cv.wait_for(lk, std::chrono::seconds(60), [&] { return done; }));
  lk.unlock();
  sched.stop();
  EXPECT_EQ(kind_of(request({1}, 2)), int(K::ShuttingDown));
}

TEST(Scheduler, StopIdsCallbackStopTimeoutAndLogprobs) {
  auto reference = test::serve_test_model();
  const std::vector<int32_t> prompt = {5, 6, 7, 8};
  GenerateOptions go;
  go.max_new_tokens = 10;
  go.sampling.temperature = 0;
  const auto expected = generate(*reference, prompt, go);

  SchedulerOptions so;
  so.max_concurrent = 2;
  so.max_context = 4096;
  Scheduler sched(test::serve_test_model(), so);
  SchedulerTestCollector col(4);
  // (0) stop id: ends right after the first occurrence of expected[4].
  GenerationRequest r0 = col.make(0, prompt, 10);
  r0.stop_ids = {expected[4]};
  const size_t first_hit = size_t(std::find(expected.begin(), expected.end(), expected[4]) - expected.begin());
  // (1) the token callback ends it after 3 tokens; logprobs with the 5 most likely.
  GenerationRequest r1 = col.make(1, prompt, 10);
  r1.top_logprobs = 5;
  auto inner = r1.on_token;
  r1.on_token = [inner](const GeneratedToken& t) { return inner(t) && t.index < 2; };
  sched.submit(std::move(r0));
  sched.submit(std::move(r1));
  ASSERT_TRUE(col.wait_done(0));
  ASSERT_TRUE(col.wait_done(1));
  EXPECT_EQ(col.results[0].outcome.finish_reason, FinishReason::Stop);
  EXPECT_EQ(col.results[0].tokens, std::vector<int32_t>(expected.begin(), expected.begin() + std::ptrdiff_t(first_hit) + 1));
  EXPECT_EQ(col.results[1].outcome.finish_reason, FinishReason::Stop);
  ASSERT_EQ(col.results[1].tokens.size(), 3u);
  for (size_t k = 0; k < 3; ++k) {
    const auto& ev = col.results[1].events[k];
    const auto& top = col.results[1].tops[k];
    ASSERT_EQ(top.size(), 5u);
    EXPECT_EQ(top[0].id, ev.id);  // greedy picks the most likely token
    EXPECT_FLOAT_EQ(top[0].logprob, ev.logprob);
    EXPECT_LE(ev.logprob, 0.0f);
    double mass = 0;
    for (size_t j = 0; j < top.size(); ++j) {
      mass += std::exp(double(top[j].logprob));
      if (j > 0) {
        EXPECT_GE(top[j - 1].logprob, top[j].logprob);
      }
    }
    EXPECT_LE(mass, 1.0 + 1e-5);
  }
  // (3) a timeout of 50 ms cannot finish 4000 tokens.
  GenerationRequest r3 = col.make(3, prompt, 4000);
  r3.timeout_s = 0.05;
  sched.submit(std::move(r3));
  ASSERT_TRUE(col.wait_done(3));
  EXPECT_EQ(col.results[3].outcome.finish_reason, FinishReason::Timeout);
  EXPECT_LT(col.results[3].outcome.completion_tokens, 4000);
  const std::string metrics = scheduler_stats_prometheus(sched.stats());
  EXPECT_NE(metrics.find("deltamoe_requests_finished_total{finish_reason=\"timeout\"} 1"), std::string::npos);
  // Whether the timed-out request got a first token depends on the machine's speed.
  const int with_first_token = 2 + (col.results[3].outcome.time_to_first_token_s >= 0 ? 1 : 0);
  EXPECT_NE(metrics.find(str_cat("deltamoe_time_to_first_token_seconds_bucket{le=\"+Inf\"} ",
                                 with_first_token)),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("deltamoe_request_latency_seconds_count 3"), std::string::npos);
}
