#include "data/shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "io/safetensors.h"  // write_file_atomic

namespace dm {
namespace fs = std::filesystem;
static_assert(std::endian::native == std::endian::little,
              "token shards are little-endian and used in place from the mapping");

namespace {
template <typename T>
T shard_read_field(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
}  // namespace

// ---------------------------------------------------------------------------------------------
void TokenShardWriter::add_document(std::span<const int32_t> ids) {
  for (size_t i = 0; i < ids.size(); ++i) {
    DM_CHECK(ids[i] >= 0 && (vocab_size_ == 0 || ids[i] < vocab_size_), "token shard: document ",
             num_documents(), " has token id ", ids[i], " at position ", i, " outside [0, ",
             vocab_size_, ")");
  }
  tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  offsets_.push_back(tokens_.size());
}

void TokenShardWriter::clear() {
  tokens_.clear();
  offsets_.assign(1, 0);
}

std::vector<uint8_t> TokenShardWriter::serialize() const {
  const uint64_t doc_count = offsets_.size() - 1, token_count = tokens_.size();
  std::vector<uint8_t> bytes(kTokenShardHeaderBytes + offsets_.size() * 8 + tokens_.size() * 4);
  uint8_t* p = bytes.data();
  auto put = [&](size_t at, const void* v, size_t n) { std::memcpy(p + at, v, n); };
  const uint32_t version = kTokenShardVersion, dtype = kTokenShardDTypeU32;
  const uint32_t vocab = uint32_t(vocab_size_), reserved = 0;
  put(0, kTokenShardMagic, 8);
  put(8, &version, 4);
  put(12, &dtype, 4);
  put(16, &token_count, 8);
  put(24, &doc_count, 8);
  put(32, &vocab, 4);
  put(36, &reserved, 4);
  put(kTokenShardHeaderBytes, offsets_.data(), offsets_.size() * 8);
  if (!tokens_.empty())
    put(kTokenShardHeaderBytes + offsets_.size() * 8, tokens_.data(), tokens_.size() * 4);
  return bytes;
}

void TokenShardWriter::write(const std::string& path) const {
  const std::vector<uint8_t> bytes = serialize();
  write_file_atomic(path, bytes.data(), bytes.size());
}

// ---------------------------------------------------------------------------------------------
std::shared_ptr<TokenShard> TokenShard::open(const std::string& path) {
  std::shared_ptr<TokenShard> s(new TokenShard());
  s->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY);
  DM_CHECK(fd >= 0, path, ": cannot open token shard (", std::strerror(errno), ")");
  struct stat st{};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(str_cat(path, ": not a regular file"));
  }
  s->map_size_ = size_t(st.st_size);
  if (s->map_size_ > 0) {
    s->map_ = mmap(nullptr, s->map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    DM_CHECK(s->map_ != MAP_FAILED, path, ": mmap failed (", std::strerror(errno), ")");
  } else {
    ::close(fd);
  }
  s->parse(static_cast<const uint8_t*>(s->map_), s->map_size_);
  return s;
}

std::shared_ptr<TokenShard> TokenShard::from_memory(std::vector<uint8_t> bytes, const std::string& name) {
  std::shared_ptr<TokenShard> s(new TokenShard());
  s->path_ = name;
  s->owned_ = std::move(bytes);
  s->parse(s->owned_.data(), s->owned_.size());
  return s;
}

TokenShard::~TokenShard() {
  if (map_ && map_ != MAP_FAILED) munmap(map_, map_size_);
}

void TokenShard::parse(const uint8_t* base, size_t size) {
  const std::string& p = path_;
  DM_CHECK(size >= kTokenShardHeaderBytes, p, ": truncated token shard (", size,
           " bytes, the header alone needs ", kTokenShardHeaderBytes, ")");
  DM_CHECK(std::memcmp(base, kTokenShardMagic, 8) == 0, p,
           ": bad magic (not a deltamoe token shard; expected \"DMTOKSHD\")");
  const uint32_t version = shard_read_field<uint32_t>(base + 8);
  const uint32_t dtype = shard_read_field<uint32_t>(base + 12);
  const uint64_t token_count = shard_read_field<uint64_t>(base + 16);
  const uint64_t doc_count = shard_read_field<uint64_t>(base + 24);
  const uint32_t vocab = shard_read_field<uint32_t>(base + 32);
  const uint32_t reserved = shard_read_field<uint32_t>(base + 36);
  DM_CHECK(version == kTokenShardVersion, p, ": field 'version' is ", version, ", only ",
           kTokenShardVersion, " is supported");
  DM_CHECK(dtype == kTokenShardDTypeU32, p, ": field 'dtype' is ", dtype, ", only ",
           kTokenShardDTypeU32, " (u32 token ids) is supported");
  DM_CHECK(reserved == 0, p, ": field 'reserved' must be 0, is ", reserved);
  // Sizes: reject counts whose arrays could not fit any file before multiplying (no overflow).
  const uint64_t body = size - kTokenShardHeaderBytes;
  DM_CHECK(doc_count < body / 8, p, ": field 'doc_count' ", doc_count,
           " needs more offsets than the file holds (", size, " bytes): truncated?");
  const uint64_t offsets_bytes = (doc_count + 1) * 8;
  DM_CHECK(token_count <= (body - offsets_bytes) / 4, p, ": truncated token shard: field 'token_count' ",
           token_count, " needs ", kTokenShardHeaderBytes + offsets_bytes, "+", token_count,
           "*4 bytes, the file has ", size);
  const uint64_t expected = kTokenShardHeaderBytes + offsets_bytes + token_count * 4;
  DM_CHECK(size == expected, p, ": file has ", size - expected,
           " trailing bytes after the tokens (header declares ", expected, " bytes)");
  offsets_ = reinterpret_cast<const uint64_t*>(base + kTokenShardHeaderBytes);
  tokens_ = reinterpret_cast<const uint32_t*>(base + kTokenShardHeaderBytes + offsets_bytes);
  DM_CHECK(offsets_[0] == 0, p, ": doc_offsets[0] is ", offsets_[0], ", must be 0");
  for (uint64_t d = 0; d < doc_count; ++d) {
    DM_CHECK(offsets_[d + 1] <= token_count, p, ": doc_offsets[", d + 1, "] = ", offsets_[d + 1],
             " points past the end of the tokens (token_count ", token_count, ")");
    DM_CHECK(offsets_[d + 1] >= offsets_[d], p, ": doc_offsets[", d + 1, "] = ", offsets_[d + 1],
             " is below doc_offsets[", d, "] = ", offsets_[d], " (offsets must not decrease)");
  }
  DM_CHECK(offsets_[doc_count] == token_count, p, ": doc_offsets[", doc_count, "] = ",
           offsets_[doc_count], " must equal token_count ", token_count);
  if (vocab > 0) {
    for (uint64_t i = 0; i < token_count; ++i)
      DM_CHECK(tokens_[i] < vocab, p, ": token ", i, " has id ", tokens_[i],
               " outside the vocabulary (vocab_size ", vocab, ")");
  }
  token_count_ = int64_t(token_count);
  doc_count_ = int64_t(doc_count);
  vocab_size_ = int64_t(vocab);
}

// ---------------------------------------------------------------------------------------------
TokenDataset::TokenDataset(std::vector<std::shared_ptr<TokenShard>> shards) : shards_(std::move(shards)) {
  doc_begin_.push_back(0);
  for (const auto& s : shards_) {
    num_documents_ += s->num_documents();
    num_tokens_ += s->num_tokens();
    vocab_size_ = std::max(vocab_size_, s->vocab_size());
    doc_begin_.push_back(num_documents_);
  }
}

std::shared_ptr<TokenDataset> TokenDataset::open_files(const std::vector<std::string>& files) {
  std::vector<std::shared_ptr<TokenShard>> shards;
  for (const auto& f : files) shards.push_back(TokenShard::open(f));
  return std::make_shared<TokenDataset>(std::move(shards));
}

std::shared_ptr<TokenDataset> TokenDataset::open(const std::string& dir_or_file, const std::string& split) {
  std::error_code ec;
  if (!fs::is_directory(dir_or_file, ec)) return open_files({dir_or_file});
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir_or_file)) {
    const std::string name = e.path().filename().string();
    if (e.is_regular_file() && name.rfind(split + "_", 0) == 0 &&
        e.path().extension() == kTokenShardExtension)
      files.push_back(e.path().string());
  }
  DM_CHECK(!files.empty(), dir_or_file, ": no ", split, "_*", kTokenShardExtension,
           " token shards in this directory");
  std::sort(files.begin(), files.end());
  return open_files(files);
}

std::shared_ptr<TokenDataset> TokenDataset::from_documents(const std::vector<std::vector<int32_t>>& docs,
                                                           int64_t vocab_size, const std::string& name) {
  TokenShardWriter w(vocab_size);
  for (const auto& d : docs) w.add_document(d);
  return std::make_shared<TokenDataset>(
      std::vector<std::shared_ptr<TokenShard>>{TokenShard::from_memory(w.serialize(), name)});
}

std::pair<size_t, int64_t> TokenDataset::locate(int64_t d) const {
  DM_CHECK(d >= 0 && d < num_documents_, "token dataset: document ", d, " out of range [0, ",
           num_documents_, ")");
  const size_t s = size_t(std::upper_bound(doc_begin_.begin(), doc_begin_.end(), d) - doc_begin_.begin()) - 1;
  return {s, d - doc_begin_[s]};
}

std::span<const uint32_t> TokenDataset::document(int64_t d) const {
  const auto [s, local] = locate(d);
  return shards_[s]->document(local);
}

int64_t TokenDataset::document_length(int64_t d) const {
  const auto [s, local] = locate(d);
  return shards_[s]->document_length(local);
}

}  // namespace dm
