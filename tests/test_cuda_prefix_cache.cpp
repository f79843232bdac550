// The GPU prefix cache (infer/cuda/prefix_cache_gpu.h) on random bf16 models: a prompt that
// shares a cached grid prefix restores it (KDA checkpoint + latent rows) and extends only the
// rest, and its last logits and the decode steps after it match a from-scratch prefill of the
// same prompt; which prefix is found (longest grid prefix shorter than the prompt), eviction
// under a small budget, the decode backend the server uses and the chat session. Skips without a
// GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <cstdio>
#include <vector>

#include "cuda_decode_test_util.h"
#include "infer/cuda/generation_session_gpu.h"
#include "infer/cuda/prefix_cache_gpu.h"
#include "infer/decode_backend.h"
#include "io/config.h"
#include "model/cuda/decode_gpu.h"
#include "model/cuda/generate_gpu.h"

using namespace dm;
using test::RowStats;

namespace {

constexpr int64_t kGrid = cuda::GpuPrefixCache::kDefaultGridTokens;  // 512

ModelConfig test_config() { return load_config(test::source_dir() + "/configs/test.json"); }

std::vector<int32_t> joined(const std::vector<int32_t>& a, int64_t keep,
                            const std::vector<int32_t>& b) {
  std::vector<int32_t> r(a.begin(), a.begin() + keep);
  r.insert(r.end(), b.begin(), b.end());
  return r;
}

// Prefills `prompt` into `slot` of `cached` through the cache and into a fresh decoder from
// scratch, then decodes `steps` tokens on both: the logits must agree within bf16 noise (the
// cached path runs the rest through extend(): the paged attention instead of the flash kernel).
void expect_same_as_scratch(cuda::GpuPrefixCache& cache, cuda::GpuDecoder& cached, int64_t slot,
                            const cuda::DeviceWeights& dw, const std::vector<int32_t>& prompt,
                            int64_t want_restored, const char* what) {
  const int64_t V = dw.config().vocab_size, n = int64_t(prompt.size()), steps = 6;
  cuda::GpuDecoder scratch(dw, 1, cached.max_length());
  std::vector<float> a(static_cast<size_t>(V)), b(static_cast<size_t>(V));
  EXPECT_EQ(cache.prefill(cached, slot, prompt.data(), n, a.data()), want_restored) << what;
  EXPECT_EQ(cached.length(slot), n) << what;
  scratch.prefill(0, prompt.data(), n, b.data());
  RowStats stats;
  stats.add(a.data(), b.data(), V);
  const std::vector<int32_t> next = test::random_tokens(steps, V, 99);
  std::vector<int32_t> tokens(static_cast<size_t>(cached.num_slots()), 0);
  std::vector<int> active(static_cast<size_t>(cached.num_slots()), 0);
  active[size_t(slot)] = 1;
  std::vector<float> rows(static_cast<size_t>(cached.num_slots() * V));
  for (int64_t s = 0; s < steps; ++s) {
    tokens[size_t(slot)] = next[size_t(s)];
    cached.step(tokens.data(), rows.data(), active.data());
    scratch.step(&next[size_t(s)], b.data());
    stats.add(rows.data() + slot * V, b.data(), V);
  }
  std::printf(
      "[          ] %s: %lld of %lld tokens restored; vs scratch rel RMS max %.2e, "
      "argmax agreement %.3f\n",
      what, (long long)want_restored, (long long)n, stats.worst, stats.agreement());
  EXPECT_LE(stats.worst, 2e-2) << what;
  EXPECT_GE(stats.agreement(), 0.85) << what;
}

}  // namespace

TEST(CudaPrefixCache, HitRestoresThePrefixAndMatchesScratch) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = test_config();
  auto model = test::bf16_model(c, 5);
  const cuda::DeviceWeights dw(model->weights());
  const int64_t V = c.vocab_size;
  cuda::GpuDecoder dec(dw, 3, 1400);
  cuda::GpuPrefixCache cache(dec, size_t(64) << 20);
  const std::vector<int32_t> a = test::random_tokens(1100, V, 1);
  const std::vector<int32_t> tail = test::random_tokens(70, V, 2);

  // A cold prompt: nothing restored, checkpoints at 512 and 1024 published.
  expect_same_as_scratch(cache, dec, 0, dw, a, 0, "cold prompt");
  EXPECT_EQ(cache.index().size(), 2);
  // 1024 shared tokens + 70 new ones (slot 1: not the slot the prefix was computed in).
  expect_same_as_scratch(cache, dec, 1, dw, joined(a, 1024, tail), 1024, "1024 shared");
  // 600 shared: the 512 grid prefix.
  expect_same_as_scratch(cache, dec, 2, dw, joined(a, 600, tail), 512, "600 shared");
  // Exactly a cached prefix: the longest SHORTER one is restored (the last token's logits must
  // be computed), and nothing new is checkpointed.
  const int64_t before = cache.index().size();
  expect_same_as_scratch(cache, dec, 0, dw, joined(a, 1024, {}), 512, "exactly 1024 cached");
  EXPECT_EQ(cache.index().size(), before);
  EXPECT_GE(cache.index().stats().hits, 3);
}

TEST(CudaPrefixCache, EvictsTheLeastRecentlyUsedLeaf) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = test_config();
  auto model = test::bf16_model(c, 6);
  const cuda::DeviceWeights dw(model->weights());
  const int64_t V = c.vocab_size;
  cuda::GpuDecoder dec(dw, 1, 1200);
  // Room for two entries.
  size_t entry_bytes = 0;
  {
    cuda::GpuPrefixCache probe(dec, size_t(16) << 20);
    entry_bytes = probe.index().entry_bytes();
  }
  cuda::GpuPrefixCache cache(dec, 2 * entry_bytes + entry_bytes / 2);
  ASSERT_EQ(cache.index().capacity(), 2);
  const std::vector<int32_t> a = test::random_tokens(1100, V, 3);
  const std::vector<int32_t> other = test::random_tokens(600, V, 4);
  std::vector<float> logits(static_cast<size_t>(V));
  EXPECT_EQ(cache.prefill(dec, 0, a.data(), int64_t(a.size()), logits.data()), 0);
  EXPECT_EQ(cache.index().size(), 2);
  // A different prompt needs one entry: the LRU leaf (a's 1024 prefix) goes.
  EXPECT_EQ(cache.prefill(dec, 0, other.data(), int64_t(other.size()), logits.data()), 0);
  EXPECT_EQ(cache.index().size(), 2);
  EXPECT_EQ(cache.index().stats().evicted, 1);
  const std::vector<int32_t> again = joined(a, 1024, test::random_tokens(30, V, 5));
  expect_same_as_scratch(cache, dec, 0, dw, again, 512, "after eviction");
}

// The server's backend: `serve --device cuda --prefix-cache-mib N` goes through this.
TEST(CudaPrefixCache, DecodeBackendReportsCachedTokens) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = test_config();
  auto model = test::bf16_model(c, 7);
  const int64_t V = c.vocab_size;
  auto backend = make_decode_backend("cuda", *model, 2, 1300, size_t(32) << 20);
  const std::vector<int32_t> a = test::random_tokens(1100, V, 8);
  std::vector<float> row(static_cast<size_t>(V));
  backend->prefill_slot(*model, 0, a, row.data());
  EXPECT_EQ(backend->cached_tokens(0), 0);
  const std::vector<int32_t> b = joined(a, 1050, test::random_tokens(20, V, 9));
  backend->prefill_slot(*model, 1, b, row.data());
  EXPECT_EQ(backend->cached_tokens(1), 1024);
  EXPECT_TRUE(test::all_finite(row));
}

// `chat --device cuda`: turn 2's prompt is turn 1's prompt, its reply and a new message; the
// session restores turn 1's 512-token grid prefix and generates what a cold generate_gpu does.
TEST(CudaPrefixCache, GenerationSessionReusesTheConversation) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = test_config();
  auto model = test::bf16_model(c, 10);
  const cuda::DeviceWeights dw(model->weights());
  const int64_t V = c.vocab_size;
  cuda::GpuGenerationSession session(dw, size_t(32) << 20);
  GenerateOptions go;
  go.max_new_tokens = 12;
  go.sampling.temperature = 0;
  const std::vector<int32_t> turn1 = test::random_tokens(600, V, 11);
  const std::vector<int32_t> reply1 = session.generate(turn1, go);
  EXPECT_EQ(session.last_cached_tokens(), 0);
  EXPECT_EQ(reply1, cuda::generate_gpu(dw, turn1, go));
  std::vector<int32_t> turn2 = turn1;
  turn2.insert(turn2.end(), reply1.begin(), reply1.end());
  const std::vector<int32_t> message = test::random_tokens(40, V, 12);
  turn2.insert(turn2.end(), message.begin(), message.end());
  const std::vector<int32_t> reply2 = session.generate(turn2, go);
  EXPECT_EQ(session.last_cached_tokens(), kGrid);
  const std::vector<int32_t> cold = cuda::generate_gpu(dw, turn2, go);
  ASSERT_EQ(reply2.size(), cold.size());
  int64_t same = 0;
  for (size_t i = 0; i < cold.size(); ++i) same += reply2[i] == cold[i];
  std::printf(
      "[          ] chat session, turn 2: %lld of %zu prompt tokens restored, %lld / %zu "
      "reply tokens equal to a cold generation\n",
      (long long)session.last_cached_tokens(), turn2.size(), (long long)same, cold.size());
  EXPECT_EQ(reply2[0], cold[0]);
  EXPECT_GE(double(same), 0.9 * double(cold.size()));
}

#else
TEST(CudaPrefixCache, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
