#include "trainer/crc32c.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace qstream {
namespace {

// Bit-at-a-time CRC32C straight from the definition (reflected 0x82F63B78).
uint32_t ReferenceCrc32c(const unsigned char* p, size_t n) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

std::vector<unsigned char> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<unsigned char> out(n);
  for (auto& b : out) b = static_cast<unsigned char>(rng());
  return out;
}

TEST(Crc32cTest, StandardCheckValue) {
  const std::string s = "123456789";
  EXPECT_EQ(Crc32c(s.data(), s.size()), 0xE3069283u);
}

TEST(Crc32cTest, EmptyIsZero) {
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);
  EXPECT_EQ(Crc32cExtend(0x12345678u, nullptr, 0), 0x12345678u);
}

TEST(Crc32cTest, OddLengthsMatchReference) {
  std::mt19937_64 rng(std::random_device{}());
  for (size_t n : {1, 2, 3, 5, 7, 9, 15, 17, 31, 63, 255, 1021, 4099}) {
    const std::vector<unsigned char> data = RandomBytes(rng, n);
    EXPECT_EQ(Crc32c(data.data(), n), ReferenceCrc32c(data.data(), n)) << "n=" << n;
  }
}

TEST(Crc32cTest, IncrementalEqualsOneShot) {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 50; ++trial) {
    const size_t n = std::uniform_int_distribution<size_t>(0, 1 << 16)(rng);
    const std::vector<unsigned char> data = RandomBytes(rng, n);
    const uint32_t whole = Crc32c(data.data(), n);
    uint32_t crc = 0;
    size_t at = 0;
    while (at < n) {
      const size_t len = std::uniform_int_distribution<size_t>(0, n - at)(rng);
      crc = Crc32cExtend(crc, data.data() + at, len);
      at += len;
    }
    EXPECT_EQ(crc, whole) << "n=" << n;
    EXPECT_EQ(whole, ReferenceCrc32c(data.data(), n)) << "n=" << n;
  }
}

// Files are checksummed in multi-MB pieces (safetensors.cc, checkpoint.cc):
// a buffer of several MB with an odd length, split at random odd points.
TEST(Crc32cTest, LargeOddLengthBuffersMatchReference) {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 3; ++trial) {
    const size_t n = (size_t{5} << 20) + 2 * std::uniform_int_distribution<size_t>(0, 1 << 20)(rng) + 1;
    const std::vector<unsigned char> data = RandomBytes(rng, n);
    const uint32_t want = ReferenceCrc32c(data.data(), n);
    EXPECT_EQ(Crc32c(data.data(), n), want) << "n=" << n;
    uint32_t crc = 0;
    size_t at = 0;
    while (at < n) {
      const size_t len = std::min(n - at, 2 * std::uniform_int_distribution<size_t>(0, 3 << 20)(rng) + 1);
      crc = Crc32cExtend(crc, data.data() + at, len);
      at += len;
    }
    EXPECT_EQ(crc, want) << "n=" << n;
  }
}

}  // namespace
}  // namespace qstream
