// Deterministic fuzzing of the two parsers that read untrusted files: safetensors images
// (SafetensorsFile::from_memory) and config.json texts (parse_config). Every mutated input must
// either parse or fail with dm::Error; any other exception (or a crash) is a bug. Accepted
// safetensors images must keep every tensor inside the image; accepted configs must round-trip
// through config_to_k3_json. Fixed seeds, a few thousand cases each, well under 10 s in total.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/error.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/params.h"
#include "test_util.h"

using Json = nlohmann::json;

namespace {

using Rng = std::mt19937_64;

// DM_FUZZ_ITERATIONS overrides the iteration counts for longer local runs.
int fuzz_iterations(int default_count) {
  const char* e = std::getenv("DM_FUZZ_ITERATIONS");
  return e ? std::max(1, std::atoi(e)) : default_count;
}

size_t pick(Rng& rng, size_t n) { return n == 0 ? 0 : size_t(rng() % n); }

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A value of a random JSON type, biased towards the ones that break naive readers.
Json random_json_value(Rng& rng) {
  switch (pick(rng, 22)) {
    case 0: return nullptr;
    case 1: return true;
    case 2: return false;
    case 3: return 0;
    case 4: return -1;
    case 5: return 1;
    case 6: return 3;
    case 7: return int64_t(1) << 31;
    case 8: return std::numeric_limits<int64_t>::max();
    case 9: return std::numeric_limits<int64_t>::min();
    case 10: return std::numeric_limits<uint64_t>::max();
    case 11: return 1e308;
    case 12: return -1e308;
    case 13: return 0.5;
    case 14: return "";
    case 15: return "situ";
    case 16: return Json::array();
    case 17: return Json::array({1, 2, 3});
    case 18: return Json::object();
    case 19: return Json{{"a", 1}};
    case 20: return Json::array({Json::array({Json::array({Json::object()})})});
    default: return int64_t(rng() % 200000) - 1000;
  }
}

// Every node of a JSON document, as JSON pointers (the root is "").
void collect_pointers(const Json& j, const Json::json_pointer& at, std::vector<Json::json_pointer>* out) {
  out->push_back(at);
  if (j.is_object())
    for (auto it = j.begin(); it != j.end(); ++it) collect_pointers(it.value(), at / it.key(), out);
  else if (j.is_array())
    for (size_t i = 0; i < j.size(); ++i) collect_pointers(j[i], at / i, out);
}

// One structural edit somewhere in `doc`: delete, retype, tweak a number, grow/shrink a list.
void mutate_json(Json& doc, Rng& rng) {
  std::vector<Json::json_pointer> nodes;
  collect_pointers(doc, Json::json_pointer(), &nodes);
  const Json::json_pointer p = nodes[pick(rng, nodes.size())];
  Json& node = doc[p];
  switch (pick(rng, 6)) {
    case 0:  // delete
      if (!p.empty()) {
        Json& parent = doc[p.parent_pointer()];
        if (parent.is_object()) parent.erase(p.back());
        else if (parent.is_array()) parent.erase(std::stoul(p.back()));
      }
      break;
    case 1:
    case 2:  // replace with another type
      node = random_json_value(rng);
      break;
    case 3:  // tweak a number
      if (node.is_number_integer()) {
        // Wrapping arithmetic (through uint64) so that extreme values cannot overflow here.
        const uint64_t v = node.is_number_unsigned() ? node.get<uint64_t>() : uint64_t(node.get<int64_t>());
        const int64_t options[] = {0, int64_t(0 - v), int64_t(v + 1), int64_t(v - 1), int64_t(v * 2),
                                   int64_t(v) / 2};
        node = options[pick(rng, 6)];
      } else if (node.is_number_float()) {
        node = node.get<double>() * (pick(rng, 2) ? -1.0 : 1e6);
      } else {
        node = random_json_value(rng);
      }
      break;
    case 4:  // grow a container
      if (node.is_array()) node.push_back(pick(rng, 2) ? random_json_value(rng) : (node.empty() ? Json(1) : node[0]));
      else if (node.is_object()) node["fuzz_" + std::to_string(pick(rng, 3))] = random_json_value(rng);
      else node = Json::array({node});
      break;
    default:  // shrink / duplicate a list element
      if (node.is_array() && !node.empty()) {
        if (pick(rng, 2)) node.erase(pick(rng, node.size()));
        else node.push_back(node[pick(rng, node.size())]);
      }
      break;
  }
}

// Byte-level damage to a text: flips, insertions, deletions, truncation.
void mutate_bytes(std::string& s, Rng& rng) {
  if (s.empty()) return;
  switch (pick(rng, 4)) {
    case 0: s[pick(rng, s.size())] ^= char(1 << pick(rng, 8)); break;
    case 1: s.insert(s.begin() + long(pick(rng, s.size() + 1)), char(pick(rng, 256))); break;
    case 2: s.erase(pick(rng, s.size()), 1 + pick(rng, 8)); break;
    default: s.resize(pick(rng, s.size())); break;
  }
}

// Textually repeats one member of the outermost object (nlohmann cannot represent duplicates).
void duplicate_member(std::string& text, const Json& doc, Rng& rng) {
  if (!doc.is_object() || doc.empty()) return;
  auto it = doc.begin();
  std::advance(it, long(pick(rng, doc.size())));
  const Json value = pick(rng, 2) ? it.value() : random_json_value(rng);
  const size_t brace = text.find('{');
  if (brace == std::string::npos) return;
  text.insert(brace + 1, Json(it.key()).dump() + ": " + value.dump() + ",");
}

// Runs `body`, returning true if it succeeded, false on dm::Error; fails the test otherwise.
template <typename F>
bool expect_success_or_dm_error(F&& body, const std::string& what) {
  try {
    body();
    return true;
  } catch (const dm::Error&) {
    return false;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": non-dm::Error exception: " << e.what();
  } catch (...) {
    ADD_FAILURE() << what << ": unknown exception";
  }
  return false;
}

}  // namespace

TEST(FuzzSafetensors, MutatedImagesParseOrFailCleanly) {
  const auto t0 = std::chrono::steady_clock::now();
  // A small valid image with several dtypes, an empty tensor, a scalar and metadata.
  std::vector<float> a(12), empty;
  std::vector<uint16_t> b(5);
  std::vector<int64_t> c(4);
  std::vector<double> s(1);
  for (size_t i = 0; i < a.size(); ++i) a[i] = float(i) * 0.5f;
  dm::SafetensorsWriter w;
  w.add_f32("model.layers.0.mlp.weight", a.data(), {3, 4});
  w.add("model.embed.bf16", dm::Tensor{b.data(), dm::DType::BF16, {5}});
  w.add("ids", dm::Tensor{c.data(), dm::DType::I64, {2, 2}});
  w.add("empty", dm::Tensor{empty.data(), dm::DType::F32, {0, 3}});
  w.add("scalar", dm::Tensor{s.data(), dm::DType::F64, {}});
  w.set_metadata("format", "pt");
  const std::vector<uint8_t> valid = w.serialize();
  ASSERT_NO_THROW(dm::SafetensorsFile::from_memory(valid, "valid.safetensors"));
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= uint64_t(valid[size_t(i)]) << (8 * i);
  const Json header = Json::parse(valid.begin() + 8, valid.begin() + 8 + long(hlen));

  Rng rng(20240607);
  int accepted = 0;
  const int kIterations = fuzz_iterations(4000);
  for (int iter = 0; iter < kIterations; ++iter) {
    std::vector<uint8_t> img = valid;
    const size_t kind = pick(rng, 6);
    if (kind == 0) {  // bit flips anywhere
      for (size_t k = 0, n = 1 + pick(rng, 4); k < n; ++k) img[pick(rng, img.size())] ^= uint8_t(1 << pick(rng, 8));
    } else if (kind == 1) {  // bit flips inside the header JSON
      for (size_t k = 0, n = 1 + pick(rng, 3); k < n; ++k) img[8 + pick(rng, hlen)] ^= uint8_t(1 << pick(rng, 8));
    } else if (kind == 2) {  // truncation
      img.resize(pick(rng, img.size()));
    } else if (kind == 3) {  // header length changes
      const uint64_t choices[] = {0, 1, hlen - 1, hlen + 1, hlen + 8, uint64_t(img.size()), uint64_t(img.size()) - 7,
                                  ~uint64_t(0), uint64_t(1) << 63, rng()};
      const uint64_t v = choices[pick(rng, 10)];
      for (int i = 0; i < 8; ++i) img[size_t(i)] = uint8_t(v >> (8 * i));
    } else {  // structural edits of the header, length fixed up (or not)
      Json h = header;
      for (size_t k = 0, n = 1 + pick(rng, 3); k < n; ++k) mutate_json(h, rng);
      if (pick(rng, 8) == 0 && h.is_object() && !h.empty()) h["copy"] = h.begin().value();  // overlapping span
      std::string hs = h.is_discarded() ? std::string("{") : h.dump();
      if (pick(rng, 10) == 0) mutate_bytes(hs, rng);
      std::vector<uint8_t> out(8 + hs.size());
      const uint64_t len = pick(rng, 10) == 0 ? hs.size() + pick(rng, 16) : hs.size();
      for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(len >> (8 * i));
      std::memcpy(out.data() + 8, hs.data(), hs.size());
      out.insert(out.end(), valid.begin() + 8 + long(hlen), valid.end());
      img = std::move(out);
    }
    // from_memory moves the vector into the file object, so the buffer address stays the same.
    const uint8_t* base = img.data();
    const size_t size = img.size();
    std::unique_ptr<dm::SafetensorsFile> f;
    const bool ok = expect_success_or_dm_error(
        [&] { f = dm::SafetensorsFile::from_memory(std::move(img), "fuzz.safetensors"); },
        "safetensors iteration " + std::to_string(iter));
    if (!ok) continue;
    ++accepted;
    for (const auto& [name, t] : f->tensors()) {
      const uint8_t* p = static_cast<const uint8_t*>(t.data);
      EXPECT_TRUE(p >= base + 8 && p + t.nbytes() <= base + size)
          << "iteration " << iter << ": tensor '" << name << "' lies outside the image";
    }
  }
  EXPECT_GT(accepted, 0);  // some mutations (e.g. in tensor data) must stay valid
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("safetensors fuzz: %d of %d mutated images accepted, %.2f s\n", accepted, kIterations, secs);
  if (!std::getenv("DM_FUZZ_ITERATIONS")) EXPECT_LT(secs, 5.0);
}

TEST(FuzzConfig, MutatedConfigsParseOrFailCleanly) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::pair<std::string, std::string>> seeds;  // (name, text)
  if (dm::test::goldens_available())
    for (const char* m : {"kimi_linear_tiny", "deepseek_v3_tiny", "kimi_k3_tiny"})
      seeds.emplace_back(m, read_text(dm::test::goldens_dir() + "/" + m + "/config.json"));
  seeds.emplace_back("configs/test.json", read_text(dm::test::source_dir() + "/configs/test.json"));
  for (const auto& [name, text] : seeds) ASSERT_NO_THROW(dm::parse_config(text, name)) << name;

  Rng rng(1234567);
  int accepted = 0, rejected = 0;
  const int kIterations = fuzz_iterations(3000);
  for (int iter = 0; iter < kIterations; ++iter) {
    const auto& [name, seed_text] = seeds[pick(rng, seeds.size())];
    std::string text;
    const size_t kind = pick(rng, 5);
    if (kind <= 2) {  // structural edits
      Json doc = Json::parse(seed_text);
      for (size_t k = 0, n = 1 + pick(rng, kind == 2 ? 4 : 1); k < n; ++k) mutate_json(doc, rng);
      text = doc.dump(pick(rng, 2) ? 2 : -1);
    } else if (kind == 3) {  // duplicated member
      Json doc = Json::parse(seed_text);
      text = seed_text;
      duplicate_member(text, doc, rng);
    } else {  // random bytes
      text = seed_text;
      for (size_t k = 0, n = 1 + pick(rng, 3); k < n; ++k) mutate_bytes(text, rng);
    }
    const std::string what = "config iteration " + std::to_string(iter) + " (" + name + ")";
    dm::ModelConfig cfg;
    if (!expect_success_or_dm_error([&] { cfg = dm::parse_config(text, name); }, what)) {
      ++rejected;
      continue;
    }
    ++accepted;
    // Whatever parses must be writable, read back identically, and countable.
    dm::ModelConfig back;
    if (expect_success_or_dm_error([&] { back = dm::parse_config(dm::config_to_k3_json(cfg), "dump"); }, what + " round-trip"))
      EXPECT_TRUE(back == cfg) << what << ": round trip changed the config\n" << text;
    else
      ADD_FAILURE() << what << ": its own dump does not parse\n" << dm::config_to_k3_json(cfg);
    expect_success_or_dm_error([&] { dm::count_params(cfg); }, what + " count_params");
  }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected, 0);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("config fuzz: %d accepted, %d rejected, %.2f s\n", accepted, rejected, secs);
  if (!std::getenv("DM_FUZZ_ITERATIONS")) EXPECT_LT(secs, 5.0);
}

TEST(FuzzCli, MalformedConfigExitsWithOne) {
  const std::string dir = dm::test::temp_dir("cfg_cli");
  ASSERT_FALSE(dir.empty());
  const std::string cases[] = {"{ \"model_type\": \"kimi_k3\", ", "[]",
                               "{\"model_type\": \"kimi_linear\", \"hidden_size\": \"big\"}"};
  int i = 0;
  for (const std::string& text : cases) {
    const std::string path = dir + "/bad" + std::to_string(i++) + ".json";
    std::ofstream(path) << text;
    const auto r = dm::test::run_cli("params --config " + path);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(path), std::string::npos) << r.output;
  }
  const auto missing = dm::test::run_cli("params --config " + dir + "/does_not_exist.json");
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  std::filesystem::remove_all(dir);
}
