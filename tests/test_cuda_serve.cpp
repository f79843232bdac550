// The continuous-batching scheduler on the GPU (SchedulerOptions::device = "cuda",
// infer/cuda/decode_backend_gpu.cpp) against one-sequence GPU generation (generate_gpu): more
// requests than slots (queueing, slot reuse), different prompt lengths, greedy; each request gets
// the tokens it gets alone (batched bf16 GEMMs may round differently from one-row ones, so a rare
// near-tie may flip: ≥ 95% of all tokens and every first token must match). Also: the GPU prefix
// cache through the scheduler. Skips without a GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <random>

#include "cuda_test_util.h"
#include "infer/generate.h"
#include "infer/scheduler.h"
#include "io/config.h"
#include "model/cuda/generate_gpu.h"
#include "model/model.h"
#include "test_util.h"

using namespace dm;

namespace {

std::unique_ptr<Model> random_model(uint64_t seed) {
  const ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  auto w = weights_allocate<float>(c);
  weights_init(*w, seed);
  return std::make_unique<Model>(std::move(w));
}

}  // namespace

TEST(CudaServe, BatchedGreedyMatchesOneSequenceGeneration) {
  DM_SKIP_WITHOUT_GPU();
  auto model = random_model(12);
  const ModelConfig c = model->config();
  std::mt19937_64 rng(4);
  const int n = 7, max_tokens = 12;
  std::vector<std::vector<int32_t>> prompts(n);
  for (int i = 0; i < n; ++i) {
    prompts[size_t(i)].resize(size_t(3 + 11 * i));
    for (auto& t : prompts[size_t(i)]) t = int32_t(rng() % uint64_t(c.vocab_size));
  }
  // References first (the scheduler takes the model).
  std::vector<std::vector<int32_t>> expected(n);
  {
    const cuda::DeviceWeights dw(model->weights());
    GenerateOptions go;
    go.max_new_tokens = max_tokens;
    go.sampling.temperature = 0;
    for (int i = 0; i < n; ++i) expected[size_t(i)] = cuda::generate_gpu(dw, prompts[size_t(i)], go);
  }
  SchedulerOptions so;
  so.device = "cuda";
  so.max_concurrent = 3;
  so.max_context = 128;
  Scheduler sched(std::move(model), so);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::vector<int32_t>> got(n);
  int done = 0;
  for (int i = 0; i < n; ++i) {
    GenerationRequest r;
    r.prompt = prompts[size_t(i)];
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    r.on_token = [&, i](const GeneratedToken& t) {
      std::lock_guard<std::mutex> lk(mu);
      got[size_t(i)].push_back(t.id);
      return true;
    };
    r.on_finish = [&](const RequestOutcome& o) {
      std::lock_guard<std::mutex> lk(mu);
      EXPECT_NE(o.finish_reason, FinishReason::Error) << o.error;
      ++done;
      cv.notify_all();
    };
    sched.submit(std::move(r));
  }
  {
    std::unique_lock<std::mutex> lk(mu);
    ASSERT_TRUE(cv.wait_for(lk, std::chrono::seconds(120), [&] { return done == n; }));
  }
  int same = 0, total = 0;
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(got[size_t(i)].size(), expected[size_t(i)].size()) << "request " << i;
    EXPECT_EQ(got[size_t(i)][0], expected[size_t(i)][0]) << "request " << i;
    for (size_t t = 0; t < got[size_t(i)].size(); ++t) same += got[size_t(i)][t] == expected[size_t(i)][t];
    total += int(got[size_t(i)].size());
  }
  std::printf("[          ] GPU scheduler (3 slots, %d requests): %d / %d greedy tokens equal to "
              "one-sequence GPU generation\n", n, same, total);
  EXPECT_GE(same, int(0.95 * total));
}

// `serve --device cuda` with a prefix cache: prompts sharing a 600-token prefix, one after
// another, so each later one restores the 512-token grid prefix (infer/cuda/prefix_cache_gpu.h)
// and still generates what a cold one-sequence generation does.
TEST(CudaServe, PrefixCacheHitsGiveTheColdTokens) {
  DM_SKIP_WITHOUT_GPU();
  auto model = random_model(13);
  const int64_t V = model->config().vocab_size;
  std::mt19937_64 rng(8);
  std::vector<int32_t> shared(600);
  for (auto& t : shared) t = int32_t(rng() % uint64_t(V));
  const int n = 3, max_tokens = 10;
  std::vector<std::vector<int32_t>> prompts(n), expected(n);
  {
    const cuda::DeviceWeights dw(model->weights());
    GenerateOptions go;
    go.max_new_tokens = max_tokens;
    go.sampling.temperature = 0;
    for (int i = 0; i < n; ++i) {
      prompts[size_t(i)] = shared;
      for (int j = 0; j < 3 + i; ++j) prompts[size_t(i)].push_back(int32_t(rng() % uint64_t(V)));
      expected[size_t(i)] = cuda::generate_gpu(dw, prompts[size_t(i)], go);
    }
  }
  SchedulerOptions so;
  so.device = "cuda";
  so.max_concurrent = 2;
  so.max_context = 1024;
  so.prefix_cache_bytes = size_t(32) << 20;
  Scheduler sched(std::move(model), so);
  std::mutex mu;
  std::condition_variable cv;
  int64_t cached = 0, same = 0, total = 0;
  for (int i = 0; i < n; ++i) {  // one after another: each can hit what the first cached
    std::vector<int32_t> got;
    bool done = false;
    GenerationRequest r;
    r.prompt = prompts[size_t(i)];
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    r.on_token = [&](const GeneratedToken& t) {
      std::lock_guard<std::mutex> lk(mu);
      got.push_back(t.id);
      return true;
    };
    r.on_finish = [&](const RequestOutcome& o) {
      std::lock_guard<std::mutex> lk(mu);
      EXPECT_NE(o.finish_reason, FinishReason::Error) << o.error;
      if (i == 0) {
        EXPECT_EQ(o.cached_tokens, 0);
      }
      cached += o.cached_tokens;
      done = true;
      cv.notify_all();
    };
    sched.submit(std::move(r));
    std::unique_lock<std::mutex> lk(mu);
    ASSERT_TRUE(cv.wait_for(lk, std::chrono::seconds(60), [&] { return done; }));
    ASSERT_EQ(got.size(), expected[size_t(i)].size()) << "request " << i;
    EXPECT_EQ(got[0], expected[size_t(i)][0]) << "request " << i;
    for (size_t t = 0; t < got.size(); ++t) same += got[t] == expected[size_t(i)][t];
    total += int64_t(got.size());
  }
  std::printf(
      "[          ] GPU scheduler with a prefix cache: %lld cached prompt tokens, %lld / "
      "%lld greedy tokens equal to cold generation\n",
      (long long)cached, (long long)same, (long long)total);
  EXPECT_EQ(cached, 2 * 512);
  EXPECT_GE(double(same), 0.95 * double(total));
}

#endif  // DELTAMOE_HAVE_CUDA
