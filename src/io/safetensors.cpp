#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace dm {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the format's own limit is 100 MB

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
}  // namespace

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY);
  DM_CHECK(fd >= 0, path, ": cannot open (", std::strerror(errno), ")");
  struct stat st{};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(str_cat(path, ": not a regular file"));
  }
  f->map_size_ = size_t(st.st_size);
  if (f->map_size_ > 0) {
    f->map_ = mmap(nullptr, f->map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    DM_CHECK(f->map_ != MAP_FAILED, path, ": mmap failed (", std::strerror(errno), ")");
  } else {
    ::close(fd);
  }
  f->parse(static_cast<const uint8_t*>(f->map_), f->map_size_);
  return f;
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::from_memory(std::vector<uint8_t> bytes,
                                                              const std::string& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->owned_ = std::move(bytes);
  f->parse(f->owned_.data(), f->owned_.size());
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ && map_ != MAP_FAILED) munmap(map_, map_size_);
}

void SafetensorsFile::parse(const uint8_t* base, size_t size) {
  const std::string& p = path_;
  DM_CHECK(size >= 8, p, ": truncated safetensors file (", size, " bytes, need at least 8)");
  const uint64_t hlen = read_u64_le(base);
  DM_CHECK(hlen <= kMaxHeaderBytes, p, ": header length ", hlen, " exceeds the 100 MB limit");
  DM_CHECK(hlen <= size - 8, p, ": header length ", hlen, " runs past the end of the file (",
           size, " bytes)");
  const char* hbeg = reinterpret_cast<const char*>(base + 8);
  json h;
  try {
    h = json::parse(hbeg, hbeg + hlen);
  } catch (const json::exception& e) {
    throw Error(str_cat(p, ": header is not valid JSON (", e.what(), ")"));
  }
  DM_CHECK(h.is_object(), p, ": header is not a JSON object");
  const uint8_t* data = base + 8 + hlen;
  const uint64_t data_size = size - 8 - hlen;

  struct Span { uint64_t b, e; const std::string* name; };
  std::vector<Span> spans;
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      DM_CHECK(v.is_object(), p, ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        DM_CHECK(m.value().is_string(), p, ": __metadata__.", m.key(), " is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    DM_CHECK(v.is_object(), p, ": tensor '", name, "': entry is not an object");
    for (auto k = v.begin(); k != v.end(); ++k)
      DM_CHECK(k.key() == "dtype" || k.key() == "shape" || k.key() == "data_offsets", p,
               ": tensor '", name, "': unknown field '", k.key(), "'");
    DM_CHECK(v.contains("dtype") && v["dtype"].is_string(), p, ": tensor '", name,
             "': missing or non-string dtype");
    Tensor t;
    const std::string dt = v["dtype"].get<std::string>();
    DM_CHECK(dtype_from_name(dt, &t.dtype), p, ": tensor '", name, "': unsupported dtype '", dt,
             "'");
    DM_CHECK(v.contains("shape") && v["shape"].is_array(), p, ": tensor '", name,
             "': missing or non-array shape");
    const json& sh = v["shape"];
    DM_CHECK(sh.size() <= size_t(kMaxDims), p, ": tensor '", name, "': ", sh.size(),
             " dimensions (at most ", kMaxDims, " supported)");
    uint64_t numel = 1;
    for (const json& d : sh) {
      DM_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0), p,
               ": tensor '", name, "': shape entries must be non-negative integers");
      const uint64_t dv = d.get<uint64_t>();
      DM_CHECK(dv <= (uint64_t(1) << 40) && (dv == 0 || numel <= (uint64_t(1) << 50) / dv), p,
               ": tensor '", name, "': shape too large");
      numel *= dv;
      t.shape.d[t.shape.ndim++] = int64_t(dv);
    }
    DM_CHECK(v.contains("data_offsets") && v["data_offsets"].is_array() &&
                 v["data_offsets"].size() == 2,
             p, ": tensor '", name, "': data_offsets must be [begin, end]");
    const json& off = v["data_offsets"];
    DM_CHECK(off[0].is_number_unsigned() && off[1].is_number_unsigned(), p, ": tensor '", name,
             "': data_offsets must be non-negative integers");
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    DM_CHECK(b <= e, p, ": tensor '", name, "': data_offsets begin ", b, " > end ", e);
    DM_CHECK(e <= data_size, p, ": tensor '", name, "': data_offsets end ", e,
             " past the data buffer (", data_size, " bytes): file truncated?");
    const uint64_t want = numel * dtype_size(t.dtype);
    DM_CHECK(e - b == want, p, ": tensor '", name, "': ", e - b, " bytes for shape ",
             t.shape.str(), " of ", dt, " (expected ", want, ")");
    t.data = const_cast<uint8_t*>(data + b);
    tensors_[name] = t;
    spans.push_back({b, e, &tensors_.find(name)->first});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.b < b.b; });
  for (size_t i = 1; i < spans.size(); ++i)
    DM_CHECK(spans[i].b >= spans[i - 1].e, p, ": tensors '", *spans[i - 1].name, "' and '",
             *spans[i].name, "' overlap in the data buffer");
}

SafetensorsReader SafetensorsReader::open(const std::string& path) {
  SafetensorsReader r;
  r.path_ = path;
  std::string index_path;
  std::vector<std::string> shard_paths;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path d(path);
    if (fs::exists(d / "model.safetensors.index.json")) {
      index_path = (d / "model.safetensors.index.json").string();
    } else if (fs::exists(d / "model.safetensors")) {
      shard_paths.push_back((d / "model.safetensors").string());
    } else {
      throw Error(str_cat(path, ": no model.safetensors or model.safetensors.index.json"));
    }
  } else if (path.size() >= 5 && path.substr(path.size() - 5) == ".json") {
    index_path = path;
  } else {
    shard_paths.push_back(path);
  }

  std::map<std::string, std::string> weight_map;
  if (!index_path.empty()) {
    std::ifstream in(index_path);
    DM_CHECK(in.good(), index_path, ": cannot open");
    json j;
    try {
      j = json::parse(in);
    } catch (const json::exception& e) {
      throw Error(str_cat(index_path, ": not valid JSON (", e.what(), ")"));
    }
    DM_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
             index_path, ": missing object 'weight_map'");
    std::map<std::string, int> shard_id;
    const fs::path dir = fs::path(index_path).parent_path();
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      DM_CHECK(it.value().is_string(), index_path, ": weight_map.", it.key(), " is not a string");
      const std::string shard = it.value().get<std::string>();
      DM_CHECK(shard.find("..") == std::string::npos && !shard.empty() && shard[0] != '/',
               index_path, ": weight_map.", it.key(), ": shard path '", shard,
               "' leaves the checkpoint folder");
      weight_map[it.key()] = shard;
      if (!shard_id.count(shard)) {
        shard_id[shard] = int(shard_paths.size());
        shard_paths.push_back((dir / shard).string());
      }
    }
  }
  for (const std::string& sp : shard_paths) r.files_.push_back(SafetensorsFile::open(sp));
  for (int fi = 0; fi < int(r.files_.size()); ++fi) {
    for (const auto& [name, t] : r.files_[fi]->tensors()) {
      DM_CHECK(!r.index_.count(name), r.files_[fi]->path(), ": tensor '", name,
               "' also appears in ", r.files_[r.index_[name].first]->path());
      if (!weight_map.empty()) {
        auto w = weight_map.find(name);
        DM_CHECK(w != weight_map.end(), r.files_[fi]->path(), ": tensor '", name,
                 "' is not listed in ", index_path);
      }
      r.index_[name] = {fi, &t};
    }
  }
  for (const auto& [name, shard] : weight_map)
    DM_CHECK(r.index_.count(name), index_path, ": tensor '", name, "' listed for shard '", shard,
             "' is not in it");
  return r;
}

const Tensor& SafetensorsReader::get(const std::string& name) const {
  auto it = index_.find(name);
  DM_CHECK(it != index_.end(), path_, ": missing tensor '", name, "'");
  return *it->second.second;
}

const Tensor& SafetensorsReader::get_checked(const std::string& name, const Shape& shape,
                                             bool allow_reshape) const {
  const Tensor& t = get(name);
  DM_CHECK(t.shape == shape || (allow_reshape && t.shape.numel() == shape.numel()),
           file_of(name), ": tensor '", name, "' has shape ", t.shape.str(), ", expected ",
           shape.str());
  DM_CHECK(t.dtype == DType::F32 || t.dtype == DType::BF16 || t.dtype == DType::F16 ||
               t.dtype == DType::F64,
           file_of(name), ": tensor '", name, "' has dtype ", dtype_name(t.dtype),
           ", expected a float type");
  return t;
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> v;
  for (const auto& kv : index_) v.push_back(kv.first);
  return v;
}

const std::string& SafetensorsReader::file_of(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? path_ : files_[it->second.first]->path();
}

const std::map<std::string, std::string>& SafetensorsReader::metadata() const {
  static const std::map<std::string, std::string> empty;
  return files_.empty() ? empty : files_[0]->metadata();
}

void SafetensorsWriter::add(const std::string& name, const Tensor& t) {
  for (const auto& kv : tensors_)
    DM_CHECK(kv.first != name, "safetensors writer: duplicate tensor '", name, "'");
  tensors_.emplace_back(name, t);
}

void SafetensorsWriter::add_f32(const std::string& name, const float* data, const Shape& shape) {
  Tensor t;
  t.data = const_cast<float*>(data);
  t.dtype = DType::F32;
  t.shape = shape;
  add(name, t);
}

std::vector<uint8_t> SafetensorsWriter::serialize() const {
  json h = json::object();
  if (!metadata_.empty()) h["__metadata__"] = metadata_;
  uint64_t off = 0;
  for (const auto& [name, t] : tensors_) {
    const uint64_t n = t.nbytes();
    h[name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape.vec()}, {"data_offsets", {off, off + n}}};
    off += n;
  }
  std::string hs = h.dump();
  while ((hs.size() + 8) % 8 != 0) hs.push_back(' ');  // keep the data buffer 8-byte aligned
  std::vector<uint8_t> out(8 + hs.size() + off);
  uint64_t hl = hs.size();
  for (int i = 0; i < 8; ++i) out[i] = uint8_t(hl >> (8 * i));
  std::memcpy(out.data() + 8, hs.data(), hs.size());
  uint8_t* d = out.data() + 8 + hs.size();
  // Order in the buffer equals insertion order, matching the offsets assigned above.
  for (const auto& [name, t] : tensors_) {
    const auto& entry = h[name]["data_offsets"];
    if (t.nbytes()) std::memcpy(d + entry[0].get<uint64_t>(), t.data, t.nbytes());
  }
  return out;
}

void SafetensorsWriter::write(const std::string& path) const {
  const std::vector<uint8_t> bytes = serialize();
  write_file_atomic(path, bytes.data(), bytes.size());
}

void write_file_atomic(const std::string& path, const void* bytes, size_t n) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  DM_CHECK(fd >= 0, tmp, ": cannot create (", std::strerror(errno), ")");
  const uint8_t* p = static_cast<const uint8_t*>(bytes);
  size_t left = n;
  while (left > 0) {
    ssize_t w = ::write(fd, p, left);
    if (w < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Error(str_cat(tmp, ": write failed (", std::strerror(err), ")"));
    }
    p += w;
    left -= size_t(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw Error(str_cat(tmp, ": fsync/close failed"));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw Error(str_cat(path, ": rename failed (", std::strerror(err), ")"));
  }
  const std::string dir = fs::path(path).has_parent_path() ? fs::path(path).parent_path().string() : ".";
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace dm
