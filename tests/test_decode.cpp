// Cached decode (infer/decode.h) against the one-shot forward: prefill + recurrent KDA + absorbed
// MLA must give the same logits at every decoded position as ModelT::forward over the whole
// sequence, for the three golden checkpoints (plain residual / RoPE+YaRN / AttnRes + gated MLA);
// the absorbed MLA layer (paged decode and extend) equals the expanded one; prefill + extend in
// pieces equals one prefill; batching slots of different lengths changes
// nothing; and `deltamoe generate` reproduces the goldens' greedy continuations.
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <sstream>

#include "core/gemm.h"
#include "infer/decode.h"
#include "io/config.h"
#include "model/mla.h"
#include "model/model.h"
#include "test_util.h"

using namespace dm;

namespace {

const char* const kDecodeGoldenModels[] = {"kimi_linear_tiny", "deepseek_v3_tiny", "kimi_k3_tiny"};

std::vector<int64_t> golden_row(const SafetensorsReader& g, const std::string& name, int64_t row) {
  const Tensor& t = g.get(name);
  const int64_t cols = t.shape[1];
  return std::vector<int64_t>(t.as<int64_t>() + row * cols, t.as<int64_t>() + (row + 1) * cols);
}

// (a) Prefill half the golden input row, decode the rest one token at a time; every position's
// logits against the one-shot forward.
void expect_decode_matches_forward(const std::string& name) {
  const std::string dir = test::goldens_dir() + "/" + name;
  auto model = Model::load(dir);
  const SafetensorsReader golden = SafetensorsReader::open(dir + "/golden.safetensors");
  const std::vector<int64_t> ids = golden_row(golden, "input_ids", 0);
  const int64_t T = int64_t(ids.size()), V = model->config().vocab_size;
  std::vector<float> reference(size_t(T * V));
  model->forward(ids.data(), 1, T, reference.data());
  // The model's own fp32 noise floor between the two KDA forms (chunked prefill, recurrent
  // decode): the one-shot forward with the recurrent operator against the chunked one. On
  // kimi_k3_tiny (safe gate, AttnRes) single positions differ by ~2.5e-5 from that alone.
  std::vector<float> recurrent_reference(size_t(T * V));
  ForwardOptions recurrent;
  recurrent.kda_chunk = 0;
  model->forward(ids.data(), 1, T, recurrent_reference.data(), nullptr, recurrent);
  double floor_worst_position = 0;
  for (int64_t t = 0; t < T; ++t)
    floor_worst_position =
        std::max(floor_worst_position, test::rel_rms(recurrent_reference.data() + t * V,
                                                     reference.data() + t * V, size_t(V)));

  const int64_t P = std::max<int64_t>(1, T / 2);
  DecodeState state(model->config(), 1, T);
  std::vector<int32_t> ids32(ids.begin(), ids.end());
  std::vector<float> decoded(size_t((T - P + 1) * V));  // positions P−1 (prefill) .. T−1
  prefill(*model, state, 0, ids32.data(), P, decoded.data());
  for (int64_t t = P; t < T; ++t)
    decode_step(*model, state, &ids32[size_t(t)], nullptr, decoded.data() + (t - P + 1) * V);
  EXPECT_EQ(state.lengths[0], T);
  // Over all decoded positions together (the goldens' convention: one rel RMS per tensor) ...
  const double all = test::rel_rms(decoded.data(), reference.data() + (P - 1) * V, decoded.size());
  EXPECT_LE(all, 1e-5) << name;
  // ... and per position, within the forward's own recurrent-vs-chunked spread.
  const double per_position_bound = std::max(1e-5, 2 * floor_worst_position);
  double worst = 0;
  for (int64_t t = P - 1; t < T; ++t) {
    const double e = test::rel_rms(decoded.data() + (t - P + 1) * V, reference.data() + t * V,
                                   size_t(V));
    EXPECT_LE(e, per_position_bound) << name << " position " << t;
    worst = std::max(worst, e);
  }
  std::printf("  %s: prefill %lld + decode %lld tokens: logits rel RMS %.2e over all, worst "
              "position %.2e (forward recurrent vs chunked: worst position %.2e)\n",
              name.c_str(), (long long)P, (long long)(T - P), all, worst, floor_worst_position);
}

// A paged latent cache for one slot in a pool whose page ids are out of order (so reading
// through the page table is what makes it work): pages_per_slot pages of `page_tokens` tokens.
struct TestPagedCache {
  std::vector<float> pages, cos, sin;
  std::vector<int32_t> table;
  MlaDecodeCache view(const ModelConfig& c, int64_t page_tokens) {
    return MlaDecodeCache{page_tokens, int64_t(table.size()), pages.data(), table.data(),
                          cos.data(), sin.data()};
  }
  TestPagedCache(const ModelConfig& c, int64_t T, int64_t page_tokens) {
    const int64_t num_pages = (T + page_tokens - 1) / page_tokens + 1;  // one spare, never used
    pages.assign(size_t(num_pages * page_tokens * (c.mla.kv_lora_rank + c.mla.qk_rope_dim)),
                 -7.0f);
    for (int64_t j = 0; j + 1 < num_pages; ++j) table.push_back(int32_t(num_pages - 1 - j));
    cos.assign(size_t(T * std::max<int64_t>(c.mla.qk_rope_dim / 2, 1)), 0.0f);
    sin = cos;
    mla_rope_tables(c.mla, T, cos.data(), sin.data());
  }
};

// (b) One MLA layer: absorbed decode over the paged latent cache, and the extend (expanded
// first piece, absorbed later pieces), vs the expanded forward.
void expect_absorbed_mla_matches_expanded(const std::string& name) {
  auto model = Model::load(test::goldens_dir() + "/" + name);
  const ModelConfig& c = model->config();
  int layer = -1;
  for (int i = 0; i < c.num_layers && layer < 0; ++i)
    if (c.mixers[i] == MixerKind::MLA) layer = i;
  ASSERT_GE(layer, 0) << name << " has no MLA layer";
  const MlaWeightsT<float>& w = model->weights().layers[size_t(layer)].mla;
  const int64_t T = 19, d = c.hidden, page_tokens = 8;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(T * d)), expanded(size_t(T * d)), absorbed(size_t(T * d)),
      extended(size_t(T * d));
  for (float& v : x) v = normal(rng);
  Arena ws(mla_layer_workspace_bytes(c, 1, T) + mla_layer_extend_workspace_bytes(c, T, page_tokens),
           "test mla");
  mla_layer_forward<float>(c, w, x.data(), expanded.data(), 1, T, ws);

  TestPagedCache decode_cache(c, T, page_tokens);
  const int64_t slot = 0;
  for (int64_t t = 0; t < T; ++t)
    mla_layer_decode(c, w, x.data() + t * d, absorbed.data() + t * d, 1, &slot, &t,
                     decode_cache.view(c, page_tokens), ws);
  const double e = test::rel_rms(absorbed.data(), expanded.data(), expanded.size());
  EXPECT_LE(e, 1e-5) << name << " layer " << layer;

  // Pieces 7 + 2 + 10: expanded, then absorbed across the page boundaries at 8 and 16.
  TestPagedCache extend_cache(c, T, page_tokens);
  int64_t start = 0;
  for (const int64_t piece : {7, 2, 10}) {
    mla_layer_extend(c, w, x.data() + start * d, extended.data() + start * d, piece, slot, start,
                     extend_cache.view(c, page_tokens), ws);
    start += piece;
  }
  const double e_extend = test::rel_rms(extended.data(), expanded.data(), expanded.size());
  EXPECT_LE(e_extend, 1e-5) << name << " layer " << layer;
  // Both paths wrote the same cache rows.
  EXPECT_LE(test::rel_rms(extend_cache.pages.data(), decode_cache.pages.data(),
                          decode_cache.pages.size()), 1e-5) << name;
  std::printf("  %s MLA layer %d: absorbed decode vs expanded rel RMS %.2e, extend %.2e\n",
              name.c_str(), layer, e, e_extend);
}

// (e) prefill(a) then extend(b) in pieces gives the last logits of one prefill(a + b) and of the
// one-shot forward. Pages of 16 tokens: pieces cross page boundaries and the 64-token KDA chunk.
void expect_extend_matches_prefill(const std::string& name) {
  const std::string dir = test::goldens_dir() + "/" + name;
  auto model = Model::load(dir);
  const SafetensorsReader golden = SafetensorsReader::open(dir + "/golden.safetensors");
  const std::vector<int64_t> ids = golden_row(golden, "input_ids", 1);
  const int64_t T = int64_t(ids.size()), V = model->config().vocab_size;
  std::vector<int32_t> ids32(ids.begin(), ids.end());
  std::vector<float> reference(size_t(T * V));
  model->forward(ids.data(), 1, T, reference.data());
  const float* reference_last = reference.data() + (T - 1) * V;

  DecodeStateOptions options;
  options.page_tokens = 16;
  std::vector<float> one_shot(static_cast<size_t>(V)), pieces_logits(static_cast<size_t>(V));
  DecodeState whole(model->config(), 1, T, options);
  prefill(*model, whole, 0, ids32.data(), T, one_shot.data());
  EXPECT_LE(test::rel_rms(one_shot.data(), reference_last, size_t(V)), 1e-5) << name;

  const std::vector<std::vector<int64_t>> chunkings = {
      {1, T - 1}, {T - 1, 1}, {15, 1, 1, 47, T - 64}, {40, 30, T - 70}, {63, 2, T - 65}};
  for (const auto& pieces : chunkings) {
    DecodeState state(model->config(), 1, T, options);
    int64_t start = 0;
    for (const int64_t piece : pieces) {
      if (start == 0) prefill(*model, state, 0, ids32.data(), piece, pieces_logits.data());
      else extend(*model, state, 0, ids32.data() + start, piece, pieces_logits.data());
      start += piece;
    }
    ASSERT_EQ(start, T);
    EXPECT_EQ(state.lengths[0], T);
    const double vs_prefill = test::rel_rms(pieces_logits.data(), one_shot.data(), size_t(V));
    const double vs_forward = test::rel_rms(pieces_logits.data(), reference_last, size_t(V));
    EXPECT_LE(vs_prefill, 1e-5) << name << " pieces starting " << pieces[0] << "," << pieces[1];
    EXPECT_LE(vs_forward, 1e-5) << name << " pieces starting " << pieces[0] << "," << pieces[1];
    std::printf("  %s extend in %zu pieces (%lld, %lld, ...): last logits vs one prefill %.2e, "
                "vs forward %.2e\n", name.c_str(), pieces.size(), (long long)pieces[0],
                (long long)pieces[1], vs_prefill, vs_forward);
  }
}

std::vector<int64_t> parse_output_ids(const std::string& out) {
  std::vector<int64_t> ids;
  const size_t key = out.find("\"output_ids\"");
  if (key == std::string::npos) return ids;
  const size_t open = out.find('[', key), close = out.find(']', key);
  if (open == std::string::npos || close == std::string::npos) return ids;
  std::stringstream ss(out.substr(open + 1, close - open - 1));
  std::string item;
  while (std::getline(ss, item, ',')) ids.push_back(std::stoll(item));
  return ids;
}

}  // namespace

TEST(Decode, PrefillThenDecodeEqualsForwardKimiLinear) {
  if (!test::goldens_available()) GTEST_SKIP() << "goldens not found";
  expect_decode_matches_forward("kimi_linear_tiny");
}

TEST(Decode, PrefillThenDecodeEqualsForwardDeepseekV3Rope) {
  if (!test::goldens_available()) GTEST_SKIP() << "goldens not found";
  expect_decode_matches_forward("deepseek_v3_tiny");
}

TEST(Decode, PrefillThenDecodeEqualsForwardK3AttnResGatedMla) {
  if (!test::goldens_available()) GTEST_SKIP() << "goldens not found";
  expect_decode_matches_forward("kimi_k3_tiny");
}

TEST(Decode, AbsorbedMlaEqualsExpandedLayer) {
  if (!test::goldens_available()) GTEST_SKIP() << "goldens not found";
  for (const char* name : kDecodeGoldenModels) expect_absorbed_mla_matches_expanded(name);
}

TEST(Decode, ExtendInPiecesEqualsOnePrefillAndForward) {
  if (!test::goldens_available()) GTEST_SKIP() << "goldens not found";
  for (const char* name : kDecodeGoldenModels) expect_extend_matches_prefill(name);
}

// (c) Three slots with prompts of different lengths decoded together (and with one slot idle
// for a step) give the logits of each decoded alone.
TEST(Decode, BatchedSlotsOfDifferentLengthsEqualDecodingAlone) {
  if (!test::goldens_available()) GTEST_SKIP() << "goldens not found";
  auto model = Model::load(test::goldens_dir() + "/kimi_k3_tiny");
  const int64_t V = model->config().vocab_size, S = 3, steps = 5, Lmax = 24;
  const std::vector<std::vector<int32_t>> prompts = {
      {5, 17, 3}, {9, 2, 44, 71, 8, 30, 12}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}};
  auto next_id = [&](int64_t step, int64_t s) { return int32_t((step * 7 + s * 13 + 1) % V); };
  // Slot 1 sits out step 2.
  auto is_active = [](int64_t step, int64_t s) { return !(step == 2 && s == 1); };

  DecodeState batch(model->config(), S, Lmax);
  std::vector<float> batch_logits(size_t(S * V)), single_logits(static_cast<size_t>(V));
  std::vector<std::vector<float>> batch_history(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s) {
    prefill(*model, batch, s, prompts[size_t(s)].data(), int64_t(prompts[size_t(s)].size()),
            batch_logits.data() + s * V);
    batch_history[size_t(s)].assign(batch_logits.begin() + s * V, batch_logits.begin() + (s + 1) * V);
  }
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<int32_t> next(static_cast<size_t>(S));
    std::vector<int> active(static_cast<size_t>(S));
    for (int64_t s = 0; s < S; ++s) {
      next[size_t(s)] = next_id(step, s);
      active[size_t(s)] = is_active(step, s);
    }
    decode_step(*model, batch, next.data(), active.data(), batch_logits.data());
    for (int64_t s = 0; s < S; ++s)
      if (active[size_t(s)])
        batch_history[size_t(s)].insert(batch_history[size_t(s)].end(),
                                        batch_logits.begin() + s * V,
                                        batch_logits.begin() + (s + 1) * V);
  }
  for (int64_t s = 0; s < S; ++s) {
    DecodeState alone(model->config(), 1, Lmax);
    std::vector<float> history;
    prefill(*model, alone, 0, prompts[size_t(s)].data(), int64_t(prompts[size_t(s)].size()),
            single_logits.data());
    history.insert(history.end(), single_logits.begin(), single_logits.end());
    for (int64_t step = 0; step < steps; ++step) {
      if (!is_active(step, s)) continue;
      const int32_t id = next_id(step, s);
      decode_step(*model, alone, &id, nullptr, single_logits.data());
      history.insert(history.end(), single_logits.begin(), single_logits.end());
    }
    ASSERT_EQ(history.size(), batch_history[size_t(s)].size()) << "slot " << s;
    const double e = test::rel_rms(batch_history[size_t(s)].data(), history.data(), history.size());
    EXPECT_LE(e, 1e-5) << "slot " << s;  // batched vs single-row GEMM rounding (~2e-6)
    EXPECT_EQ(batch.lengths[size_t(s)], alone.lengths[0]) << "slot " << s;
  }
}

// (c') The same on configs/demo.json (random weights) with 16 slots: big enough a step that it
// runs on every thread, the KDA rows of the batch in parallel (16·H·K·V = 2^18 state floats)
// and the MLA attention one slot per work unit — against each slot decoded alone (one thread).
TEST(Decode, SixteenDemoSlotsOnAllThreadsEqualDecodingAlone) {
  const ModelConfig cfg = load_config(test::source_dir() + "/configs/demo.json");
  auto weights = weights_allocate<float>(cfg);
  weights_init(*weights, 5);
  Model model(std::move(weights));
  const int64_t V = cfg.vocab_size, S = 16, steps = 3, Lmax = 40;
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t = 0; t < 5 + s; ++t) prompts[size_t(s)].push_back(int32_t((s * 97 + t * 31) % V));
  auto next_id = [&](int64_t step, int64_t s) { return int32_t((step * 11 + s * 5 + 3) % V); };
  DecodeState batch(cfg, S, Lmax);
  std::vector<float> logits(static_cast<size_t>(S * V)), alone_logits(static_cast<size_t>(V));
  for (int64_t s = 0; s < S; ++s)
    prefill(model, batch, s, prompts[size_t(s)].data(), int64_t(prompts[size_t(s)].size()),
            logits.data() + s * V);
  std::vector<int32_t> next(static_cast<size_t>(S));
  for (int64_t step = 0; step < steps; ++step) {
    for (int64_t s = 0; s < S; ++s) next[size_t(s)] = next_id(step, s);
    decode_step(model, batch, next.data(), nullptr, logits.data());
  }
  double worst = 0;
  for (int64_t s = 0; s < S; ++s) {
    DecodeState alone(cfg, 1, Lmax);
    prefill(model, alone, 0, prompts[size_t(s)].data(), int64_t(prompts[size_t(s)].size()),
            alone_logits.data());
    for (int64_t step = 0; step < steps; ++step) {
      const int32_t id = next_id(step, s);
      decode_step(model, alone, &id, nullptr, alone_logits.data());
    }
    const double e = test::rel_rms(logits.data() + s * V, alone_logits.data(), size_t(V));
    EXPECT_LE(e, 1e-5) << "slot " << s;
    worst = std::max(worst, e);
  }
  std::printf("  demo, 16 slots on %d threads vs alone: worst slot rel RMS %.2e\n", num_threads(),
              worst);

  // A 70-token extend after 30 (absorbed attention in 3 work units of 32 tokens, on every
  // thread) against one 100-token prefill (expanded).
  std::vector<int32_t> long_prompt;
  for (int64_t t = 0; t < 100; ++t) long_prompt.push_back(int32_t((t * 37 + 1) % V));
  DecodeState one(cfg, 1, 100), pieces(cfg, 1, 100);
  std::vector<float> one_logits(static_cast<size_t>(V)), pieces_logits(static_cast<size_t>(V));
  prefill(model, one, 0, long_prompt.data(), 100, one_logits.data());
  prefill(model, pieces, 0, long_prompt.data(), 30, pieces_logits.data());
  extend(model, pieces, 0, long_prompt.data() + 30, 70, pieces_logits.data());
  EXPECT_LE(test::rel_rms(pieces_logits.data(), one_logits.data(), size_t(V)), 1e-5);
}

// (c'') The scratch arena is sized for the threads a later call may use, not for the single
// thread a small call runs on: a short prefill (below the parallel threshold, so on one thread)
// that grows the arena must still leave room for the per-thread scratch of the multi-threaded
// extends after it. (The server's 16-client test once hit "arena 'decode scratch' exhausted" this
// way, depending on which request came first.)
TEST(Decode, SmallSingleThreadedPrefillLeavesRoomForThreadedExtends) {
  const ModelConfig cfg = load_config(test::source_dir() + "/configs/test.json");
  auto weights = weights_allocate<float>(cfg);
  weights_init(*weights, 9);
  Model model(std::move(weights));
  const int saved_threads = num_threads();
  set_num_threads(4);
  const int64_t V = cfg.vocab_size, n = 80, total = 480;
  std::vector<int32_t> prompt;
  for (int64_t t = 0; t < total; ++t) prompt.push_back(int32_t((t * 53 + 7) % V));
  std::vector<float> pieces_logits(static_cast<size_t>(V)), one_logits(static_cast<size_t>(V));
  DecodeState pieces(cfg, 1, total), one(cfg, 1, total);
  // 80 tokens of this model (2·80·199K FLOPs) run on one thread and grow the arena; every later
  // 80-token extend attends over enough cached positions to run on all four.
  EXPECT_NO_THROW({
    prefill(model, pieces, 0, prompt.data(), n, pieces_logits.data());
    for (int64_t start = n; start < total; start += n)
      extend(model, pieces, 0, prompt.data() + start, n, pieces_logits.data());
  });
  prefill(model, one, 0, prompt.data(), total, one_logits.data());
  set_num_threads(saved_threads);
  EXPECT_LE(test::rel_rms(pieces_logits.data(), one_logits.data(), size_t(V)), 1e-5);
}

// (d) `deltamoe generate --temperature 0 --json` (cached decode) reproduces the goldens' greedy
// continuations (output_ids are the new tokens only).
TEST(Decode, GenerateCliReproducesGoldenGreedy) {
  if (!test::goldens_available()) GTEST_SKIP() << "goldens not found";
  for (const char* name : kDecodeGoldenModels) {
    const std::string dir = test::goldens_dir() + "/" + name;
    const SafetensorsReader golden = SafetensorsReader::open(dir + "/golden.safetensors");
    const Tensor& prompt = golden.get("greedy_prompt");
    const int64_t rows = prompt.shape[0], P = prompt.shape[1];
    const int64_t O = golden.get("greedy_output").shape[1];
    for (int64_t b = 0; b < rows; ++b) {
      const std::vector<int64_t> ids = golden_row(golden, "greedy_prompt", b);
      const std::vector<int64_t> want_all = golden_row(golden, "greedy_output", b);
      std::string csv;
      for (size_t i = 0; i < ids.size(); ++i) csv += (i ? "," : "") + std::to_string(ids[i]);
      const test::CliResult r =
          test::run_cli("generate --model " + dir + " --prompt-ids " + csv + " --max-new-tokens " +
                        std::to_string(O - P) + " --temperature 0 --json");
      ASSERT_EQ(r.exit_code, 0) << name << ": " << r.output;
      const std::vector<int64_t> want(want_all.begin() + P, want_all.end());
      EXPECT_EQ(parse_output_ids(r.output), want) << name << " row " << b << ": " << r.output;
    }
  }
}
