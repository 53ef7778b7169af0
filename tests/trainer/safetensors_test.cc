#include "trainer/safetensors.h"

#include <stdlib.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/trainer/file_helpers.h"

namespace qstream {
namespace {

using ::testing::HasSubstr;

using ::qstream::testing::ReadAll;
using ::qstream::testing::WriteAll;

std::string MakeTempDir() { return ::qstream::testing::MakeTempDir("safetensors_test"); }

std::string Le64(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A file of `json` as header and `buffer_bytes` zero bytes as data.
std::string RawFile(const std::string& json, uint64_t buffer_bytes) {
  return Le64(json.size()) + json + std::string(buffer_bytes, '\0');
}

struct RandomTensor {
  std::string name;
  SafetensorsDtype dtype;
  std::vector<int64_t> shape;
  std::vector<char> bytes;
};

std::vector<RandomTensor> RandomTensors(std::mt19937_64& rng) {
  std::vector<RandomTensor> out;
  const int n = std::uniform_int_distribution<int>(1, 12)(rng);
  for (int i = 0; i < n; ++i) {
    RandomTensor t;
    t.name = "layer" + std::to_string(i) + (i % 2 ? ".weight" : ".bias");
    t.dtype = rng() % 2 ? SafetensorsDtype::kF32 : SafetensorsDtype::kI32;
    const int rank = std::uniform_int_distribution<int>(0, 3)(rng);  // rank 0: a scalar
    int64_t elements = 1;
    for (int d = 0; d < rank; ++d) {
      t.shape.push_back(std::uniform_int_distribution<int64_t>(0, 9)(rng));  // 0: an empty tensor
      elements *= t.shape.back();
    }
    t.bytes.resize(static_cast<size_t>(elements) * 4);
    for (char& b : t.bytes) b = static_cast<char>(rng());
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<SafetensorsTensorRef> Refs(const std::vector<RandomTensor>& tensors) {
  std::vector<SafetensorsTensorRef> refs;
  for (const RandomTensor& t : tensors) refs.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
  return refs;
}

TEST(SafetensorsTest, RoundTripIsBitwise) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string dir = MakeTempDir();
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<RandomTensor> tensors = RandomTensors(rng);
    const std::string path = dir + "/t" + std::to_string(trial) + ".safetensors";
    const SafetensorsMetadata metadata = {{"format", "qstream"}, {"trial", std::to_string(trial)}};
    absl::StatusOr<WrittenFile> written = WriteSafetensors(path, Refs(tensors), metadata);
    ASSERT_TRUE(written.ok()) << written.status();
    EXPECT_EQ(written->bytes, ReadAll(path).size());

    absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
    ASSERT_TRUE(reader.ok()) << reader.status();
    EXPECT_EQ((*reader)->header().metadata, metadata);
    EXPECT_EQ((*reader)->header().tensors.size(), tensors.size());
    std::vector<std::string> names;
    for (const RandomTensor& t : tensors) {
      names.push_back(t.name);
      const size_t n = t.bytes.size() / 4;
      std::vector<char> got(t.bytes.size());
      absl::Status s = t.dtype == SafetensorsDtype::kF32
                           ? (*reader)->ReadF32(t.name, t.shape, {reinterpret_cast<float*>(got.data()), n})
                           : (*reader)->ReadI32(t.name, t.shape, {reinterpret_cast<int32_t*>(got.data()), n});
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(got, t.bytes) << t.name;
    }
    EXPECT_TRUE((*reader)->CheckNoOtherTensors(names).ok());
    names.pop_back();
    EXPECT_THAT((*reader)->CheckNoOtherTensors(names).message(), HasSubstr(tensors.back().name));
  }
}

// The header read with nlohmann directly: what another implementation sees.
TEST(SafetensorsTest, HeaderIsPaddedAndOffsetsAreContiguous) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string dir = MakeTempDir();
  const std::vector<RandomTensor> tensors = RandomTensors(rng);
  const std::string path = dir + "/h.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, Refs(tensors), {{"buffer", "online"}}).ok());
  const std::string file = ReadAll(path);
  ASSERT_GE(file.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[i]);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_LE(8 + n, file.size());
  const std::string json = file.substr(8, n);
  // The JSON ends at its closing brace; the rest (under 8 bytes) is spaces.
  const size_t close = json.find_last_not_of(' ');
  ASSERT_NE(close, std::string::npos);
  EXPECT_EQ(json[close], '}');
  EXPECT_LT(n - close - 1, 8u);
  const nlohmann::json header = nlohmann::json::parse(json);
  EXPECT_EQ(header["__metadata__"], (nlohmann::json{{"buffer", "online"}}));
  uint64_t offset = 0;
  for (const RandomTensor& t : tensors) {
    const nlohmann::json& e = header.at(t.name);
    EXPECT_EQ(e["dtype"], t.dtype == SafetensorsDtype::kF32 ? "F32" : "I32");
    EXPECT_EQ(e["shape"].get<std::vector<int64_t>>(), t.shape);
    EXPECT_EQ(e["data_offsets"][0].get<uint64_t>(), offset) << t.name;
    offset += t.bytes.size();
    EXPECT_EQ(e["data_offsets"][1].get<uint64_t>(), offset) << t.name;
    EXPECT_EQ(std::memcmp(file.data() + 8 + n + e["data_offsets"][0].get<uint64_t>(), t.bytes.data(),
                          t.bytes.size()),
              0)
        << t.name;
  }
  EXPECT_EQ(header.size(), tensors.size() + 1);
  EXPECT_EQ(file.size(), 8 + n + offset);
}

struct CorruptCase {
  const char* what;
  std::string file;
  const char* message;
};

TEST(SafetensorsTest, CorruptFilesAreRejectedNamingTheProblem) {
  const std::string dir = MakeTempDir();
  const std::string good = R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})";
  const std::vector<CorruptCase> cases = {
      {"short", "abc", "too short"},
      {"length beyond file", Le64(1000) + good + std::string(24, '\0'),
       "header length 1000 exceeds the file"},
      {"bad json", RawFile(R"({"w":{"dtype":"F32",)", 0), "not valid JSON"},
      {"not an object", RawFile("[1,2]", 0), "not a JSON object"},
      {"number beyond double", RawFile(R"({"w":{"dtype":"F32","shape":[1e948],"data_offsets":[0,4]}})", 4),
       "not valid JSON"},
      {"offsets beyond buffer", RawFile(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})", 20),
       "tensor w: data_offsets [0,24] beyond the 20-byte data buffer"},
      {"shape vs offsets", RawFile(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,24]}})", 24),
       "tensor w: shape [2, 2] x F32 does not fit data_offsets [0,24]"},
      {"unknown dtype", RawFile(R"({"w":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]}})", 12),
       "tensor w: unsupported dtype \"F16\""},
      {"negative dim", RawFile(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
       "tensor w: invalid shape"},
      {"end before begin", RawFile(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 8),
       "tensor w: data_offsets [8,4] end before begin"},
      {"missing offsets", RawFile(R"({"w":{"dtype":"F32","shape":[1]}})", 4), "tensor w: data_offsets"},
      {"overlap",
       RawFile(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[2],"data_offsets":[4,12]}})",
           12),
       "tensor b: data_offsets [4, 12] overlap tensor a"},
      {"gap", RawFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
       "tensor a: gap of 4 bytes"},
      {"trailing bytes", RawFile(good, 28), "tensors cover 24 bytes of the 28-byte data buffer"},
      {"metadata not strings", RawFile(R"({"__metadata__":{"k":1}})", 0), "__metadata__.k is not a string"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = dir + "/bad" + std::to_string(i) + ".safetensors";
    WriteAll(path, cases[i].file);
    absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
    ASSERT_FALSE(reader.ok()) << cases[i].what;
    EXPECT_TRUE(absl::IsDataLoss(reader.status())) << cases[i].what << ": " << reader.status();
    EXPECT_THAT(reader.status().message(), HasSubstr(path)) << cases[i].what;
    EXPECT_THAT(reader.status().message(), HasSubstr(cases[i].message)) << cases[i].what;
    // The same bytes from memory: the same refusal.
    absl::StatusOr<std::unique_ptr<SafetensorsReader>> from_bytes =
        SafetensorsReader::FromBytes(cases[i].file, "mem.safetensors");
    ASSERT_FALSE(from_bytes.ok()) << cases[i].what;
    EXPECT_TRUE(absl::IsDataLoss(from_bytes.status())) << cases[i].what << ": " << from_bytes.status();
    EXPECT_THAT(from_bytes.status().message(), HasSubstr(cases[i].message)) << cases[i].what;
  }
  // The good header itself is accepted.
  const std::string path = dir + "/good.safetensors";
  WriteAll(path, RawFile(good, 24));
  EXPECT_TRUE(SafetensorsReader::Open(path).ok());
  EXPECT_TRUE(SafetensorsReader::FromBytes(RawFile(good, 24), "mem").ok());
}

// Nesting is bounded before the JSON parser runs: it copies nested values
// recursively, and a header may be 100 MB deep. An error about a bad shape
// names the dimension instead of printing the shape (also recursive).
TEST(SafetensorsTest, DeeplyNestedHeaderIsRefusedWithoutRecursion) {
  const int depth = 1 << 20;
  const std::string deep = R"({"w":{"dtype":"F32","shape":)" + std::string(depth, '[') +
                           std::string(depth, ']') + R"(,"data_offsets":[0,4]}})";
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader =
      SafetensorsReader::FromBytes(RawFile(deep, 4), "deep.safetensors");
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().message(), "deep.safetensors: header nests deeper than 64 levels");
  // Brackets inside strings do not count.
  const std::string quoted = R"({"__metadata__":{"k":")" + std::string(1000, '[') + R"("}})";
  EXPECT_TRUE(SafetensorsReader::FromBytes(RawFile(quoted, 0), "q").ok());

  const std::string nested = R"({"w":{"dtype":"F32","shape":[[[1]]],"data_offsets":[0,4]}})";
  reader = SafetensorsReader::FromBytes(RawFile(nested, 4), "n.safetensors");
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().message(),
            "n.safetensors: tensor w: invalid shape: dimension 0 is not an integer in [0, 2^63)");
}

TEST(SafetensorsTest, FromBytesReadsWhatOpenReads) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string dir = MakeTempDir();
  const std::vector<RandomTensor> tensors = RandomTensors(rng);
  const std::string path = dir + "/m.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, Refs(tensors), {{"buffer", "online"}}).ok());
  const std::string file = ReadAll(path);
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::FromBytes(file, "m");
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->header().metadata, (SafetensorsMetadata{{"buffer", "online"}}));
  for (const RandomTensor& t : tensors) {
    const size_t n = t.bytes.size() / 4;
    std::vector<char> got(t.bytes.size());
    EXPECT_TRUE((*reader)->CheckTensor(t.name, t.dtype, t.shape).ok()) << t.name;
    absl::Status s = t.dtype == SafetensorsDtype::kF32
                         ? (*reader)->ReadF32(t.name, t.shape, {reinterpret_cast<float*>(got.data()), n})
                         : (*reader)->ReadI32(t.name, t.shape, {reinterpret_cast<int32_t*>(got.data()), n});
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(got, t.bytes) << t.name;
  }
  EXPECT_EQ((*reader)->CheckTensor("nope", SafetensorsDtype::kF32, {}).message(),
            "m: tensor nope is missing");
}

TEST(SafetensorsTest, ReadChecksNameDtypeAndShape) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/x.safetensors";
  const std::vector<float> w = {1, 2, 3, 4, 5, 6};
  ASSERT_TRUE(WriteSafetensors(path, {{"w", SafetensorsDtype::kF32, {2, 3}, w.data()}}, {}).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path, "x.safetensors");
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::vector<float> f(6);
  std::vector<int32_t> i(6);
  absl::Status s = (*reader)->ReadF32("v", {2, 3}, f);
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_EQ(s.message(), "x.safetensors: tensor v is missing");
  s = (*reader)->ReadI32("w", {2, 3}, i);
  EXPECT_EQ(s.message(), "x.safetensors: tensor w: dtype F32, expected I32");
  s = (*reader)->ReadF32("w", {3, 2}, f);
  EXPECT_EQ(s.message(), "x.safetensors: tensor w: shape [2, 3], expected [3, 2]");
  ASSERT_TRUE((*reader)->ReadF32("w", {2, 3}, f).ok());
  EXPECT_EQ(f, w);
}

TEST(SafetensorsTest, WriterRefusesBadInputAndExistingFiles) {
  const std::string dir = MakeTempDir();
  const float x = 1;
  EXPECT_THAT(EncodeSafetensorsHeader(
                  {{"a", SafetensorsDtype::kF32, {1}, &x}, {"a", SafetensorsDtype::kF32, {1}, &x}}, {})
                  .status()
                  .message(),
              HasSubstr("duplicate tensor name \"a\""));
  EXPECT_THAT(
      EncodeSafetensorsHeader({{"__metadata__", SafetensorsDtype::kF32, {1}, &x}}, {}).status().message(),
      HasSubstr("invalid tensor name"));
  EXPECT_THAT(EncodeSafetensorsHeader({{"a", SafetensorsDtype::kF32, {-2}, &x}}, {}).status().message(),
              HasSubstr("tensor a: invalid shape [-2]"));
  const std::string path = dir + "/once.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, {{"a", SafetensorsDtype::kF32, {1}, &x}}, {}).ok());
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  absl::StatusOr<WrittenFile> again = WriteSafetensors(path, {{"a", SafetensorsDtype::kF32, {1}, &x}}, {});
  EXPECT_TRUE(absl::IsAlreadyExists(again.status())) << again.status();
  EXPECT_THAT(again.status().message(), HasSubstr("open " + path));
}

}  // namespace
}  // namespace qstream
