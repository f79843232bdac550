// Built-in data the project generates itself, deterministically from a seed:
//   (a) an English-like synthetic corpus (templated sentences over a small lexicon, with
//       subject–verb and number agreement, pronouns that follow the document's protagonist,
//       arithmetic facts, counting sequences, lists with totals, and object–colour facts that are
//       asked back later in the same document) — small-model pre-training text with learnable
//       structure at several ranges;
//   (b) long-context tasks: multi-key associative recall / needle retrieval at a controllable
//       distance, whose accuracy shows what each context stage buys.
//
// Recall tasks are built directly from token ids in reserved ranges of the vocabulary (not as
// text through the tokenizer): the answer is then exactly one token, the distance is exact in
// tokens, and the task is the same for any tokenizer. Layout of one task document
// (ids relative to RecallTaskOptions::token_base):
//   [BEGIN] k1 v1 k2 v2 … kn vn [FILL] f1 … fD [QUERY] k_a v_a k_b v_b … [END]
// with distinct keys k from the key range, values v from the value range and filler f from the
// filler range. Answer positions are the queried keys (their target is the value); the model
// must carry n key–value pairs across D filler tokens.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "data/sampler.h"

namespace dm {

// ---- (a) synthetic English ------------------------------------------------------------------
struct SyntheticEnglishOptions {
  int64_t num_documents = 1000;
  uint64_t seed = 0;
  int min_sentences = 6, max_sentences = 16;  // per document
};
// Document `index` of the corpus of `seed` (independent of every other document).
std::string synthetic_english_document(uint64_t seed, int64_t index, int min_sentences = 6,
                                       int max_sentences = 16);
std::vector<std::string> synthetic_english_corpus(const SyntheticEnglishOptions& options);

// Empirical unigram entropy of a token stream, nats per token (−Σ p log p over id frequencies).
double unigram_entropy_nats(std::span<const int32_t> tokens);
// Empirical conditional entropy H(x_t | x_{t−1}) in nats/token: a (loose, in-sample) sign of
// how much short-range structure the stream has below its unigram entropy.
double bigram_conditional_entropy_nats(std::span<const int32_t> tokens);

// ---- (b) long-context recall tasks ----------------------------------------------------------
struct RecallTaskOptions {
  int64_t vocab_size = 0;    // ids used must lie below this
  int32_t token_base = 256;  // first reserved id (marker ids, then keys, values, filler)
  int32_t num_keys = 64;     // key alphabet size (≥ num_pairs: keys in a task are distinct)
  int32_t num_values = 64;
  int32_t num_filler = 64;
  int32_t num_pairs = 8;     // n key–value pairs
  int32_t num_queries = 1;   // queried pairs per task (distinct, ≤ num_pairs)
  int64_t filler_length = 64;  // D filler tokens between the pairs and the queries
  uint64_t seed = 0;
};

// For data.json: the options as {"kind": "recall", ...} and back (validated; errors name the field).
nlohmann::json recall_task_options_to_json(const RecallTaskOptions& options);
RecallTaskOptions recall_task_options_from_json(const nlohmann::json& j);

// The id ranges of a task configuration.
struct RecallTaskLayout {
  int32_t begin_marker = 0, fill_marker = 0, query_marker = 0, end_marker = 0;
  int32_t key_base = 0, num_keys = 0;
  int32_t value_base = 0, num_values = 0;
  int32_t filler_base = 0, num_filler = 0;
  bool is_key(int64_t id) const { return id >= key_base && id < key_base + num_keys; }
  bool is_value(int64_t id) const { return id >= value_base && id < value_base + num_values; }
};
// Validates the options (ranges inside the vocabulary, counts consistent); throws dm::Error.
RecallTaskLayout recall_task_layout(const RecallTaskOptions& options);

struct RecallTask {
  std::vector<int32_t> tokens;
  std::vector<int32_t> answer_positions;  // positions whose next token is an answer
  std::vector<int32_t> answers;           // the answer at each of those positions
  std::vector<uint8_t> answer_mask;       // [tokens.size()]: 1 at answer positions
  // Tokens between the queried pair's value in the context and the query key (the distance the
  // model must recall across), one per query.
  std::vector<int64_t> recall_distances;
};

// Task `index` of the task set of options.seed (independent of every other task).
RecallTask generate_recall_task(const RecallTaskOptions& options, int64_t index);
std::vector<RecallTask> generate_recall_tasks(const RecallTaskOptions& options, int64_t count);
// Token length of every task of these options.
int64_t recall_task_length(const RecallTaskOptions& options);

// Maps a prompt to the argmax next token: either one id per prompt position (argmax after each
// prefix, as one causal forward pass gives) or a single id (the next token after the whole
// prompt; only for tasks with one query).
using NextTokenArgmaxFn = std::function<std::vector<int32_t>(std::span<const int32_t> prompt)>;

struct RecallAccuracy {
  int64_t correct = 0, total = 0;
  double accuracy() const { return total ? double(correct) / double(total) : 0.0; }
};
// The prompt of a task is its tokens up to and including its last answer position.
RecallAccuracy recall_accuracy(const NextTokenArgmaxFn& predict, const std::vector<RecallTask>& tasks);

// Answer positions in a packed batch [B·T]: a key after a QUERY marker of the same document
// whose target is present. Lets training report recall accuracy from its own logits.
std::vector<uint8_t> recall_answer_mask(const PackedBatch& batch, const RecallTaskLayout& layout);
// Training on a mixture of text (rows from source `text_source`) and recall tasks (every other
// source): recall rows keep only their answer targets, the rest become −1. Keys, values and
// filler are uniform random draws; their targets are noise that would drown the answers.
void recall_keep_only_answer_targets(PackedBatch& batch, const RecallTaskLayout& layout,
                                     int32_t text_source);
// Counts argmax == target over mask positions (argmax [n], targets [n], mask [n]).
RecallAccuracy masked_argmax_accuracy(std::span<const int32_t> argmax, std::span<const int64_t> targets,
                                      std::span<const uint8_t> mask);

}  // namespace dm
