// From text to token shards: finding input files, reading their documents, tokenising them in
// parallel and writing train / validation shard sets (shard.h) plus a manifest, data.json.
//
// Inputs: files or folders (searched recursively, in name order); .txt and .md files are one
// document each (or several, split at a separator string such as "<|endoftext|>"), .jsonl files
// hold one document per line in the string field "text".
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "data/shard.h"
#include "io/tokenizer.h"

namespace dm {

// The .txt / .md / .jsonl files under `inputs`, sorted; throws if a path is missing or nothing
// is found.
std::vector<std::string> corpus_collect_files(const std::vector<std::string>& inputs);

// A restartable sequence of text documents.
class DocumentStream {
 public:
  virtual ~DocumentStream() = default;
  virtual bool next(std::string& document) = 0;  // false at the end
  virtual void rewind() = 0;
  virtual int64_t bytes_read() const = 0;        // input bytes consumed since rewind
};

// Documents of files (see the top of this file). Errors name the file (and line for .jsonl).
std::unique_ptr<DocumentStream> make_file_document_stream(std::vector<std::string> files,
                                                          std::string document_separator = "");
std::unique_ptr<DocumentStream> make_vector_document_stream(std::vector<std::string> documents);

// Collects documents from the start of the stream until about max_bytes (tokenizer training
// sample); rewinds the stream afterwards.
std::vector<std::string> corpus_sample_documents(DocumentStream& stream, int64_t max_bytes);

// Writes documents into numbered shards <dir>/<split>_00000.dmtok, … of about shard_tokens
// tokens each. Refuses a directory that already holds <split>_*.dmtok shards unless overwrite
// (which deletes them first), so a rebuilt dataset never mixes with an old one.
class ShardSetWriter {
 public:
  ShardSetWriter(std::string dir, std::string split, int64_t vocab_size, int64_t shard_tokens,
                 bool overwrite);
  void add_document(std::span<const int32_t> ids);
  void finish();  // writes the last, partial shard
  int64_t num_documents() const { return documents_; }
  int64_t num_tokens() const { return tokens_; }
  int64_t num_shards() const { return shards_written_; }

 private:
  void flush();
  std::string dir_, split_;
  int64_t shard_tokens_;
  TokenShardWriter writer_;
  int64_t documents_ = 0, tokens_ = 0, shards_written_ = 0;
};

struct ShardBuildOptions {
  std::string out_dir;
  int64_t shard_tokens = int64_t(1) << 26;  // 64M tokens = 256 MB per shard
  double val_fraction = 0.0;    // documents sent to the val split (deterministic per document)
  uint64_t seed = 0;            // of the val assignment
  bool append_end_of_text = true;  // <|endoftext|> after each document (if the tokenizer has it)
  bool overwrite = false;
  bool progress = true;         // a progress line on stderr
  int64_t documents_per_batch = 2048;  // tokenised in parallel, written in order
};

struct ShardBuildStats {
  int64_t documents = 0, tokens = 0, input_bytes = 0;
  int64_t train_documents = 0, train_tokens = 0, train_shards = 0;
  int64_t val_documents = 0, val_tokens = 0, val_shards = 0;
  double seconds = 0;
  double unigram_entropy_nats = 0;  // of the first ~16M train tokens
};

// Tokenises every document of `stream` into train/val shards under options.out_dir, with a
// progress line. Deterministic for any thread count (documents are written in input order).
ShardBuildStats tokenize_to_shards(const Tokenizer& tokenizer, DocumentStream& stream,
                                   const ShardBuildOptions& options);

// Several streams one after the other.
std::unique_ptr<DocumentStream> make_concat_document_stream(
    std::vector<std::unique_ptr<DocumentStream>> streams);

// Writes <dir>/data.json describing the shard set: the stats, the vocabulary size and where the
// documents came from (`source`: e.g. {"kind": "text", "inputs": [...]}, or the recall-task
// options, from which training rebuilds the task layout).
void write_data_manifest(const std::string& dir, const ShardBuildStats& stats, int64_t vocab_size,
                         const nlohmann::json& source);
// Reads <dir>/data.json (throws naming the file if absent or malformed).
nlohmann::json read_data_manifest(const std::string& dir);

}  // namespace dm
