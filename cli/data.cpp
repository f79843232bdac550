// `deltamoe data`: build a tokenised dataset directory (train_*.dmtok, val_*.dmtok, tokenizer.json,
// data.json) from text files / folders and/or the built-in synthetic English corpus — training a
// tokenizer first when none is given — or from generated long-context recall tasks.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "command.h"
#include "core/error.h"
#include "data/builtin.h"
#include "data/corpus.h"
#include "io/tokenizer.h"

namespace {
namespace fs = std::filesystem;

struct DataOptions {
  std::vector<std::string> inputs;
  std::string out, tokenizer, pattern = "kimi", doc_separator;
  int64_t vocab_size = 4096;
  int64_t synthetic_english = 0;
  int64_t recall = 0, recall_pairs = 8, recall_queries = 1, recall_distance = 64, recall_symbols = 64;
  int64_t recall_base = -1;
  double val_fraction = 0.01;
  int64_t shard_tokens = int64_t(1) << 26;
  int64_t tokenizer_sample_bytes = int64_t(64) << 20;
  uint64_t seed = 0;
  bool overwrite = false, no_eos = false, quiet = false;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void data_build_recall(const DataOptions& o) {
  DM_CHECK(o.inputs.empty() && o.synthetic_english == 0,
           "--recall builds a task-only dataset; give --input / --synthetic-english in another call");
  dm::RecallTaskOptions r;
  r.num_keys = r.num_values = r.num_filler = int32_t(o.recall_symbols);
  r.num_pairs = int32_t(o.recall_pairs);
  r.num_queries = int32_t(o.recall_queries);
  r.filler_length = o.recall_distance;
  r.seed = o.seed;
  const int32_t needed = 4 + 3 * int32_t(o.recall_symbols);
  if (!o.tokenizer.empty()) {
    // With a real vocabulary the task ids are its rarest merges (the top ranks), below the
    // special tokens, so ordinary text rarely contains them.
    dm::Tokenizer tok = dm::Tokenizer::load_auto(o.tokenizer, o.pattern);
    r.vocab_size = tok.vocab_size();
    r.token_base = o.recall_base >= 0 ? int32_t(o.recall_base) : int32_t(tok.num_ranks()) - needed;
    fs::create_directories(o.out);
    tok.save((fs::path(o.out) / "tokenizer.json").string());
  } else {
    r.vocab_size = o.vocab_size;
    r.token_base = o.recall_base >= 0 ? int32_t(o.recall_base) : 0;
  }
  dm::recall_task_layout(r);  // validate before writing anything
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t val_count = o.val_fraction > 0 ? std::max<int64_t>(1, int64_t(double(o.recall) * o.val_fraction)) : 0;
  dm::ShardBuildStats stats;
  dm::ShardSetWriter train(o.out, "train", r.vocab_size, o.shard_tokens, o.overwrite);
  for (int64_t i = 0; i < o.recall; ++i) train.add_document(dm::generate_recall_task(r, i).tokens);
  train.finish();
  // Validation tasks continue the index sequence, so they never repeat a training task.
  dm::ShardSetWriter val(o.out, "val", r.vocab_size, o.shard_tokens, o.overwrite);
  for (int64_t i = 0; i < val_count; ++i) val.add_document(dm::generate_recall_task(r, o.recall + i).tokens);
  val.finish();
  stats.documents = o.recall + val_count;
  stats.tokens = train.num_tokens() + val.num_tokens();
  stats.train_documents = train.num_documents();
  stats.train_tokens = train.num_tokens();
  stats.train_shards = train.num_shards();
  stats.val_documents = val.num_documents();
  stats.val_tokens = val.num_tokens();
  stats.val_shards = val.num_shards();
  stats.seconds = seconds_since(t0);
  nlohmann::json source = dm::recall_task_options_to_json(r);
  source["validation_first_index"] = o.recall;
  dm::write_data_manifest(o.out, stats, r.vocab_size, source);
  std::printf("recall tasks: %lld train + %lld val documents of %lld tokens (%d pairs, distance %lld, ids [%d, %d)) -> %s\n",
              static_cast<long long>(o.recall), static_cast<long long>(val_count),
              static_cast<long long>(dm::recall_task_length(r)), r.num_pairs,
              static_cast<long long>(r.filler_length), r.token_base, r.token_base + needed, o.out.c_str());
}

void data_build_text(const DataOptions& o) {
  DM_CHECK(!o.inputs.empty() || o.synthetic_english > 0,
           "nothing to tokenise: give --input, --synthetic-english or --recall");
  std::vector<std::unique_ptr<dm::DocumentStream>> streams;
  std::vector<std::string> files;
  if (!o.inputs.empty()) {
    files = dm::corpus_collect_files(o.inputs);
    streams.push_back(dm::make_file_document_stream(files, o.doc_separator));
  }
  if (o.synthetic_english > 0) {
    dm::SyntheticEnglishOptions s;
    s.num_documents = o.synthetic_english;
    s.seed = o.seed;
    streams.push_back(dm::make_vector_document_stream(dm::synthetic_english_corpus(s)));
  }
  auto stream = dm::make_concat_document_stream(std::move(streams));

  fs::create_directories(o.out);
  const std::string tokenizer_path = (fs::path(o.out) / "tokenizer.json").string();
  dm::Tokenizer tok;
  if (!o.tokenizer.empty()) {
    tok = dm::Tokenizer::load_auto(o.tokenizer, o.pattern);
  } else {
    const std::vector<std::string> sample = dm::corpus_sample_documents(*stream, o.tokenizer_sample_bytes);
    int64_t bytes = 0;
    for (const auto& d : sample) bytes += int64_t(d.size());
    const auto t0 = std::chrono::steady_clock::now();
    tok = dm::Tokenizer::train(sample, o.vocab_size, dm::tokenizer_default_special_tokens(),
                               dm::tokenizer_pattern_by_name(o.pattern));
    if (!o.quiet)
      std::fprintf(stderr, "[data] trained a %lld-token vocabulary on %.1f MB in %.2f s\n",
                   static_cast<long long>(tok.vocab_size()), double(bytes) / 1e6, seconds_since(t0));
  }
  tok.save(tokenizer_path);

  dm::ShardBuildOptions b;
  b.out_dir = o.out;
  b.shard_tokens = o.shard_tokens;
  b.val_fraction = o.val_fraction;
  b.seed = o.seed;
  b.append_end_of_text = !o.no_eos;
  b.overwrite = o.overwrite;
  b.progress = !o.quiet;
  const dm::ShardBuildStats stats = dm::tokenize_to_shards(tok, *stream, b);
  nlohmann::json source = {{"kind", "text"}, {"inputs", files}, {"synthetic_english_documents", o.synthetic_english},
                           {"tokenizer", "tokenizer.json"}};
  dm::write_data_manifest(o.out, stats, tok.vocab_size(), source);
  std::printf("%lld documents, %lld tokens (train %lld in %lld shards, val %lld), %.2f MB/s, "
              "unigram entropy %.3f nats/token -> %s\n",
              static_cast<long long>(stats.documents), static_cast<long long>(stats.tokens),
              static_cast<long long>(stats.train_tokens), static_cast<long long>(stats.train_shards),
              static_cast<long long>(stats.val_tokens), double(stats.input_bytes) / 1e6 / std::max(stats.seconds, 1e-9),
              stats.unigram_entropy_nats, o.out.c_str());
}

dm::cli::Registrar reg("data", "Tokenise text (or generate recall tasks) into memory-mapped training shards",
                       [](CLI::App* app) {
  auto o = std::make_shared<DataOptions>();
  app->option_defaults()->always_capture_default();
  app->add_option("--input", o->inputs, ".txt/.md/.jsonl files or folders (recursive)");
  app->add_option("--out", o->out, "output directory")->required();
  auto* tok_opt = app->add_option("--tokenizer", o->tokenizer, "tokenizer.json or tiktoken file (else one is trained)");
  app->add_option("--vocab-size", o->vocab_size, "vocabulary to train (or, for --recall without --tokenizer, the id space)")
      ->excludes(tok_opt);
  app->add_option("--pattern", o->pattern, "pre-tokenisation regex, or kimi / cl100k");
  app->add_option("--synthetic-english", o->synthetic_english, "add N documents of the built-in synthetic English corpus");
  app->add_option("--recall", o->recall, "generate N multi-key recall tasks instead of text");
  app->add_option("--recall-pairs", o->recall_pairs, "key-value pairs per task");
  app->add_option("--recall-queries", o->recall_queries, "queried pairs per task");
  app->add_option("--recall-distance", o->recall_distance, "filler tokens between the pairs and the queries");
  app->add_option("--recall-symbols", o->recall_symbols, "size of each of the key / value / filler alphabets");
  app->add_option("--recall-base", o->recall_base, "first task id (default: the top ranks of --tokenizer, else 0)");
  app->add_option("--val-fraction", o->val_fraction, "fraction of documents for the val split");
  app->add_option("--shard-tokens", o->shard_tokens, "tokens per shard");
  app->add_option("--doc-separator", o->doc_separator, "split .txt/.md files into documents at this string");
  app->add_option("--tokenizer-sample-bytes", o->tokenizer_sample_bytes, "text used to train the tokenizer");
  app->add_option("--seed", o->seed, "seed of the val split and the generated data");
  app->add_flag("--overwrite", o->overwrite, "replace shards already in --out");
  app->add_flag("--no-eos", o->no_eos, "do not append <|endoftext|> to each document");
  app->add_flag("--quiet", o->quiet, "no progress line");
  app->callback([o] {
    if (o->recall > 0) data_build_recall(*o);
    else data_build_text(*o);
  });
});

}  // namespace
