// IngestCounters' episode counts: buckets and sums per env label, the
// "unnamed" label, and the bound on distinct labels ("other").
#include "server/ingest_counters.h"

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace qstream {
namespace {

EpisodeReports Reports(const std::string& env, std::vector<EpisodeReport> reports) {
  return EpisodeReports{env, std::move(reports)};
}

int64_t Total(const EpisodeCounts& c) {
  int64_t n = 0;
  for (int64_t b : c.return_buckets) n += b;
  return n;
}

// The bucket whose upper bound is `bound`.
template <size_t N>
size_t Index(const std::array<double, N>& bounds, double bound) {
  for (size_t i = 0; i < N; ++i) {
    if (bounds[i] == bound) return i;
  }
  ADD_FAILURE() << "no bucket " << bound;
  return 0;
}

TEST(IngestCountersTest, EpisodesLandInTheirBucketsUnderTheirEnv) {
  IngestCounters counters;
  EXPECT_TRUE(counters.episodes().empty());
  counters.Episodes(Reports("CartPole-v1", {{500, 500, 1}, {475, 475, 1}, {9.5, 10, 1}}));
  counters.Episodes(Reports("MountainCar-v0", {{-200, 200, 2}}));
  counters.Episodes(Reports("CartPole-v1", {}));  // nothing to count, no change
  const auto e = counters.episodes();
  ASSERT_EQ(e.size(), 2u);
  const EpisodeCounts& cart = e.at("CartPole-v1");
  EXPECT_EQ(Total(cart), 3);
  EXPECT_DOUBLE_EQ(cart.return_sum, 984.5);
  EXPECT_EQ(cart.length_sum, 985);
  // Buckets are upper bounds (le): 475 in "475", 500 in "500", 9.5 in "10".
  EXPECT_EQ(cart.return_buckets[Index(kEpisodeReturnBuckets, 475)], 1);
  EXPECT_EQ(cart.return_buckets[Index(kEpisodeReturnBuckets, 500)], 1);
  EXPECT_EQ(cart.return_buckets[Index(kEpisodeReturnBuckets, 10)], 1);
  EXPECT_EQ(cart.length_buckets[Index(kEpisodeLengthBuckets, 500)], 2);  // 475 and 500 steps
  EXPECT_EQ(cart.length_buckets[Index(kEpisodeLengthBuckets, 10)], 1);
  const EpisodeCounts& car = e.at("MountainCar-v0");
  EXPECT_EQ(car.return_buckets[Index(kEpisodeReturnBuckets, -200)], 1);
  EXPECT_DOUBLE_EQ(car.return_sum, -200);
  // Beyond the last bound: the overflow bucket.
  counters.Episodes(Reports("big", {{1e6, 1'000'000, 0}}));
  const EpisodeCounts big = counters.episodes().at("big");
  EXPECT_EQ(big.return_buckets.back(), 1);
  EXPECT_EQ(big.length_buckets.back(), 1);
}

TEST(IngestCountersTest, UnnamedEnvAndTheBoundOnDistinctLabels) {
  IngestCounters counters;
  counters.Episodes(Reports("", {{1, 1, 0}}));
  for (size_t i = 1; i < kMaxEpisodeEnvLabels; ++i)
    counters.Episodes(Reports(absl::StrCat("env-", i), {{1, 1, 0}}));
  auto e = counters.episodes();
  EXPECT_EQ(e.size(), kMaxEpisodeEnvLabels);
  EXPECT_EQ(Total(e.at(kUnnamedEnvLabel)), 1);
  EXPECT_EQ(e.count(kOtherEnvLabel), 0u);
  // Every further env counts under "other"; known ones keep their own.
  counters.Episodes(Reports("late-1", {{2, 2, 0}, {3, 3, 0}}));
  counters.Episodes(Reports("late-2", {{4, 4, 0}}));
  counters.Episodes(Reports("env-1", {{5, 5, 0}}));
  counters.Episodes(Reports("", {{6, 6, 0}}));
  e = counters.episodes();
  EXPECT_EQ(e.size(), kMaxEpisodeEnvLabels + 1);
  EXPECT_EQ(e.count("late-1"), 0u);
  EXPECT_EQ(Total(e.at(kOtherEnvLabel)), 3);
  EXPECT_DOUBLE_EQ(e.at(kOtherEnvLabel).return_sum, 9);
  EXPECT_EQ(Total(e.at("env-1")), 2);
  EXPECT_EQ(Total(e.at(kUnnamedEnvLabel)), 2);
}

}  // namespace
}  // namespace qstream
