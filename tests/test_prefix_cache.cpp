// Paged latent cache and hybrid prefix cache (infer/decode.h, infer/prefix_cache.h, SPEC §5).
// Every check compares against a cold run in a decode state without a prefix cache (itself
// checked against ModelT::forward in test_decode.cpp): a prefix-cache hit gives the cold run's
// logits and greedy tokens; slots sharing cached pages decode together as they do alone; a tiny
// budget evicts and stays correct; running out of pages is reported; release returns pages; and
// the KDA checkpoints an extend takes equal the state of a prefill of that prefix.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>

#include "core/error.h"
#include "infer/decode.h"
#include "infer/prefix_cache.h"
#include "io/config.h"
#include "model/kda.h"
#include "model/model.h"
#include "test_util.h"

using namespace dm;

namespace {

// configs/test.json (4 layers: 3 KDA + 1 MLA, AttnRes, latent MoE) with random weights.
std::unique_ptr<Model> prefix_test_model() {
  const ModelConfig cfg = load_config(test::source_dir() + "/configs/test.json");
  auto w = weights_allocate<float>(cfg);
  weights_init(*w, 11);
  return std::make_unique<Model>(std::move(w));
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& t : ids) t = int32_t(rng() % uint32_t(vocab));
  return ids;
}

int32_t argmax(const float* v, int64_t n) { return int32_t(std::max_element(v, v + n) - v); }

// Prefill `prompt` into `slot`, then `steps` greedy decode steps of that slot alone; returns
// every logits row (prefill's last row first) and the greedy tokens.
struct GreedyRun {
  std::vector<float> logits;
  std::vector<int32_t> tokens;
};
GreedyRun greedy(Model& model, DecodeState& st, int64_t slot, const std::vector<int32_t>& prompt,
                 int steps) {
  const int64_t V = model.config().vocab_size, S = st.num_sequences;
  GreedyRun run;
  std::vector<float> row(static_cast<size_t>(V)), all(static_cast<size_t>(S * V));
  prefill(model, st, slot, prompt.data(), int64_t(prompt.size()), row.data());
  run.logits = row;
  std::vector<int32_t> next(size_t(S), 0);
  std::vector<int> active(size_t(S), 0);
  active[size_t(slot)] = 1;
  for (int s = 0; s < steps; ++s) {
    const int32_t id = argmax(run.logits.data() + s * V, V);
    run.tokens.push_back(id);
    next[size_t(slot)] = id;
    decode_step(model, st, next.data(), active.data(), all.data());
    run.logits.insert(run.logits.end(), all.begin() + slot * V, all.begin() + (slot + 1) * V);
  }
  return run;
}

GreedyRun cold_greedy(Model& model, const std::vector<int32_t>& prompt, int steps) {
  DecodeStateOptions options;
  options.page_tokens = 16;
  DecodeState cold(model.config(), 1, int64_t(prompt.size()) + steps + 1, options);
  return greedy(model, cold, 0, prompt, steps);
}

void expect_same_run(const GreedyRun& got, const GreedyRun& want, const std::string& what) {
  ASSERT_EQ(got.logits.size(), want.logits.size()) << what;
  EXPECT_LE(test::rel_rms(got.logits.data(), want.logits.data(), want.logits.size()), 1e-5)
      << what;
  EXPECT_EQ(got.tokens, want.tokens) << what;
}

}  // namespace

TEST(PrefixCache, HitGivesColdLogitsAndGreedyTokens) {
  auto model = prefix_test_model();
  const int64_t V = model->config().vocab_size;
  DecodeStateOptions options;
  options.page_tokens = 16;
  // Room for the slot (16 pages) and every prefix cached below (no eviction in this test).
  options.page_pool_bytes = 64 * DecodeState::page_bytes(model->config(), 16);
  DecodeState st(model->config(), 1, 256, options);
  st.enable_prefix_cache(size_t(64) << 20, /*grid_tokens=*/32);

  const std::vector<int32_t> a = random_tokens(150, V, 1);
  // b shares a's first 100 tokens: the longest cached grid prefix is 96.
  std::vector<int32_t> b(a.begin(), a.begin() + 100);
  for (int32_t t : random_tokens(40, V, 2)) b.push_back(t);
  // c differs from a at position 50 only: the tokens are verified, so only 32 are reused.
  std::vector<int32_t> c = a;
  c[50] = (c[50] + 1) % int32_t(V);

  const GreedyRun first = greedy(*model, st, 0, a, 6);
  EXPECT_EQ(st.cached_tokens[0], 0);
  expect_same_run(first, cold_greedy(*model, a, 6), "cold a");
  EXPECT_EQ(st.prefix_cache->size(), 4);  // prefixes of 32, 64, 96, 128 tokens

  const GreedyRun again = greedy(*model, st, 0, a, 6);
  EXPECT_EQ(st.cached_tokens[0], 128);
  expect_same_run(again, first, "a again (128 cached)");

  const GreedyRun hit_b = greedy(*model, st, 0, b, 6);
  EXPECT_EQ(st.cached_tokens[0], 96);
  expect_same_run(hit_b, cold_greedy(*model, b, 6), "b (96 cached)");

  const GreedyRun hit_c = greedy(*model, st, 0, c, 6);
  EXPECT_EQ(st.cached_tokens[0], 32);
  expect_same_run(hit_c, cold_greedy(*model, c, 6), "c (32 cached)");

  // A prompt that is exactly a cached prefix: one token must still be computed, and nothing new
  // is cached.
  const int64_t entries = st.prefix_cache->size();
  const std::vector<int32_t> a96(a.begin(), a.begin() + 96);
  const GreedyRun hit_a96 = greedy(*model, st, 0, a96, 3);
  EXPECT_EQ(st.cached_tokens[0], 64);
  EXPECT_EQ(st.prefix_cache->size(), entries);
  expect_same_run(hit_a96, cold_greedy(*model, a96, 3), "a[:96] (64 cached)");
  EXPECT_GE(st.prefix_cache->stats().hits, 4);
  EXPECT_EQ(st.prefix_cache->stats().evicted, 0);
}

TEST(PrefixCache, SlotsSharingCachedPagesDecodeTogetherAsAlone) {
  auto model = prefix_test_model();
  const int64_t V = model->config().vocab_size, S = 3, steps = 7;
  DecodeStateOptions options;
  options.page_tokens = 16;
  DecodeState st(model->config(), S, 200, options);
  st.enable_prefix_cache(size_t(64) << 20, 16);
  const std::vector<int32_t> shared = random_tokens(70, V, 3);
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t s = 0; s < S; ++s) {
    std::vector<int32_t> p = shared;
    for (int32_t t : random_tokens(5 + 9 * s, V, uint32_t(10 + s))) p.push_back(t);
    prompts.push_back(p);
  }
  std::vector<float> logits(size_t(S * V));
  std::vector<std::vector<float>> history(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s) {
    prefill(*model, st, s, prompts[size_t(s)].data(), int64_t(prompts[size_t(s)].size()),
            logits.data() + s * V);
    history[size_t(s)].assign(logits.begin() + s * V, logits.begin() + (s + 1) * V);
  }
  EXPECT_EQ(st.cached_tokens[0], 0);
  EXPECT_EQ(st.cached_tokens[1], 64);
  EXPECT_EQ(st.cached_tokens[2], 64);
  // The first 4 pages are the same physical pages in all three slots (no copies).
  for (int64_t j = 0; j < 4; ++j) {
    const int32_t page = st.page_table[j];
    EXPECT_EQ(st.page_table[st.pages_per_slot + j], page);
    EXPECT_EQ(st.page_table[2 * st.pages_per_slot + j], page);
    EXPECT_EQ(st.pages.refs(page), 4);  // three slots + one cache entry
  }
  std::vector<int32_t> next(static_cast<size_t>(S));
  std::vector<std::vector<int32_t>> tokens(static_cast<size_t>(S));
  for (int64_t step = 0; step < steps; ++step) {
    for (int64_t s = 0; s < S; ++s) {
      next[size_t(s)] = argmax(logits.data() + s * V, V);
      tokens[size_t(s)].push_back(next[size_t(s)]);
    }
    decode_step(*model, st, next.data(), nullptr, logits.data());
    for (int64_t s = 0; s < S; ++s)
      history[size_t(s)].insert(history[size_t(s)].end(), logits.begin() + s * V,
                                logits.begin() + (s + 1) * V);
  }
  for (int64_t s = 0; s < S; ++s) {
    const GreedyRun alone = cold_greedy(*model, prompts[size_t(s)], int(steps));
    EXPECT_EQ(tokens[size_t(s)], alone.tokens) << "slot " << s;
    EXPECT_LE(test::rel_rms(history[size_t(s)].data(), alone.logits.data(), alone.logits.size()),
              1e-5)
        << "slot " << s;
  }
}

TEST(PrefixCache, TinyBudgetsEvictAndStayCorrect) {
  auto model = prefix_test_model();
  const int64_t V = model->config().vocab_size;
  DecodeStateOptions options;
  options.page_tokens = 16;
  // Pool: 9 pages of 16 tokens for one slot of up to 130 tokens (9 pages) — cached entries must
  // give pages back for the next prompt to fit.
  options.page_pool_bytes = 9 * DecodeState::page_bytes(model->config(), 16);
  DecodeState st(model->config(), 1, 130, options);
  // Room for 3 entries (grid 16).
  PrefixCache probe(model->config(), st.pages, 16, DecodeState::page_bytes(model->config(), 16),
                    0, 16);
  st.enable_prefix_cache(3 * probe.entry_bytes() + 10, 16);
  EXPECT_EQ(st.prefix_cache->capacity(), 3);

  const std::vector<int32_t> base = random_tokens(120, V, 5);
  for (int round = 0; round < 4; ++round) {
    std::vector<int32_t> prompt(base.begin(), base.begin() + 40 + 20 * round);
    for (int32_t t : random_tokens(10, V, uint32_t(100 + round))) prompt.push_back(t);
    if (int64_t(prompt.size()) > 120) prompt.resize(120);
    const GreedyRun got = greedy(*model, st, 0, prompt, 4);
    expect_same_run(got, cold_greedy(*model, prompt, 4), "round " + std::to_string(round));
    EXPECT_LE(st.prefix_cache->size(), 3);
    EXPECT_EQ(st.pages.num_pages() - st.pages.free_pages(),
              st.slot_pages[0] + [&] {  // pages held by the cache but not by the slot
                int64_t only_cache = 0;
                for (int32_t p = 0; p < st.pages.num_pages(); ++p) {
                  bool in_slot = false;
                  for (int64_t j = 0; j < st.slot_pages[0]; ++j) in_slot |= st.page_table[j] == p;
                  only_cache += st.pages.refs(p) > 0 && !in_slot;
                }
                return only_cache;
              }());
  }
  EXPECT_GT(st.prefix_cache->stats().evicted, 0);
  EXPECT_GT(st.prefix_cache->stats().hits, 0);
  std::printf("  prefix cache: %lld hits, %lld inserted, %lld evicted, %lld entries of %zu bytes\n",
              (long long)st.prefix_cache->stats().hits,
              (long long)st.prefix_cache->stats().inserted,
              (long long)st.prefix_cache->stats().evicted, (long long)st.prefix_cache->size(),
              st.prefix_cache->entry_bytes());
}

TEST(PagedCache, ExhaustionIsReportedAndReleaseReturnsPages) {
  auto model = prefix_test_model();
  const int64_t V = model->config().vocab_size;
  DecodeStateOptions options;
  options.page_tokens = 16;
  options.page_pool_bytes = 4 * DecodeState::page_bytes(model->config(), 16);
  DecodeState st(model->config(), 2, 100, options);
  ASSERT_EQ(st.pages.num_pages(), 4);
  std::vector<float> logits(size_t(2 * V));
  const std::vector<int32_t> a = random_tokens(40, V, 7), b = random_tokens(30, V, 8);
  prefill(*model, st, 0, a.data(), 40, logits.data());  // 3 pages
  EXPECT_EQ(st.pages.free_pages(), 1);
  EXPECT_FALSE(reserve(st, 1, 30));  // needs 2 pages
  EXPECT_EQ(st.pages.free_pages(), 1);  // a failed reserve takes nothing
  EXPECT_TRUE(reserve(st, 1, 16));
  EXPECT_EQ(st.pages.free_pages(), 0);
  release(st, 1);
  try {
    prefill(*model, st, 1, b.data(), 30, logits.data() + V);
    ADD_FAILURE() << "prefill past the page pool did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of latent-cache pages"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(st.lengths[1], 0);
  EXPECT_EQ(st.pages.free_pages(), 1);  // the failed prefill gave its pages back
  // Decode slot 0 up to its page boundary (48 tokens), with slot 1 holding the last page.
  prefill(*model, st, 1, b.data(), 10, logits.data() + V);
  EXPECT_EQ(st.pages.free_pages(), 0);
  std::vector<int32_t> next = {3, 4};
  const std::vector<int> only_slot0 = {1, 0};
  for (int64_t t = 40; t < 48; ++t)
    decode_step(*model, st, next.data(), only_slot0.data(), logits.data());
  EXPECT_EQ(st.lengths[0], 48);
  EXPECT_THROW(decode_step(*model, st, next.data(), only_slot0.data(), logits.data()), Error);
  EXPECT_EQ(st.lengths[0], 48);
  // Releasing slot 1 lets slot 0 continue.
  release(st, 1);
  decode_step(*model, st, next.data(), only_slot0.data(), logits.data());
  EXPECT_EQ(st.lengths[0], 49);
  release(st, 0);
  EXPECT_EQ(st.pages.free_pages(), st.pages.num_pages());

  // With a prefix cache, the pages it pins come back when it is cleared.
  DecodeState cached(model->config(), 2, 100);
  cached.enable_prefix_cache(size_t(16) << 20, 64);
  prefill(*model, cached, 0, a.data(), 40, logits.data());
  std::vector<int32_t> longer = random_tokens(90, V, 9);
  prefill(*model, cached, 1, longer.data(), 90, logits.data() + V);
  EXPECT_EQ(cached.prefix_cache->size(), 1);
  release(cached, 0);
  release(cached, 1);
  EXPECT_EQ(cached.pages.free_pages(), cached.pages.num_pages() - 1);  // the entry's one page
  cached.prefix_cache->clear();
  EXPECT_EQ(cached.pages.free_pages(), cached.pages.num_pages());
  EXPECT_GT(DecodeState::cache_bytes(model->config(), 2, 100), size_t(0));
}

// The checkpoints kda_layer_extend copies out equal the state and conv tails of a prefill of
// just that prefix (the chunked operator run piecewise vs in one go).
TEST(PrefixCache, KdaCheckpointsEqualPrefillOfThePrefix) {
  auto model = prefix_test_model();
  const ModelConfig& c = model->config();
  const KdaWeightsT<float>& w = model->weights().layers[1].kda;
  ASSERT_EQ(c.mixers[1], MixerKind::KDA);
  const int64_t T = 100, d = c.hidden, HK = int64_t(c.kda.num_heads) * c.kda.head_dim;
  const int64_t state_n = HK * c.kda.head_dim, tail_n = (c.kda.conv_kernel - 1) * HK;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(T * d)), y(size_t(T * d)), y_prefix(size_t(T * d));
  for (float& v : x) v = normal(rng);
  Arena ws(kda_layer_workspace_bytes(c, 1, T, 64), "test kda");
  struct Buffers {
    std::vector<float> state, tq, tk, tv;
    explicit Buffers(int64_t s, int64_t t)
        : state(size_t(s), 9.0f), tq(size_t(t), 9.0f), tk(size_t(t), 9.0f), tv(size_t(t), 9.0f) {}
    KdaPrefillCache view() { return {state.data(), tq.data(), tk.data(), tv.data()}; }
  };
  // Start from a carried state (a 7-token prefill), then extend by T with checkpoints.
  Buffers carried(state_n, tail_n), reference(state_n, tail_n);
  kda_layer_prefill(c, w, x.data(), y.data(), 7, ws, carried.view());
  const std::vector<int64_t> marks = {1, 2, 25, 64, 65, 93};
  std::vector<Buffers> copies;
  std::vector<KdaCheckpoint> checkpoints;
  for (size_t i = 0; i < marks.size(); ++i) copies.emplace_back(state_n, tail_n);
  for (size_t i = 0; i < marks.size(); ++i) checkpoints.push_back({marks[i], copies[i].view()});
  kda_layer_extend(c, w, x.data() + 7 * d, y.data(), T - 7, ws, carried.view(), false,
                   checkpoints.data(), int64_t(checkpoints.size()));
  for (size_t i = 0; i < marks.size(); ++i) {
    kda_layer_prefill(c, w, x.data(), y_prefix.data(), 7 + marks[i], ws, reference.view());
    EXPECT_LE(test::rel_rms(copies[i].state.data(), reference.state.data(), size_t(state_n)), 1e-5)
        << "checkpoint after " << marks[i];
    // Tails are raw projections of the same rows (GEMMs of other heights: rounding only).
    EXPECT_LE(test::rel_rms(copies[i].tq.data(), reference.tq.data(), size_t(tail_n)), 1e-6);
    EXPECT_LE(test::rel_rms(copies[i].tk.data(), reference.tk.data(), size_t(tail_n)), 1e-6);
    EXPECT_LE(test::rel_rms(copies[i].tv.data(), reference.tv.data(), size_t(tail_n)), 1e-6)
        << "checkpoint after " << marks[i];
  }
  // And the carried state after the extend equals a prefill of all T tokens.
  kda_layer_prefill(c, w, x.data(), y_prefix.data(), T, ws, reference.view());
  EXPECT_LE(test::rel_rms(carried.state.data(), reference.state.data(), size_t(state_n)), 1e-5);
  // y holds the extend's T − 7 rows: its last 8 are the prefill's last 8.
  EXPECT_LE(test::rel_rms(y.data() + (T - 15) * d, y_prefix.data() + (T - 8) * d, size_t(8 * d)),
            1e-5);
  EXPECT_LE(test::rel_rms(carried.tv.data(), reference.tv.data(), size_t(tail_n)), 1e-6);
}
