#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "trainer/cpu/sum_tree.h"

namespace qstream::cpu {
namespace {

// Smallest j with p_0 + ... + p_j > u, by a linear scan.
int64_t LinearFind(const std::vector<float>& p, double u) {
  double prefix = 0;
  for (size_t j = 0; j < p.size(); ++j) {
    prefix += p[j];
    if (prefix > u) return static_cast<int64_t>(j);
  }
  return -1;
}

TEST(SumTreeTest, TotalFollowsUpdates) {
  SumTree tree(5);  // not a power of two
  EXPECT_EQ(tree.total(), 0.0);
  tree.Set(0, 1.0f);
  tree.Set(4, 2.5f);
  tree.Set(2, 0.5f);
  EXPECT_DOUBLE_EQ(tree.total(), 4.0);
  tree.Set(4, 0.25f);
  EXPECT_DOUBLE_EQ(tree.total(), 1.75);
  EXPECT_EQ(tree.Get(4), 0.25f);
}

TEST(SumTreeTest, FindIsTheSmallestIndexWithPrefixAboveU) {
  SumTree tree(4);
  for (int i = 0; i < 4; ++i) tree.Set(i, 1.0f);
  EXPECT_EQ(tree.Find(0.0), 0);
  EXPECT_EQ(tree.Find(0.999), 0);
  EXPECT_EQ(tree.Find(1.0), 1);  // prefix_0 = 1 is not > 1
  EXPECT_EQ(tree.Find(3.5), 3);
  EXPECT_EQ(tree.Find(4.0), 3);  // u at the total: the last slot
  tree.Set(1, 0.0f);
  EXPECT_EQ(tree.Find(1.0), 2);  // a zero-priority slot is never found
}

TEST(SumTreeTest, AgreesWithLinearScanOnRandomPriorities) {
  constexpr int kN = 1000;
  SumTree tree(kN);
  std::vector<float> p(kN);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> d(0, 1);
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < kN; ++i) {
      p[i] = (i % 7 == 0) ? 0.0f : d(rng);
      tree.Set(i, p[i]);
    }
    double total = 0;
    for (float x : p) total += x;
    EXPECT_NEAR(tree.total(), total, 1e-9);
    for (int k = 0; k < 2000; ++k) {
      const double u = d(rng) * total;
      EXPECT_EQ(tree.Find(u), LinearFind(p, u)) << "u=" << u;
    }
  }
}

// SetRange is Set on every leaf of the range, bit for bit (every node).
TEST(SumTreeTest, SetRangeEqualsSetOnEachLeaf) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> d(0, 2);
  for (int round = 0; round < 20; ++round) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 3000);
    SumTree ranged(n), single(n);
    for (int op = 0; op < 30; ++op) {
      const int64_t first = static_cast<int64_t>(rng() % n);
      const int64_t count = static_cast<int64_t>(rng() % (n - first + 1));
      const float p = op % 5 == 0 ? 0.0f : d(rng);
      ranged.SetRange(first, count, p);
      for (int64_t i = first; i < first + count; ++i) single.Set(i, p);
      ASSERT_EQ(ranged.total(), single.total()) << "n " << n << " first " << first << " count " << count;
    }
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(ranged.Get(i), single.Get(i));
    for (int k = 0; k < 200; ++k) {
      const double u = std::uniform_real_distribution<double>(0, 1)(rng) * single.total();
      ASSERT_EQ(ranged.Find(u), single.Find(u));
    }
  }
}

}  // namespace
}  // namespace qstream::cpu
