// safetensors reader (memory-mapped, single file or sharded via model.safetensors.index.json)
// and writer (atomic: temp file + fsync + rename). Every header field is validated; anything
// malformed throws dm::Error naming the file and the tensor.
//
// File layout: u64 little-endian header length N | N bytes of JSON | data buffer.
// JSON: {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//        "__metadata__": {"k": "v"}}; offsets are relative to the data buffer.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace dm {

// One memory-mapped .safetensors file.
class SafetensorsFile {
 public:
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  // Parses an in-memory image (used by the fuzz test); `path` only names it in errors.
  static std::unique_ptr<SafetensorsFile> from_memory(std::vector<uint8_t> bytes,
                                                      const std::string& path);
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::map<std::string, Tensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  void parse(const uint8_t* base, size_t size);

  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<uint8_t> owned_;
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint: a directory (model.safetensors or model.safetensors.index.json inside), an
// index file, or one .safetensors file.
class SafetensorsReader {
 public:
  static SafetensorsReader open(const std::string& path);

  bool has(const std::string& name) const { return index_.count(name) != 0; }
  // View into the mapping; throws naming the checkpoint if absent.
  const Tensor& get(const std::string& name) const;
  // get() + float-dtype and shape checks. allow_reshape accepts any shape with the same element
  // count (e.g. A_log stored [1,1,H,1] for an [H] parameter).
  const Tensor& get_checked(const std::string& name, const Shape& shape,
                            bool allow_reshape = false) const;
  std::vector<std::string> names() const;
  const std::string& path() const { return path_; }
  const std::string& file_of(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const;

 private:
  std::string path_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::pair<int, const Tensor*>> index_;
};

// Collects named tensors (pointers must stay valid until write) and writes one file atomically.
class SafetensorsWriter {
 public:
  void add(const std::string& name, const Tensor& t);
  void add_f32(const std::string& name, const float* data, const Shape& shape);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  void write(const std::string& path) const;
  // Header + data as bytes (for tests / in-memory use).
  std::vector<uint8_t> serialize() const;

 private:
  std::vector<std::pair<std::string, Tensor>> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes `bytes` to `path` atomically (path.tmp.<pid>, fsync, rename, fsync dir).
void write_file_atomic(const std::string& path, const void* bytes, size_t n);

}  // namespace dm
