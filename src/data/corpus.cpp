#include "data/corpus.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "data/builtin.h"
#include "data/random.h"
#include "io/safetensors.h"  // write_file_atomic

namespace dm {
namespace fs = std::filesystem;

namespace {
bool corpus_is_text_file(const fs::path& p) {
  const std::string ext = p.extension().string();
  return ext == ".txt" || ext == ".md" || ext == ".jsonl";
}

std::string corpus_read_whole_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DM_CHECK(f.good(), path, ": cannot open");
  std::ostringstream ss;
  ss << f.rdbuf();
  DM_CHECK(!f.bad(), path, ": read failed");
  return std::move(ss).str();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

std::vector<std::string> corpus_collect_files(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const std::string& in : inputs) {
    std::error_code ec;
    DM_CHECK(fs::exists(in, ec), in, ": no such file or directory");
    if (fs::is_directory(in, ec)) {
      std::vector<std::string> found;
      for (auto it = fs::recursive_directory_iterator(in, fs::directory_options::skip_permission_denied);
           it != fs::recursive_directory_iterator(); ++it)
        if (it->is_regular_file() && corpus_is_text_file(it->path())) found.push_back(it->path().string());
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      DM_CHECK(corpus_is_text_file(in), in, ": not a .txt, .md or .jsonl file");
      files.push_back(in);
    }
  }
  DM_CHECK(!files.empty(), "no .txt, .md or .jsonl files found in the inputs");
  return files;
}

// ---------------------------------------------------------------------------------------------
namespace {
class FileDocumentStream : public DocumentStream {
 public:
  FileDocumentStream(std::vector<std::string> files, std::string separator)
      : files_(std::move(files)), separator_(std::move(separator)) {}

  bool next(std::string& document) override {
    while (true) {
      if (pending_next_ < pending_.size()) {
        document = std::move(pending_[pending_next_++]);
        return true;
      }
      if (jsonl_.is_open()) {
        if (next_jsonl_line(document)) return true;
        jsonl_.close();
        ++file_index_;
        continue;
      }
      if (file_index_ >= files_.size()) return false;
      const std::string& path = files_[file_index_];
      if (fs::path(path).extension() == ".jsonl") {
        jsonl_.open(path, std::ios::binary);
        DM_CHECK(jsonl_.is_open(), path, ": cannot open");
        line_number_ = 0;
        continue;
      }
      std::string text = corpus_read_whole_file(path);
      bytes_read_ += int64_t(text.size());
      pending_.clear();
      pending_next_ = 0;
      if (separator_.empty()) {
        if (!text.empty()) pending_.push_back(std::move(text));
      } else {
        size_t begin = 0;
        while (begin <= text.size()) {
          size_t end = text.find(separator_, begin);
          if (end == std::string::npos) end = text.size();
          if (end > begin) pending_.push_back(text.substr(begin, end - begin));
          begin = end + separator_.size();
        }
      }
      ++file_index_;
    }
  }

  void rewind() override {
    file_index_ = 0;
    pending_.clear();
    pending_next_ = 0;
    if (jsonl_.is_open()) jsonl_.close();
    bytes_read_ = 0;
  }
  int64_t bytes_read() const override { return bytes_read_; }

 private:
  bool next_jsonl_line(std::string& document) {
    const std::string& path = files_[file_index_];
    std::string line;
    while (std::getline(jsonl_, line)) {
      ++line_number_;
      bytes_read_ += int64_t(line.size()) + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        throw Error(str_cat(path, ":", line_number_, ": not valid JSON (", e.what(), ")"));
      }
      DM_CHECK(j.is_object() && j.contains("text") && j["text"].is_string(), path, ":",
               line_number_, ": expected an object with a string field 'text'");
      document = j["text"].get<std::string>();
      if (document.empty()) continue;
      return true;
    }
    DM_CHECK(!jsonl_.bad(), path, ": read failed");
    return false;
  }

  std::vector<std::string> files_;
  std::string separator_;
  size_t file_index_ = 0;
  std::ifstream jsonl_;
  int64_t line_number_ = 0;
  std::vector<std::string> pending_;
  size_t pending_next_ = 0;
  int64_t bytes_read_ = 0;
};

class ConcatDocumentStream : public DocumentStream {
 public:
  explicit ConcatDocumentStream(std::vector<std::unique_ptr<DocumentStream>> streams)
      : streams_(std::move(streams)) {}
  bool next(std::string& document) override {
    for (; current_ < streams_.size(); ++current_)
      if (streams_[current_]->next(document)) return true;
    return false;
  }
  void rewind() override {
    for (auto& s : streams_) s->rewind();
    current_ = 0;
  }
  int64_t bytes_read() const override {
    int64_t n = 0;
    for (const auto& s : streams_) n += s->bytes_read();
    return n;
  }

 private:
  std::vector<std::unique_ptr<DocumentStream>> streams_;
  size_t current_ = 0;
};

class VectorDocumentStream : public DocumentStream {
 public:
  explicit VectorDocumentStream(std::vector<std::string> docs) : docs_(std::move(docs)) {}
  bool next(std::string& document) override {
    if (next_ >= docs_.size()) return false;
    document = docs_[next_++];
    bytes_read_ += int64_t(document.size());
    return true;
  }
  void rewind() override {
    next_ = 0;
    bytes_read_ = 0;
  }
  int64_t bytes_read() const override { return bytes_read_; }

 private:
  std::vector<std::string> docs_;
  size_t next_ = 0;
  int64_t bytes_read_ = 0;
};
}  // namespace

std::unique_ptr<DocumentStream> make_file_document_stream(std::vector<std::string> files,
                                                          std::string document_separator) {
  return std::make_unique<FileDocumentStream>(std::move(files), std::move(document_separator));
}

std::unique_ptr<DocumentStream> make_vector_document_stream(std::vector<std::string> documents) {
  return std::make_unique<VectorDocumentStream>(std::move(documents));
}

std::unique_ptr<DocumentStream> make_concat_document_stream(
    std::vector<std::unique_ptr<DocumentStream>> streams) {
  return std::make_unique<ConcatDocumentStream>(std::move(streams));
}

std::vector<std::string> corpus_sample_documents(DocumentStream& stream, int64_t max_bytes) {
  std::vector<std::string> docs;
  int64_t bytes = 0;
  std::string doc;
  while (bytes < max_bytes && stream.next(doc)) {
    bytes += int64_t(doc.size());
    docs.push_back(std::move(doc));
  }
  stream.rewind();
  return docs;
}

// ---------------------------------------------------------------------------------------------
ShardSetWriter::ShardSetWriter(std::string dir, std::string split, int64_t vocab_size,
                               int64_t shard_tokens, bool overwrite)
    : dir_(std::move(dir)), split_(std::move(split)), shard_tokens_(shard_tokens), writer_(vocab_size) {
  DM_CHECK(shard_tokens >= 1, "shard size must be >= 1 token");
  std::error_code ec;
  fs::create_directories(dir_, ec);
  DM_CHECK(fs::is_directory(dir_, ec), dir_, ": cannot create the output directory");
  for (const auto& e : fs::directory_iterator(dir_)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(split_ + "_", 0) != 0 || e.path().extension() != kTokenShardExtension) continue;
    DM_CHECK(overwrite, dir_, ": already holds ", split_, " shards (", name,
             "); remove them or pass --overwrite");
    fs::remove(e.path());
  }
}

void ShardSetWriter::add_document(std::span<const int32_t> ids) {
  writer_.add_document(ids);
  ++documents_;
  tokens_ += int64_t(ids.size());
  if (writer_.num_tokens() >= shard_tokens_) flush();
}

void ShardSetWriter::flush() {
  if (writer_.num_documents() == 0) return;
  char name[64];
  std::snprintf(name, sizeof(name), "%s_%05lld%s", split_.c_str(), static_cast<long long>(shards_written_),
                kTokenShardExtension);
  writer_.write((fs::path(dir_) / name).string());
  writer_.clear();
  ++shards_written_;
}

void ShardSetWriter::finish() { flush(); }

// ---------------------------------------------------------------------------------------------
ShardBuildStats tokenize_to_shards(const Tokenizer& tokenizer, DocumentStream& stream,
                                   const ShardBuildOptions& options) {
  DM_CHECK(options.val_fraction >= 0.0 && options.val_fraction < 1.0, "val fraction ",
           options.val_fraction, " outside [0, 1)");
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t vocab = tokenizer.vocab_size();
  ShardSetWriter train(options.out_dir, "train", vocab, options.shard_tokens, options.overwrite);
  std::unique_ptr<ShardSetWriter> val;
  if (options.val_fraction > 0)
    val = std::make_unique<ShardSetWriter>(options.out_dir, "val", vocab, options.shard_tokens,
                                           options.overwrite);
  const int32_t end_of_text = options.append_end_of_text && tokenizer.has_special("<|endoftext|>")
                                  ? tokenizer.special_id("<|endoftext|>")
                                  : -1;
  constexpr size_t kEntropySampleTokens = size_t(1) << 24;
  std::vector<int32_t> entropy_sample;

  ShardBuildStats stats;
  std::vector<std::string> batch;
  std::vector<std::vector<int32_t>> batch_ids;
  double last_progress = -1;
  while (true) {
    batch.clear();
    std::string doc;
    while (int64_t(batch.size()) < options.documents_per_batch && stream.next(doc))
      if (!doc.empty()) batch.push_back(std::move(doc));
    if (batch.empty()) break;
    batch_ids.assign(batch.size(), {});
    std::exception_ptr failure;
#pragma omp parallel for schedule(dynamic, 8)
    for (int64_t i = 0; i < int64_t(batch.size()); ++i) {
      try {
        batch_ids[size_t(i)] = tokenizer.encode(batch[size_t(i)], /*allow_special=*/false);
        if (end_of_text >= 0) batch_ids[size_t(i)].push_back(end_of_text);
      } catch (...) {
#pragma omp critical
        failure = std::current_exception();
      }
    }
    if (failure) std::rethrow_exception(failure);
    for (const auto& ids : batch_ids) {
      const uint64_t doc_index = uint64_t(stats.documents++);
      stats.tokens += int64_t(ids.size());
      DataRng coin(seed_mix(options.seed, doc_index, 0x76616c));
      if (val && coin.uniform_double() < options.val_fraction) {
        val->add_document(ids);
      } else {
        train.add_document(ids);
        if (entropy_sample.size() < kEntropySampleTokens)
          entropy_sample.insert(entropy_sample.end(), ids.begin(),
                                ids.begin() + std::ptrdiff_t(std::min(ids.size(), kEntropySampleTokens - entropy_sample.size())));
      }
    }
    const double elapsed = seconds_since(t0);
    if (options.progress && elapsed - last_progress >= 0.5) {
      last_progress = elapsed;
      std::fprintf(stderr, "\r[data] %lld docs  %lld tokens  %.1f MB read  %.2f MB/s   ",
                   static_cast<long long>(stats.documents), static_cast<long long>(stats.tokens),
                   double(stream.bytes_read()) / 1e6, double(stream.bytes_read()) / 1e6 / std::max(elapsed, 1e-9));
      std::fflush(stderr);
    }
  }
  train.finish();
  if (val) val->finish();
  DM_CHECK(stats.documents > 0, "no documents in the input (all files empty?)");
  stats.input_bytes = stream.bytes_read();
  stats.train_documents = train.num_documents();
  stats.train_tokens = train.num_tokens();
  stats.train_shards = train.num_shards();
  if (val) {
    stats.val_documents = val->num_documents();
    stats.val_tokens = val->num_tokens();
    stats.val_shards = val->num_shards();
  }
  stats.unigram_entropy_nats = unigram_entropy_nats(entropy_sample);
  stats.seconds = seconds_since(t0);
  if (options.progress) {
    std::fprintf(stderr, "\r[data] %lld docs  %lld tokens  %.1f MB read  %.2f MB/s   \n",
                 static_cast<long long>(stats.documents), static_cast<long long>(stats.tokens),
                 double(stats.input_bytes) / 1e6,
                 double(stats.input_bytes) / 1e6 / std::max(stats.seconds, 1e-9));
  }
  return stats;
}

void write_data_manifest(const std::string& dir, const ShardBuildStats& stats, int64_t vocab_size,
                         const nlohmann::json& source) {
  nlohmann::ordered_json j;
  j["format"] = "deltamoe-data";
  j["version"] = 1;
  j["vocab_size"] = vocab_size;
  j["source"] = source;
  j["documents"] = stats.documents;
  j["tokens"] = stats.tokens;
  j["input_bytes"] = stats.input_bytes;
  j["train"] = {{"documents", stats.train_documents}, {"tokens", stats.train_tokens},
                {"shards", stats.train_shards}};
  j["val"] = {{"documents", stats.val_documents}, {"tokens", stats.val_tokens}, {"shards", stats.val_shards}};
  j["unigram_entropy_nats"] = stats.unigram_entropy_nats;
  j["seconds"] = stats.seconds;
  const std::string text = j.dump(2) + "\n";
  write_file_atomic((fs::path(dir) / "data.json").string(), text.data(), text.size());
}

nlohmann::json read_data_manifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / "data.json").string();
  std::ifstream f(path, std::ios::binary);
  DM_CHECK(f.good(), path, ": cannot open the data manifest");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw Error(str_cat(path, ": not valid JSON (", e.what(), ")"));
  }
  DM_CHECK(j.is_object() && j.value("format", "") == "deltamoe-data", path,
           ": field 'format' must be \"deltamoe-data\"");
  DM_CHECK(j.contains("vocab_size") && j["vocab_size"].is_number_integer(), path,
           ": field 'vocab_size' must be an integer");
  return j;
}

}  // namespace dm
