#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "io/safetensors.h"
#include "test_util.h"

using namespace dm;

TEST(Safetensors, RoundTripAllDtypes) {
  std::vector<float> a = {1, 2, 3, 4, 5, 6};
  std::vector<double> b = {0.5, -0.25};
  std::vector<int64_t> c = {7, 8, 9};
  SafetensorsWriter w;
  w.add_f32("a", a.data(), {2, 3});
  w.add("b", Tensor{b.data(), DType::F64, {2}});
  w.add("c", Tensor{c.data(), DType::I64, {1, 3}});
  w.set_metadata("format", "pt");
  const std::string dir = test::temp_dir("st");
  const std::string path = dir + "/x.safetensors";
  w.write(path);
  auto r = SafetensorsReader::open(path);
  EXPECT_EQ(r.get("a").shape, Shape({2, 3}));
  EXPECT_EQ(std::memcmp(r.get("a").data, a.data(), 24), 0);
  EXPECT_EQ(r.get("b").as<double>()[1], -0.25);
  EXPECT_EQ(r.get("c").as<int64_t>()[2], 9);
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_FALSE(r.has("d"));
  EXPECT_THROW(r.get("d"), Error);
  EXPECT_THROW(r.get_checked("a", {3, 2}), Error);
  EXPECT_NO_THROW(r.get_checked("a", {3, 2}, /*allow_reshape=*/true));
  // No temp file left behind by the atomic write.
  int files = 0;
  for (auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

TEST(Safetensors, ShardedIndex) {
  std::vector<float> a = {1, 2}, b = {3, 4, 5};
  const std::string dir = test::temp_dir("shard");
  SafetensorsWriter w1, w2;
  w1.add_f32("x.a", a.data(), {2});
  w2.add_f32("x.b", b.data(), {3});
  w1.write(dir + "/model-00001-of-00002.safetensors");
  w2.write(dir + "/model-00002-of-00002.safetensors");
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"metadata":{},"weight_map":{"x.a":"model-00001-of-00002.safetensors",)"
      << R"("x.b":"model-00002-of-00002.safetensors"}})";
  auto r = SafetensorsReader::open(dir);
  EXPECT_EQ(r.get("x.b").f32()[2], 5.0f);
  EXPECT_NE(r.file_of("x.a"), r.file_of("x.b"));
  // An index that lists a tensor its shard lacks is an error naming the tensor.
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map":{"x.a":"model-00001-of-00002.safetensors","x.c":"model-00001-of-00002.safetensors",)"
      << R"("x.b":"model-00002-of-00002.safetensors"}})";
  try {
    SafetensorsReader::open(dir);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x.c"), std::string::npos) << e.what();
  }
}

static std::vector<uint8_t> make_file(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> out(8 + header.size() + data_bytes, 0);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = uint8_t(n >> (8 * i));
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

TEST(Safetensors, RejectsMalformedHeaders) {
  struct Case { std::string header; size_t data; const char* needle; };
  const Case cases[] = {
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4, "past the data buffer"},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "expected 12"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12, "overlap"},
      {R"({"a":{"dtype":"Q9","shape":[2],"data_offsets":[0,8]}})", 8, "unsupported dtype"},
      {R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "non-negative"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, "begin"},
      {R"({"a":{"dtype":"F32","shape":[2]}})", 8, "data_offsets"},
      {R"({"a":[1,2]})", 8, "not an object"},
      {R"([1,2])", 0, "not a JSON object"},
      {R"({"a":)", 0, "not valid JSON"},
      {R"({"__metadata__":{"x":1}})", 0, "not a string"},
      {R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8, "too large"},
  };
  for (const Case& c : cases) {
    try {
      SafetensorsFile::from_memory(make_file(c.header, c.data), "bad.safetensors");
      ADD_FAILURE() << "accepted: " << c.header;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos)
          << c.header << " -> " << e.what();
      EXPECT_NE(std::string(e.what()).find("bad.safetensors"), std::string::npos);
    }
  }
  // Header length larger than the file.
  std::vector<uint8_t> f = make_file("{}", 0);
  f[0] = 200;
  EXPECT_THROW(SafetensorsFile::from_memory(f, "x"), Error);
  // Truncated below 8 bytes.
  EXPECT_THROW(SafetensorsFile::from_memory(std::vector<uint8_t>(5, 0), "x"), Error);
  // Oversized header length.
  std::vector<uint8_t> g(16, 0xff);
  EXPECT_THROW(SafetensorsFile::from_memory(g, "x"), Error);
}
