// Token shards: the on-disk form of tokenised training data, memory-mapped for reading.
//
// File layout (little-endian; 8-byte aligned so both arrays can be used in place from the map):
//   offset  size  field
//        0     8  magic "DMTOKSHD"
//        8     4  version (1)
//       12     4  dtype (1 = u32 token ids)
//       16     8  token_count N
//       24     8  doc_count D
//       32     4  vocab_size V (0 = unknown: ids are not range-checked)
//       36     4  reserved (0)
//       40  8(D+1) doc_offsets: doc d is tokens[doc_offsets[d], doc_offsets[d+1]);
//                  doc_offsets[0] = 0, non-decreasing, doc_offsets[D] = N
//   40+8(D+1) 4N  tokens
// Files are written atomically (temp + fsync + rename). Opening validates every field and the
// exact file size, and checks each id against V; errors name the file.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace dm {

constexpr char kTokenShardMagic[8] = {'D', 'M', 'T', 'O', 'K', 'S', 'H', 'D'};
constexpr uint32_t kTokenShardVersion = 1;
constexpr uint32_t kTokenShardDTypeU32 = 1;
constexpr size_t kTokenShardHeaderBytes = 40;
// File extension of shards written by `deltamoe data` (train_00000.dmtok, val_00000.dmtok).
constexpr const char* kTokenShardExtension = ".dmtok";

// Accumulates documents in memory and writes one shard.
class TokenShardWriter {
 public:
  // vocab_size 0: ids are only required to be non-negative.
  explicit TokenShardWriter(int64_t vocab_size = 0) : vocab_size_(vocab_size) { offsets_.push_back(0); }
  void add_document(std::span<const int32_t> ids);
  int64_t num_documents() const { return int64_t(offsets_.size()) - 1; }
  int64_t num_tokens() const { return int64_t(tokens_.size()); }
  std::vector<uint8_t> serialize() const;
  void write(const std::string& path) const;  // atomic
  void clear();

 private:
  int64_t vocab_size_;
  std::vector<uint64_t> offsets_;
  std::vector<uint32_t> tokens_;
};

// One read-only shard (memory-mapped file or an owned in-memory image).
class TokenShard {
 public:
  static std::shared_ptr<TokenShard> open(const std::string& path);
  // Validates `bytes` exactly as open() does; `name` stands for the file in errors.
  static std::shared_ptr<TokenShard> from_memory(std::vector<uint8_t> bytes, const std::string& name);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::string& path() const { return path_; }
  int64_t num_documents() const { return doc_count_; }
  int64_t num_tokens() const { return token_count_; }
  int64_t vocab_size() const { return vocab_size_; }
  std::span<const uint32_t> document(int64_t d) const {
    return {tokens_ + offsets_[d], size_t(offsets_[d + 1] - offsets_[d])};
  }
  int64_t document_length(int64_t d) const { return int64_t(offsets_[d + 1] - offsets_[d]); }
  std::span<const uint32_t> tokens() const { return {tokens_, size_t(token_count_)}; }

 private:
  TokenShard() = default;
  void parse(const uint8_t* base, size_t size);

  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<uint8_t> owned_;
  int64_t token_count_ = 0, doc_count_ = 0, vocab_size_ = 0;
  const uint64_t* offsets_ = nullptr;
  const uint32_t* tokens_ = nullptr;
};

// Documents of several shards under one index (global document d = shard-major order).
class TokenDataset {
 public:
  TokenDataset() = default;
  explicit TokenDataset(std::vector<std::shared_ptr<TokenShard>> shards);
  // A directory: every <split>_*.dmtok in name order (split "train" or "val"); or one shard
  // file; throws if none is found.
  static std::shared_ptr<TokenDataset> open(const std::string& dir_or_file,
                                            const std::string& split = "train");
  static std::shared_ptr<TokenDataset> open_files(const std::vector<std::string>& files);
  // In-memory dataset (tests, generated tasks).
  static std::shared_ptr<TokenDataset> from_documents(const std::vector<std::vector<int32_t>>& docs,
                                                      int64_t vocab_size = 0,
                                                      const std::string& name = "<memory>");

  int64_t num_documents() const { return num_documents_; }
  int64_t num_tokens() const { return num_tokens_; }
  // Largest vocab_size declared by a shard (0 if none declares one).
  int64_t vocab_size() const { return vocab_size_; }
  std::span<const uint32_t> document(int64_t d) const;
  int64_t document_length(int64_t d) const;
  const std::vector<std::shared_ptr<TokenShard>>& shards() const { return shards_; }

 private:
  std::pair<size_t, int64_t> locate(int64_t d) const;
  std::vector<std::shared_ptr<TokenShard>> shards_;
  std::vector<int64_t> doc_begin_;  // first global document of each shard, plus the total
  int64_t num_documents_ = 0, num_tokens_ = 0, vocab_size_ = 0;
};

}  // namespace dm
