// Long-context recall tasks (multi-key associative recall / needle retrieval). See builtin.h.
#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "data/builtin.h"
#include "data/random.h"

namespace dm {

RecallTaskLayout recall_task_layout(const RecallTaskOptions& o) {
  DM_CHECK(o.num_keys >= 1 && o.num_values >= 1 && o.num_filler >= 1, "recall tasks: num_keys, ",
           "num_values and num_filler must be >= 1");
  DM_CHECK(o.num_pairs >= 1 && o.num_pairs <= o.num_keys, "recall tasks: num_pairs ", o.num_pairs,
           " must be in [1, num_keys = ", o.num_keys, "] (keys in a task are distinct)");
  DM_CHECK(o.num_queries >= 1 && o.num_queries <= o.num_pairs, "recall tasks: num_queries ",
           o.num_queries, " must be in [1, num_pairs = ", o.num_pairs, "]");
  DM_CHECK(o.filler_length >= 0, "recall tasks: filler_length must be >= 0");
  RecallTaskLayout l;
  l.begin_marker = o.token_base;
  l.fill_marker = o.token_base + 1;
  l.query_marker = o.token_base + 2;
  l.end_marker = o.token_base + 3;
  l.key_base = o.token_base + 4;
  l.num_keys = o.num_keys;
  l.value_base = l.key_base + o.num_keys;
  l.num_values = o.num_values;
  l.filler_base = l.value_base + o.num_values;
  l.num_filler = o.num_filler;
  const int64_t end = int64_t(l.filler_base) + o.num_filler;
  DM_CHECK(o.token_base >= 0 && end <= o.vocab_size, "recall tasks: ids [", o.token_base, ", ", end,
           ") do not fit in the vocabulary of ", o.vocab_size, " tokens");
  return l;
}

nlohmann::json recall_task_options_to_json(const RecallTaskOptions& o) {
  return {{"kind", "recall"},        {"vocab_size", o.vocab_size},   {"token_base", o.token_base},
          {"num_keys", o.num_keys},  {"num_values", o.num_values},   {"num_filler", o.num_filler},
          {"num_pairs", o.num_pairs}, {"num_queries", o.num_queries}, {"filler_length", o.filler_length},
          {"seed", o.seed}};
}

RecallTaskOptions recall_task_options_from_json(const nlohmann::json& j) {
  DM_CHECK(j.is_object() && j.value("kind", "") == "recall",
           "recall task options: field 'kind' must be \"recall\"");
  auto int_field = [&](const char* name) {
    DM_CHECK(j.contains(name) && j[name].is_number_integer(), "recall task options: field '", name,
             "' must be an integer");
    return j[name].get<int64_t>();
  };
  RecallTaskOptions o;
  o.vocab_size = int_field("vocab_size");
  o.token_base = int32_t(int_field("token_base"));
  o.num_keys = int32_t(int_field("num_keys"));
  o.num_values = int32_t(int_field("num_values"));
  o.num_filler = int32_t(int_field("num_filler"));
  o.num_pairs = int32_t(int_field("num_pairs"));
  o.num_queries = int32_t(int_field("num_queries"));
  o.filler_length = int_field("filler_length");
  o.seed = uint64_t(int_field("seed"));
  recall_task_layout(o);  // validates
  return o;
}

int64_t recall_task_length(const RecallTaskOptions& o) {
  return 1 + 2 * int64_t(o.num_pairs) + 1 + o.filler_length + 1 + 2 * int64_t(o.num_queries) + 1;
}

RecallTask generate_recall_task(const RecallTaskOptions& o, int64_t index) {
  const RecallTaskLayout l = recall_task_layout(o);
  DataRng rng(seed_mix(o.seed, uint64_t(index), 0x7265636131ull));
  // Distinct keys: the first num_pairs of a partial Fisher–Yates over the key alphabet.
  std::vector<int32_t> keys(size_t(o.num_keys));
  std::iota(keys.begin(), keys.end(), l.key_base);
  for (int32_t i = 0; i < o.num_pairs; ++i)
    std::swap(keys[size_t(i)], keys[size_t(i + int32_t(rng.uniform(uint64_t(o.num_keys - i))))]);
  std::vector<int32_t> values(size_t(o.num_pairs));
  for (auto& v : values) v = l.value_base + int32_t(rng.uniform(uint64_t(o.num_values)));
  std::vector<int32_t> queried(size_t(o.num_pairs));
  std::iota(queried.begin(), queried.end(), 0);
  for (int32_t i = 0; i < o.num_queries; ++i)
    std::swap(queried[size_t(i)], queried[size_t(i + int32_t(rng.uniform(uint64_t(o.num_pairs - i))))]);

  RecallTask task;
  task.tokens.reserve(size_t(recall_task_length(o)));
  task.tokens.push_back(l.begin_marker);
  for (int32_t i = 0; i < o.num_pairs; ++i) {
    task.tokens.push_back(keys[size_t(i)]);
    task.tokens.push_back(values[size_t(i)]);
  }
  task.tokens.push_back(l.fill_marker);
  for (int64_t f = 0; f < o.filler_length; ++f)
    task.tokens.push_back(l.filler_base + int32_t(rng.uniform(uint64_t(o.num_filler))));
  task.tokens.push_back(l.query_marker);
  for (int32_t q = 0; q < o.num_queries; ++q) {
    const int32_t pair = queried[size_t(q)];
    const int32_t key_position = int32_t(task.tokens.size());
    task.tokens.push_back(keys[size_t(pair)]);
    task.tokens.push_back(values[size_t(pair)]);
    task.answer_positions.push_back(key_position);
    task.answers.push_back(values[size_t(pair)]);
    task.recall_distances.push_back(key_position - (2 + 2 * int64_t(pair)));  // value of pair at 2+2i
  }
  task.tokens.push_back(l.end_marker);
  task.answer_mask.assign(task.tokens.size(), 0);
  for (int32_t p : task.answer_positions) task.answer_mask[size_t(p)] = 1;
  return task;
}

std::vector<RecallTask> generate_recall_tasks(const RecallTaskOptions& options, int64_t count) {
  recall_task_layout(options);  // validate once, before the parallel loop
  std::vector<RecallTask> tasks(size_t(std::max<int64_t>(count, 0)));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) tasks[size_t(i)] = generate_recall_task(options, i);
  return tasks;
}

RecallAccuracy recall_accuracy(const NextTokenArgmaxFn& predict, const std::vector<RecallTask>& tasks) {
  RecallAccuracy acc;
  for (size_t k = 0; k < tasks.size(); ++k) {
    const RecallTask& task = tasks[k];
    if (task.answer_positions.empty()) continue;
    const size_t prompt_length = size_t(task.answer_positions.back()) + 1;
    const std::span<const int32_t> prompt(task.tokens.data(), prompt_length);
    const std::vector<int32_t> predicted = predict(prompt);
    if (predicted.size() == prompt_length) {
      for (size_t q = 0; q < task.answer_positions.size(); ++q)
        acc.correct += predicted[size_t(task.answer_positions[q])] == task.answers[q];
    } else {
      DM_CHECK(predicted.size() == 1 && task.answers.size() == 1, "recall_accuracy: task ", k,
               ": the predictor returned ", predicted.size(), " ids for a prompt of ", prompt_length,
               " tokens (expected one per position, or one for a single-query task)");
      acc.correct += predicted[0] == task.answers[0];
    }
    acc.total += int64_t(task.answer_positions.size());
  }
  return acc;
}

std::vector<uint8_t> recall_answer_mask(const PackedBatch& batch, const RecallTaskLayout& layout) {
  const int64_t B = batch.batch_size, T = batch.seq_len;
  std::vector<uint8_t> mask(size_t(B * T), 0);
  for (int64_t b = 0; b < B; ++b) {
    // A small state machine over the row: after a QUERY marker the document must continue as
    // key, value, key, value…; each key whose target is a value is an answer position. Anything
    // else (a new document, another token) ends the query section, so ordinary text that happens
    // to contain these ids is not counted.
    bool in_query = false, expect_key = false;
    for (int64_t t = 0; t < T; ++t) {
      const size_t i = size_t(b * T + t);
      const int64_t tok = batch.tokens[i];
      if (batch.doc_start[i] == t) in_query = false;
      if (tok == layout.query_marker) {
        in_query = expect_key = true;
        continue;
      }
      if (!in_query) continue;
      if (expect_key && layout.is_key(tok)) {
        mask[i] = batch.targets[i] >= 0 && layout.is_value(batch.targets[i]);
        expect_key = false;
      } else if (!expect_key && layout.is_value(tok)) {
        expect_key = true;
      } else {
        in_query = false;
      }
    }
  }
  return mask;
}

RecallAccuracy masked_argmax_accuracy(std::span<const int32_t> argmax, std::span<const int64_t> targets,
                                      std::span<const uint8_t> mask) {
  DM_CHECK(argmax.size() == targets.size() && mask.size() == targets.size(),
           "masked_argmax_accuracy: argmax, targets and mask lengths differ (", argmax.size(), ", ",
           targets.size(), ", ", mask.size(), ")");
  RecallAccuracy acc;
  for (size_t i = 0; i < mask.size(); ++i) {
    if (!mask[i]) continue;
    ++acc.total;
    acc.correct += int64_t(argmax[i]) == targets[i];
  }
  return acc;
}

void recall_keep_only_answer_targets(PackedBatch& batch, const RecallTaskLayout& layout,
                                     int32_t text_source) {
  const std::vector<uint8_t> answers = recall_answer_mask(batch, layout);
  const int64_t T = batch.seq_len;
  for (int64_t r = 0; r < batch.batch_size; ++r) {
    if (batch.row_source[size_t(r)] == text_source) continue;
    for (int64_t t = 0; t < T; ++t)
      if (!answers[size_t(r * T + t)]) batch.targets[size_t(r * T + t)] = -1;
  }
}

}  // namespace dm
