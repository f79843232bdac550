#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>

#include "core/error.h"
#include "data/builtin.h"
#include "data/corpus.h"
#include "data/sampler.h"
#include "data/shard.h"
#include "io/tokenizer.h"
#include "test_util.h"

using namespace dm;
namespace fs = std::filesystem;

namespace {
// Token of document d at position i: lets a test recover both from any packed position.
constexpr int32_t kDocStride = 1 << 16;
int32_t doc_token(int64_t d, int64_t i) { return int32_t(d * kDocStride + i); }

std::vector<std::vector<int32_t>> numbered_documents(const std::vector<int64_t>& lengths, int64_t first_doc = 0) {
  std::vector<std::vector<int32_t>> docs;
  for (size_t d = 0; d < lengths.size(); ++d) {
    docs.emplace_back();
    for (int64_t i = 0; i < lengths[d]; ++i) docs.back().push_back(doc_token(first_doc + int64_t(d), i));
  }
  return docs;
}

std::vector<int64_t> random_lengths(size_t n, int64_t lo, int64_t hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int64_t> l(n);
  for (auto& x : l) x = lo + int64_t(rng() % uint32_t(hi - lo + 1));
  return l;
}

std::string error_text_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no dm::Error>";
}

bool batches_equal(const PackedBatch& a, const PackedBatch& b) {
  return a.tokens == b.tokens && a.targets == b.targets && a.doc_start == b.doc_start &&
         a.row_source == b.row_source;
}
}  // namespace

// ---- shards ---------------------------------------------------------------------------------
TEST(Shard, WriteReadRoundTrip) {
  const std::string dir = test::temp_dir("shard_rt");
  TokenShardWriter w(1000);
  const std::vector<std::vector<int32_t>> docs = {{1, 2, 3}, {}, {999}, {5, 5, 5, 5, 5}};
  for (const auto& d : docs) w.add_document(d);
  EXPECT_THROW(w.add_document(std::vector<int32_t>{1000}), Error);
  w.write(dir + "/train_00000.dmtok");
  TokenShardWriter w2(1000);
  w2.add_document(std::vector<int32_t>{7, 8});
  w2.write(dir + "/train_00001.dmtok");

  auto s = TokenShard::open(dir + "/train_00000.dmtok");
  EXPECT_EQ(s->num_documents(), 4);
  EXPECT_EQ(s->num_tokens(), 9);
  EXPECT_EQ(s->vocab_size(), 1000);
  for (size_t d = 0; d < docs.size(); ++d) {
    auto span = s->document(int64_t(d));
    EXPECT_EQ(std::vector<int32_t>(span.begin(), span.end()), docs[d]);
  }
  auto ds = TokenDataset::open(dir);  // both train shards, in name order
  EXPECT_EQ(ds->num_documents(), 5);
  EXPECT_EQ(ds->num_tokens(), 11);
  EXPECT_EQ(ds->document(4)[1], 8u);
  EXPECT_EQ(ds->document_length(1), 0);
  EXPECT_THROW(ds->document(5), Error);
  EXPECT_THROW(TokenDataset::open(dir, "val"), Error);
}

TEST(Shard, MalformedFilesRaiseErrorsNamingTheFile) {
  const std::string dir = test::temp_dir("shard_bad");
  TokenShardWriter w(100);
  w.add_document(std::vector<int32_t>{1, 2, 3});
  w.add_document(std::vector<int32_t>{4, 5});
  const std::vector<uint8_t> good = w.serialize();
  auto expect_error = [&](const std::string& name, std::vector<uint8_t> bytes, const std::string& phrase) {
    const std::string path = dir + "/" + name;
    {
      std::ofstream f(path, std::ios::binary);
      f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    }
    const std::string msg = error_text_of([&] { TokenShard::open(path); });
    EXPECT_NE(msg.find(path), std::string::npos) << name << ": " << msg;
    EXPECT_NE(msg.find(phrase), std::string::npos) << name << ": " << msg;
  };
  auto patched = [&](size_t at, uint64_t value, size_t width) {
    std::vector<uint8_t> b = good;
    std::memcpy(b.data() + at, &value, width);
    return b;
  };
  EXPECT_NO_THROW(TokenShard::from_memory(good, "good"));
  expect_error("empty.dmtok", {}, "truncated");
  expect_error("short_header.dmtok", std::vector<uint8_t>(good.begin(), good.begin() + 20), "truncated");
  expect_error("truncated.dmtok", std::vector<uint8_t>(good.begin(), good.end() - 3), "truncated");
  expect_error("magic.dmtok", patched(0, 0x4c4c4c4c, 4), "bad magic");
  expect_error("version.dmtok", patched(8, 7, 4), "version");
  expect_error("dtype.dmtok", patched(12, 2, 4), "dtype");
  expect_error("offset_past_end.dmtok", patched(kTokenShardHeaderBytes + 8, 99, 8), "past the end");
  expect_error("offset_decreasing.dmtok", patched(kTokenShardHeaderBytes + 16, 2, 8), "must not decrease");
  expect_error("huge_doc_count.dmtok", patched(24, uint64_t(1) << 60, 8), "doc_count");
  expect_error("huge_token_count.dmtok", patched(16, uint64_t(1) << 61, 8), "token_count");
  std::vector<uint8_t> trailing = good;
  trailing.push_back(0);
  expect_error("trailing.dmtok", trailing, "trailing");
  expect_error("vocab.dmtok", patched(32, 3, 4), "outside the vocabulary");
  const std::string missing = error_text_of([&] { TokenShard::open(dir + "/absent.dmtok"); });
  EXPECT_NE(missing.find("absent.dmtok"), std::string::npos);
}

// ---- sampler --------------------------------------------------------------------------------
TEST(Sampler, PackingHonoursDocumentBoundaries) {
  const int64_t T = 32;
  const int32_t kPad = 1 << 30;
  // Mix of short documents (stay whole) and long ones (> T+1: split across rows), plus an empty one.
  std::vector<int64_t> lengths = random_lengths(60, 1, 20, 1);
  lengths[5] = 100;
  lengths[17] = 0;
  lengths[40] = 70;
  auto data = TokenDataset::from_documents(numbered_documents(lengths));
  PackedSamplerOptions opt;
  opt.batch_size = 4;
  opt.seq_len = T;
  opt.seed = 3;
  opt.pad_token = kPad;
  PackedSampler sampler(data, opt);
  std::map<std::pair<int64_t, int64_t>, int> transitions;  // (doc, pos) → times pos→pos+1 is a target
  int64_t positions = 0, pads = 0;
  while (sampler.epoch() == 0) {
    const PackedBatch b = sampler.next_batch();
    for (int64_t r = 0; r < b.batch_size; ++r) {
      const int64_t* row = b.tokens.data() + r * T;
      for (int64_t t = 0; t < T; ++t) {
        const size_t i = size_t(r * T + t);
        const int32_t start = b.doc_start[i];
        ASSERT_LE(start, t);
        ++positions;
        if (row[t] == kPad) {
          ASSERT_EQ(b.targets[i], -1);
          ASSERT_EQ(row[start], kPad);
          ++pads;
          continue;
        }
        const int64_t doc = row[t] / kDocStride, pos = row[t] % kDocStride;
        // doc_start: where this document's run in the row begins.
        for (int64_t u = start; u <= t; ++u) ASSERT_EQ(row[u] / kDocStride, doc);
        if (start > 0) {
          ASSERT_NE(row[start - 1] / kDocStride, doc);
        }
        // A short document is never split: its run starts at its first token.
        if (lengths[size_t(doc)] <= T + 1) {
          ASSERT_EQ(pos - (t - start), 0);
        }
        if (b.targets[i] >= 0) {
          ASSERT_EQ(b.targets[i], doc_token(doc, pos + 1));
          ++transitions[{doc, pos}];
        } else {
          // No target only where the document ends (its next token belongs to another document).
          ASSERT_EQ(pos + 1, lengths[size_t(doc)]) << "doc " << doc << " pos " << pos;
          if (t + 1 < T) {
            ASSERT_NE(row[t + 1], doc_token(doc, pos + 1));
          }
        }
      }
    }
  }
  // Every within-document transition of the epoch was trained (the batch that rolled into the
  // next epoch may add a few more).
  int64_t expected = 0, seen = 0;
  for (size_t d = 0; d < lengths.size(); ++d)
    for (int64_t p = 0; p + 1 < lengths[d]; ++p, ++expected)
      ASSERT_TRUE(transitions.count({int64_t(d), p})) << "doc " << d << " transition " << p << " missing";
  for (const auto& [k, c] : transitions) seen += c;
  EXPECT_LE(seen - expected, 4 * T);
  EXPECT_LT(double(pads), 0.1 * double(positions));  // lookahead keeps padding small
}

TEST(Sampler, SplitModeTrainsEveryTransitionExactlyOnce) {
  const int64_t T = 16;
  const std::vector<int64_t> lengths = random_lengths(40, 1, 50, 2);
  int64_t total_transitions = 0;
  for (auto l : lengths) total_transitions += std::max<int64_t>(0, l - 1);
  auto data = TokenDataset::from_documents(numbered_documents(lengths));
  PackedSamplerOptions opt;
  opt.batch_size = 1;
  opt.seq_len = T;
  opt.split_short_documents = true;
  opt.lookahead_documents = 0;  // pure stream: no padding at all
  PackedSampler sampler(data, opt);
  std::map<std::pair<int64_t, int64_t>, int> transitions;
  while (true) {
    const PackedBatch b = sampler.next_batch();
    if (sampler.epoch() > 0) break;  // the last row touched the next epoch: drop it
    for (int64_t t = 0; t < T; ++t)
      if (b.targets[size_t(t)] >= 0) ++transitions[{b.tokens[size_t(t)] / kDocStride, b.tokens[size_t(t)] % kDocStride}];
  }
  int64_t count = 0;
  for (const auto& [k, c] : transitions) {
    ASSERT_EQ(c, 1) << "doc " << k.first << " pos " << k.second;
    count += c;
  }
  EXPECT_GE(count, total_transitions - 2 * T);  // all but the (dropped) last row's worth
}

TEST(Sampler, DeterministicFromSeed) {
  auto data = TokenDataset::from_documents(numbered_documents(random_lengths(200, 1, 60, 3)));
  PackedSamplerOptions opt;
  opt.batch_size = 3;
  opt.seq_len = 24;
  opt.seed = 42;
  PackedSampler a(data, opt), b(data, opt);
  opt.seed = 43;
  PackedSampler c(data, opt);
  bool differs = false;
  for (int i = 0; i < 50; ++i) {
    const PackedBatch x = a.next_batch(), y = b.next_batch(), z = c.next_batch();
    ASSERT_TRUE(batches_equal(x, y)) << "batch " << i;
    differs |= !batches_equal(x, z);
  }
  EXPECT_TRUE(differs);
}

TEST(Sampler, ResumeGivesTheIdenticalContinuation) {
  auto primary = TokenDataset::from_documents(numbered_documents(random_lengths(50, 1, 90, 4)));
  auto replay = TokenDataset::from_documents(numbered_documents(random_lengths(30, 1, 40, 5), 1000));
  PackedSamplerOptions opt;
  opt.batch_size = 2;
  opt.seq_len = 32;
  opt.seed = 9;
  opt.replay_fraction = 0.3;
  opt.lookahead_documents = 8;
  PackedSampler a(primary, opt, replay);
  for (int i = 0; i < 37; ++i) a.next_batch();  // crosses epoch boundaries of both sources
  const std::string saved = a.state_json().dump();
  std::vector<PackedBatch> expected;
  for (int i = 0; i < 60; ++i) expected.push_back(a.next_batch());

  PackedSampler b(primary, opt, replay);
  b.restore(nlohmann::json::parse(saved));
  for (int i = 0; i < 60; ++i) ASSERT_TRUE(batches_equal(b.next_batch(), expected[size_t(i)])) << "batch " << i;
  EXPECT_EQ(b.state_json(), a.state_json());

  // A state made for other data is refused.
  auto other = TokenDataset::from_documents(numbered_documents(random_lengths(51, 1, 90, 4)));
  PackedSampler c(other, opt, replay);
  EXPECT_NE(error_text_of([&] { c.restore(nlohmann::json::parse(saved)); }).find("source 0"), std::string::npos);
  PackedSamplerOptions without_replay = opt;
  without_replay.replay_fraction = 0;
  PackedSampler d(primary, without_replay);
  EXPECT_THROW(d.restore(nlohmann::json::parse(saved)), Error);  // state has a replay source
  nlohmann::json broken = nlohmann::json::parse(saved);
  broken["sources"][0]["position"] = -3;
  EXPECT_THROW(b.restore(broken), Error);
}

// Rows are pure (one source each) and, stratified, every window of rows holds each source's
// share to within one row; the coin form only matches it on average.
TEST(Sampler, MixtureSharesPerWindow) {
  auto primary = TokenDataset::from_documents(numbered_documents(random_lengths(100, 5, 50, 6)));
  auto replay = TokenDataset::from_documents(numbered_documents(random_lengths(100, 5, 50, 7), 1000));
  for (const bool stratified : {true, false}) {
    PackedSamplerOptions opt;
    opt.batch_size = 16;
    opt.seq_len = 16;
    opt.replay_fraction = 0.2;
    opt.stratified_mixture = stratified;
    PackedSampler s(primary, opt, replay);
    int64_t rows = 0, replay_rows = 0, min_per_batch = 16, max_per_batch = 0;
    for (int i = 0; i < 250; ++i) {
      const PackedBatch b = s.next_batch();
      int64_t in_batch = 0;
      for (int64_t r = 0; r < b.batch_size; ++r) {
        ++rows;
        in_batch += b.row_source[size_t(r)] == 1;
        for (int64_t t = 0; t < b.seq_len; ++t) {  // rows are pure: one source each
          const int64_t doc = b.tokens[size_t(r * b.seq_len + t)] / kDocStride;
          ASSERT_EQ(doc >= 1000, b.row_source[size_t(r)] == 1);
        }
      }
      replay_rows += in_batch;
      min_per_batch = std::min(min_per_batch, in_batch);
      max_per_batch = std::max(max_per_batch, in_batch);
    }
    const double frac = double(replay_rows) / double(rows);  // coin: 4000 rows, σ ≈ 0.0063
    EXPECT_NEAR(frac, 0.2, stratified ? 1.0 / 4000 : 0.03) << "stratified " << stratified;
    if (stratified) {  // 16 rows × 0.2 = 3.2 → 3 or 4 replay rows in every batch
      EXPECT_GE(min_per_batch, 3);
      EXPECT_LE(max_per_batch, 4);
    } else {
      EXPECT_GT(max_per_batch - min_per_batch, 2);  // a coin swings more
    }
  }
  PackedSamplerOptions opt;
  opt.replay_fraction = 0.2;
  EXPECT_THROW(PackedSampler(primary, opt), Error);  // a fraction without a replay source
}

TEST(Sampler, ThreeSourceMixtureFollowsWeights) {
  auto a = TokenDataset::from_documents(numbered_documents(random_lengths(60, 5, 30, 1)));
  auto b = TokenDataset::from_documents(numbered_documents(random_lengths(60, 5, 30, 2), 1000));
  auto c = TokenDataset::from_documents(numbered_documents(random_lengths(60, 5, 30, 3), 2000));
  PackedSamplerOptions opt;
  opt.batch_size = 10;
  opt.seq_len = 24;
  PackedSampler s({{a, 5.0}, {b, 3.0}, {c, 2.0}}, opt);
  int64_t counts[3] = {0, 0, 0};
  for (int i = 0; i < 40; ++i) {
    const PackedBatch batch = s.next_batch();
    int64_t per_batch[3] = {0, 0, 0};
    for (int32_t src : batch.row_source) ++per_batch[src];
    EXPECT_EQ(per_batch[0], 5);
    EXPECT_EQ(per_batch[1], 3);
    EXPECT_EQ(per_batch[2], 2);
    for (int k = 0; k < 3; ++k) counts[k] += per_batch[k];
  }
  EXPECT_EQ(counts[0] + counts[1] + counts[2], 400);
  EXPECT_THROW(s.set_source_weights({1.0, -1.0, 0.0}), Error);
  EXPECT_THROW(s.set_source_weights({0.0, 0.0, 0.0}), Error);
  EXPECT_THROW(s.set_source_weights({1.0, 1.0}), Error);
}

TEST(Sampler, DataParallelRanksSplitTheStream) {
  auto data = TokenDataset::from_documents(numbered_documents(random_lengths(80, 1, 40, 8)));
  PackedSamplerOptions opt;
  opt.batch_size = 2;
  opt.seq_len = 16;
  PackedSampler whole(data, opt);
  opt.world_size = 2;
  opt.rank = 0;
  PackedSampler r0(data, opt);
  opt.rank = 1;
  PackedSampler r1(data, opt);
  for (int i = 0; i < 20; ++i) {
    const PackedBatch w = whole.next_batch();  // global rows 4i.. in pairs
    const PackedBatch a = r0.next_batch(), b = r1.next_batch();  // rows 2j, 2j+1 of the stream
    const PackedBatch w2 = whole.next_batch();
    const int64_t T = 16;
    auto row = [&](const PackedBatch& x, int64_t r) {
      return std::vector<int64_t>(x.tokens.begin() + r * T, x.tokens.begin() + (r + 1) * T);
    };
    ASSERT_EQ(row(a, 0), row(w, 0));
    ASSERT_EQ(row(b, 0), row(w, 1));
    ASSERT_EQ(row(a, 1), row(w2, 0));
    ASSERT_EQ(row(b, 1), row(w2, 1));
  }
}

// ---- built-in data --------------------------------------------------------------------------
TEST(Builtin, UnigramEntropyOfKnownStreams) {
  EXPECT_NEAR(unigram_entropy_nats(std::vector<int32_t>{1, 2, 3, 4, 1, 2, 3, 4}), std::log(4.0), 1e-12);
  EXPECT_NEAR(unigram_entropy_nats(std::vector<int32_t>(100, 5)), 0.0, 1e-12);
  EXPECT_NEAR(bigram_conditional_entropy_nats(std::vector<int32_t>{1, 2, 1, 2, 1, 2, 1}), 0.0, 1e-12);
}

TEST(Builtin, SyntheticEnglishIsDeterministicCorrectAndLearnable) {
  const auto a = synthetic_english_corpus({400, 1, 6, 16});
  const auto b = synthetic_english_corpus({400, 1, 6, 16});
  const auto c = synthetic_english_corpus({400, 2, 6, 16});
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_EQ(a[17], synthetic_english_document(1, 17));
  // Arithmetic facts are true.
  std::string all;
  for (const auto& d : a) all += d;
  const std::regex plus(R"((\d+) plus (\d+) is (\d+)\.)"), times(R"((\d+) times (\d+) is (\d+)\.)");
  int facts = 0;
  for (auto it = std::sregex_iterator(all.begin(), all.end(), plus); it != std::sregex_iterator(); ++it, ++facts)
    ASSERT_EQ(std::stoi((*it)[1]) + std::stoi((*it)[2]), std::stoi((*it)[3])) << (*it)[0];
  for (auto it = std::sregex_iterator(all.begin(), all.end(), times); it != std::sregex_iterator(); ++it, ++facts)
    ASSERT_EQ(std::stoi((*it)[1]) * std::stoi((*it)[2]), std::stoi((*it)[3])) << (*it)[0];
  EXPECT_GT(facts, 100);
  // Unigram entropy well above what context can explain: the bigram conditional entropy (an
  // in-sample upper-ish reference for a model using one token of context) sits far below it.
  const Tokenizer tok = Tokenizer::train(a, 1024);
  std::vector<int32_t> stream;
  for (const auto& d : synthetic_english_corpus({3000, 5, 6, 16})) {
    const auto ids = tok.encode(d);
    stream.insert(stream.end(), ids.begin(), ids.end());
  }
  const double h1 = unigram_entropy_nats(stream), h2 = bigram_conditional_entropy_nats(stream);
  EXPECT_GT(h1, 4.0);
  EXPECT_LT(h2, 0.6 * h1);
}

TEST(Recall, TaskGenerationLayoutAndDeterminism) {
  RecallTaskOptions o;
  o.vocab_size = 1000;
  o.token_base = 500;
  o.num_keys = 32;
  o.num_values = 16;
  o.num_filler = 8;
  o.num_pairs = 6;
  o.num_queries = 2;
  o.filler_length = 40;
  o.seed = 1;
  const RecallTaskLayout l = recall_task_layout(o);
  EXPECT_EQ(l.key_base, 504);
  EXPECT_EQ(l.value_base, 536);
  EXPECT_EQ(l.filler_base, 552);
  const auto tasks = generate_recall_tasks(o, 100);
  for (size_t k = 0; k < tasks.size(); ++k) {
    const RecallTask& t = tasks[k];
    ASSERT_EQ(int64_t(t.tokens.size()), recall_task_length(o));
    EXPECT_EQ(t.tokens, generate_recall_task(o, int64_t(k)).tokens);
    EXPECT_EQ(t.tokens.front(), l.begin_marker);
    EXPECT_EQ(t.tokens.back(), l.end_marker);
    std::map<int32_t, int32_t> context;  // key → value in the pairs section
    for (int i = 0; i < o.num_pairs; ++i) {
      ASSERT_TRUE(l.is_key(t.tokens[size_t(1 + 2 * i)]));
      ASSERT_TRUE(l.is_value(t.tokens[size_t(2 + 2 * i)]));
      ASSERT_TRUE(context.emplace(t.tokens[size_t(1 + 2 * i)], t.tokens[size_t(2 + 2 * i)]).second) << "keys distinct";
    }
    ASSERT_EQ(t.answer_positions.size(), 2u);
    EXPECT_NE(t.tokens[size_t(t.answer_positions[0])], t.tokens[size_t(t.answer_positions[1])]);
    for (size_t q = 0; q < t.answer_positions.size(); ++q) {
      const int32_t p = t.answer_positions[q];
      EXPECT_EQ(t.answers[q], context.at(t.tokens[size_t(p)]));
      EXPECT_EQ(t.tokens[size_t(p + 1)], t.answers[q]);
      EXPECT_EQ(t.answer_mask[size_t(p)], 1);
      EXPECT_GE(t.recall_distances[q], o.filler_length);
    }
    EXPECT_EQ(std::count(t.answer_mask.begin(), t.answer_mask.end(), 1), 2);
  }
  o.vocab_size = 550;  // ranges [500, 560) no longer fit
  EXPECT_THROW(recall_task_layout(o), Error);
  o.vocab_size = 1000;
  o.num_pairs = 40;  // more pairs than distinct keys
  EXPECT_THROW(recall_task_layout(o), Error);
  // Options survive data.json.
  o.num_pairs = 6;
  const RecallTaskOptions back = recall_task_options_from_json(recall_task_options_to_json(o));
  EXPECT_EQ(generate_recall_task(back, 3).tokens, generate_recall_task(o, 3).tokens);
}

TEST(Recall, AccuracyOfPerfectAndRandomPredictors) {
  RecallTaskOptions o;
  o.vocab_size = 512;
  o.token_base = 0;
  o.num_pairs = 8;
  o.num_queries = 1;
  o.filler_length = 100;
  const auto tasks = generate_recall_tasks(o, 3000);
  const RecallTaskLayout l = recall_task_layout(o);
  // Perfect: an associative memory over the prompt, predicting after every prefix.
  NextTokenArgmaxFn perfect = [&](std::span<const int32_t> prompt) {
    std::vector<int32_t> out(prompt.size(), 0);
    std::map<int32_t, int32_t> memory;
    for (size_t i = 0; i < prompt.size(); ++i) {
      if (i + 1 < prompt.size() && l.is_key(prompt[i]) && l.is_value(prompt[i + 1]) && !memory.count(prompt[i]))
        memory[prompt[i]] = prompt[i + 1];
      if (l.is_key(prompt[i]) && memory.count(prompt[i])) out[i] = memory[prompt[i]];
    }
    return out;
  };
  EXPECT_DOUBLE_EQ(recall_accuracy(perfect, tasks).accuracy(), 1.0);
  // Random: a uniformly random value after the whole prompt (the single-id form).
  std::mt19937 rng(1);
  NextTokenArgmaxFn random = [&](std::span<const int32_t>) {
    return std::vector<int32_t>{l.value_base + int32_t(rng() % uint32_t(l.num_values))};
  };
  const RecallAccuracy r = recall_accuracy(random, tasks);
  EXPECT_EQ(r.total, 3000);
  EXPECT_NEAR(r.accuracy(), 1.0 / o.num_values, 0.012);  // σ ≈ 0.0023
  NextTokenArgmaxFn wrong_size = [](std::span<const int32_t>) { return std::vector<int32_t>{1, 2}; };
  EXPECT_THROW(recall_accuracy(wrong_size, tasks), Error);
}

TEST(Recall, AnswerMaskFromPackedBatches) {
  RecallTaskOptions o;
  o.vocab_size = 400;
  o.token_base = 100;
  o.num_pairs = 4;
  o.num_queries = 3;
  o.filler_length = 10;
  const RecallTaskLayout l = recall_task_layout(o);
  std::vector<std::vector<int32_t>> docs;
  for (const auto& t : generate_recall_tasks(o, 64)) docs.push_back(t.tokens);
  docs.push_back({l.query_marker, l.key_base, 5, l.key_base + 1, l.value_base});  // broken pattern
  auto data = TokenDataset::from_documents(docs, o.vocab_size);
  PackedSamplerOptions opt;
  opt.batch_size = 8;
  opt.seq_len = 2 * recall_task_length(o) + 5;  // two whole tasks per row
  PackedSampler s(data, opt);
  int64_t answers = 0;
  while (s.epoch() == 0) {
    const PackedBatch b = s.next_batch();
    const auto mask = recall_answer_mask(b, l);
    for (size_t i = 0; i < mask.size(); ++i) {
      if (!mask[i]) continue;
      ++answers;
      EXPECT_TRUE(l.is_key(b.tokens[i]));
      EXPECT_TRUE(l.is_value(b.targets[i]));
    }
    const std::vector<int32_t> argmax(b.targets.begin(), b.targets.end());  // a perfect model
    const RecallAccuracy acc = masked_argmax_accuracy(argmax, b.targets, mask);
    if (acc.total > 0) {
      EXPECT_DOUBLE_EQ(acc.accuracy(), 1.0);
    }
  }
  EXPECT_GE(answers, 64 * 3);  // every task's queries (an epoch spill may add a few)
}

// Text rows keep every target; recall rows keep exactly their answers (key → its value).
TEST(Recall, MixtureKeepsOnlyAnswerTargetsOfRecallRows) {
  RecallTaskOptions o;
  o.vocab_size = 400;
  o.token_base = 100;
  o.num_pairs = 2;
  o.num_queries = 2;
  o.filler_length = 6;
  const RecallTaskLayout l = recall_task_layout(o);
  std::vector<std::vector<int32_t>> task_docs;
  for (const auto& t : generate_recall_tasks(o, 40)) task_docs.push_back(t.tokens);
  auto tasks = TokenDataset::from_documents(task_docs, o.vocab_size);
  auto text = TokenDataset::from_documents(numbered_documents(random_lengths(40, 5, 30, 3)));
  PackedSamplerOptions opt;
  opt.batch_size = 8;
  opt.seq_len = 3 * recall_task_length(o);
  PackedSampler s({{text, 0.75}, {tasks, 0.25}}, opt);
  for (int i = 0; i < 10; ++i) {
    PackedBatch b = s.next_batch();
    const PackedBatch before = b;
    recall_keep_only_answer_targets(b, l, /*text_source=*/0);
    int64_t recall_rows = 0;
    for (int64_t r = 0; r < b.batch_size; ++r) {
      int64_t kept = 0;
      for (int64_t t = 0; t < b.seq_len; ++t) {
        const size_t k = size_t(r * b.seq_len + t);
        if (b.row_source[size_t(r)] == 0) {
          ASSERT_EQ(b.targets[k], before.targets[k]);
        } else if (b.targets[k] >= 0) {
          ++kept;
          EXPECT_TRUE(l.is_key(b.tokens[k]));
          EXPECT_TRUE(l.is_value(b.targets[k]));
          EXPECT_EQ(b.targets[k], before.targets[k]);
        }
      }
      if (b.row_source[size_t(r)] != 0) {
        ++recall_rows;
        EXPECT_EQ(kept, 3 * o.num_queries);  // three whole tasks per row, every query kept
      }
    }
    EXPECT_EQ(recall_rows, 2);
  }
}

// ---- the `deltamoe data` / `deltamoe tokenizer` commands ---------------------------------------
TEST(DataCli, BuildsTextAndRecallDatasets) {
  const std::string dir = test::temp_dir("data_cli");
  fs::create_directories(dir + "/in/sub");
  std::ofstream(dir + "/in/a.txt") << synthetic_english_document(0, 1);
  std::ofstream(dir + "/in/sub/b.md") << "# Notes\n\nSome markdown *text* 你好.\n";
  std::ofstream(dir + "/in/sub/c.jsonl") << R"({"text": "first json doc"})" << "\n\n"
                                         << R"({"text": "second one", "id": 2})" << "\n";
  std::ofstream(dir + "/in/ignored.bin") << "xx";
  auto r = test::run_cli("data --input " + dir + "/in --synthetic-english 200 --out " + dir +
                         "/ds --vocab-size 700 --val-fraction 0.05 --quiet");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json manifest = read_data_manifest(dir + "/ds");
  EXPECT_EQ(manifest["documents"].get<int64_t>(), 4 + 200);
  const Tokenizer tok = Tokenizer::load(dir + "/ds/tokenizer.json");
  EXPECT_EQ(manifest["vocab_size"].get<int64_t>(), tok.vocab_size());
  auto train = TokenDataset::open(dir + "/ds", "train");
  auto val = TokenDataset::open(dir + "/ds", "val");
  EXPECT_EQ(train->num_documents() + val->num_documents(), 204);
  EXPECT_EQ(train->vocab_size(), tok.vocab_size());
  // Refuses to mix with an old dataset; --overwrite replaces it.
  r = test::run_cli("data --input " + dir + "/in --out " + dir + "/ds --tokenizer " + dir + "/ds/tokenizer.json --quiet");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("--overwrite"), std::string::npos) << r.output;
  r = test::run_cli("data --input " + dir + "/in --out " + dir + "/ds --tokenizer " + dir +
                    "/ds/tokenizer.json --quiet --overwrite --val-fraction 0");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  auto text = TokenDataset::open(dir + "/ds");
  ASSERT_EQ(text->num_documents(), 4);
  // Documents come back in input order (a.txt, sub/b.md, sub/c.jsonl ×2) with <|endoftext|>.
  auto doc_text = [&](int64_t d) {
    const auto ids = text->document(d);
    return tok.decode(std::vector<int32_t>(ids.begin(), ids.end()));
  };
  EXPECT_EQ(doc_text(0), synthetic_english_document(0, 1) + "<|endoftext|>");
  EXPECT_EQ(doc_text(1), "# Notes\n\nSome markdown *text* 你好.\n<|endoftext|>");
  EXPECT_EQ(doc_text(3), "second one<|endoftext|>");

  r = test::run_cli("data --recall 50 --recall-pairs 4 --recall-distance 30 --out " + dir + "/rc --tokenizer " + dir +
                    "/ds/tokenizer.json --quiet");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const RecallTaskOptions ro = recall_task_options_from_json(read_data_manifest(dir + "/rc")["source"]);
  EXPECT_EQ(ro.filler_length, 30);
  EXPECT_LT(ro.token_base + 4 + 3 * 64, tok.num_ranks() + 1);  // below the special tokens
  auto rc = TokenDataset::open(dir + "/rc");
  EXPECT_EQ(rc->num_documents(), 50);
  const auto d0 = rc->document(0);
  EXPECT_EQ(std::vector<int32_t>(d0.begin(), d0.end()), generate_recall_task(ro, 0).tokens);

  r = test::run_cli("data --input " + dir + "/nope --out " + dir + "/x");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("nope"), std::string::npos) << r.output;
  std::ofstream(dir + "/bad.jsonl") << "{\"text\": 1}\n";
  r = test::run_cli("data --input " + dir + "/bad.jsonl --out " + dir + "/x --quiet");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("bad.jsonl:1"), std::string::npos) << r.output;

  r = test::run_cli("tokenizer encode --tokenizer " + dir + "/ds/tokenizer.json --text 'hi <|im_end|>' --allow-special --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ids = nlohmann::json::parse(r.output).get<std::vector<int32_t>>();
  EXPECT_EQ(ids.back(), tok.special_id("<|im_end|>"));
  r = test::run_cli("tokenizer decode --tokenizer " + dir + "/ds/tokenizer.json --ids " +
                    nlohmann::json(ids).dump().substr(1, nlohmann::json(ids).dump().size() - 2));
  EXPECT_EQ(r.output, "hi <|im_end|>\n");
}
