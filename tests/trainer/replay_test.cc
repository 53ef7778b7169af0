#include "trainer/cpu/replay.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/rng.h"
#include "gtest/gtest.h"

namespace qstream::cpu {
namespace {

constexpr int kObsDim = 3;
constexpr int kBranches = 2;

// Items whose every column encodes the item number `first + i`.
TransitionColumns Items(int first, int n) {
  TransitionColumns c;
  c.n = n;
  c.obs_dim = kObsDim;
  c.num_branches = kBranches;
  for (int i = 0; i < n; ++i) {
    const float id = static_cast<float>(first + i);
    for (int d = 0; d < kObsDim; ++d) {
      c.obs.push_back(id + 0.1f * d);
      c.next_obs.push_back(-id - 0.1f * d);
    }
    c.actions.push_back(first + i);
    c.actions.push_back(-(first + i));
    c.rewards.push_back(id);
    c.discounts.push_back(0.5f * id);
  }
  return c;
}

TEST(ReplayTest, RingOverwritesTheOldestItems) {
  PrioritizedReplay replay(4, kObsDim, kBranches);
  replay.Insert(Items(0, 3));
  EXPECT_EQ(replay.size(), 3);
  replay.Insert(Items(3, 3));  // items 4, 5 land in slots 0, 1
  EXPECT_EQ(replay.size(), 4);
  const std::vector<int> expected_item = {4, 5, 2, 3};
  for (int slot = 0; slot < 4; ++slot) {
    const float id = static_cast<float>(expected_item[slot]);
    EXPECT_EQ(replay.obs(slot)[2], id + 0.2f);
    EXPECT_EQ(replay.next_obs(slot)[1], -id - 0.1f);
    EXPECT_EQ(replay.actions(slot)[0], expected_item[slot]);
    EXPECT_EQ(replay.actions(slot)[1], -expected_item[slot]);
    EXPECT_EQ(replay.reward(slot), id);
    EXPECT_EQ(replay.discount(slot), 0.5f * id);
  }
  replay.Insert(Items(100, 9));  // larger than the ring: the last 4 survive, in order
  EXPECT_EQ(replay.reward(2), 105.0f);
  EXPECT_EQ(replay.reward(1), 108.0f);
}

TEST(ReplayTest, CheckShapeNamesTheColumn) {
  PrioritizedReplay replay(4, kObsDim, kBranches);
  EXPECT_TRUE(replay.CheckShape(Items(0, 2)).ok());
  auto bad = Items(0, 2);
  bad.rewards.pop_back();
  EXPECT_NE(replay.CheckShape(bad).message().find("rewards"), std::string::npos);
  bad = Items(0, 2);
  bad.next_obs.push_back(0);
  EXPECT_NE(replay.CheckShape(bad).message().find("next_obs"), std::string::npos);
  bad = Items(0, 2);
  bad.obs_dim = 4;
  EXPECT_NE(replay.CheckShape(bad).message().find("obs_dim"), std::string::npos);
  bad = Items(0, 2);
  bad.actions.pop_back();
  EXPECT_NE(replay.CheckShape(bad).message().find("actions"), std::string::npos);
}

TEST(ReplayTest, NewItemsGetTheMaxPriority) {
  PrioritizedReplay replay(8, kObsDim, kBranches);
  replay.Insert(Items(0, 2));
  EXPECT_EQ(replay.priority(0), 1.0f);
  EXPECT_EQ(replay.max_priority(), 1.0f);
  const int64_t slots[] = {0, 1};
  const float losses[] = {3.0f, 0.5f};
  replay.UpdatePriorities(2, slots, losses, 0.0f, 0.5f);
  EXPECT_FLOAT_EQ(replay.priority(0), std::sqrt(3.0f));
  EXPECT_FLOAT_EQ(replay.priority(1), std::sqrt(0.5f));
  EXPECT_FLOAT_EQ(replay.max_priority(), std::sqrt(3.0f));
  replay.Insert(Items(2, 1));
  EXPECT_FLOAT_EQ(replay.priority(2), std::sqrt(3.0f));
  EXPECT_NEAR(replay.total_priority(), 2 * std::sqrt(3.0) + std::sqrt(0.5), 1e-6);
}

TEST(ReplayTest, DuplicateSlotsTakeTheLastItemsPriority) {
  PrioritizedReplay replay(8, kObsDim, kBranches);
  replay.Insert(Items(0, 4));
  const int64_t slots[] = {2, 1, 2};
  const float losses[] = {5.0f, 1.0f, 2.0f};
  replay.UpdatePriorities(3, slots, losses, 0.25f, 1.0f);
  EXPECT_FLOAT_EQ(replay.priority(2), 2.25f);  // b = 2 wins over b = 0
  EXPECT_FLOAT_EQ(replay.priority(1), 1.25f);
  EXPECT_FLOAT_EQ(replay.max_priority(), 5.25f);  // every written p counts
}

TEST(ReplayTest, SampleFollowsTheStepContract) {
  PrioritizedReplay replay(64, kObsDim, kBranches);
  replay.Insert(Items(0, 50));
  std::vector<float> p(50);
  for (int i = 0; i < 50; ++i) {
    p[i] = 0.1f + static_cast<float>((i * 37) % 11);
    replay.SetPriority(i, p[i]);
  }
  double total = 0;
  for (float x : p) total += x;
  constexpr int kBatch = 16;
  constexpr double kBeta = 0.7;
  int64_t slots[kBatch];
  float weights[kBatch];
  replay.Sample(kBatch, 42, 9, kBeta, slots, weights);
  std::vector<double> w(kBatch);
  for (int b = 0; b < kBatch; ++b) {
    const double u = (b + double{Uniform01(42, 9, b)}) / kBatch * total;
    double prefix = 0;
    int64_t j = 0;
    while (prefix + p[j] <= u) prefix += p[j++];
    EXPECT_EQ(slots[b], j) << "b=" << b;
    w[b] = std::pow(50.0 * p[j] / total, -kBeta);
  }
  const double max_w = *std::max_element(w.begin(), w.end());
  for (int b = 0; b < kBatch; ++b) EXPECT_NEAR(weights[b], w[b] / max_w, 1e-6);
  EXPECT_EQ(*std::max_element(weights, weights + kBatch), 1.0f);
}

TEST(ReplayTest, SamplesOnlyFilledSlots) {
  PrioritizedReplay replay(1024, kObsDim, kBranches);
  replay.Insert(Items(0, 5));
  int64_t slots[64];
  float weights[64];
  for (int step = 0; step < 20; ++step) {
    replay.Sample(64, 1, step, 0.4, slots, weights);
    for (int64_t s : slots) EXPECT_LT(s, 5);
    // Equal priorities: every weight is 1.
    for (float w : weights) EXPECT_EQ(w, 1.0f);
  }
}

// Sampling frequencies against priorities: Pearson chi-square over many steps
// with a fixed seed. 11 degrees of freedom; 31.26 is the 0.001 critical value
// of a multinomial draw (stratification only lowers the statistic).
TEST(ReplayTest, FrequenciesFollowPrioritiesChiSquare) {
  constexpr int kItems = 12;
  constexpr int kBatch = 32;
  constexpr int kSteps = 3000;
  PrioritizedReplay replay(16, kObsDim, kBranches);
  replay.Insert(Items(0, kItems));
  std::vector<double> p(kItems);
  double total = 0;
  for (int i = 0; i < kItems; ++i) {
    p[i] = 0.2 + 0.3 * i * (i % 3);  // spread over [0.2, 9.8], a few equal
    replay.SetPriority(i, static_cast<float>(p[i]));
    total += static_cast<float>(p[i]);
  }
  std::vector<double> count(kItems, 0);
  int64_t slots[kBatch];
  float weights[kBatch];
  for (int step = 0; step < kSteps; ++step) {
    replay.Sample(kBatch, 7, step, 0.4, slots, weights);
    for (int64_t s : slots) count[s] += 1;
  }
  double chi2 = 0;
  for (int i = 0; i < kItems; ++i) {
    const double expected = kSteps * kBatch * static_cast<float>(p[i]) / total;
    chi2 += (count[i] - expected) * (count[i] - expected) / expected;
  }
  std::printf("PER sampling chi-square (11 dof): %.3f\n", chi2);
  EXPECT_LT(chi2, 31.26);
  // And it is not trivially satisfied: uniform sampling would fail it.
  double chi2_uniform = 0;
  for (int i = 0; i < kItems; ++i) {
    const double expected = double{kSteps} * kBatch / kItems;
    chi2_uniform += (count[i] - expected) * (count[i] - expected) / expected;
  }
  EXPECT_GT(chi2_uniform, 1000);
}

}  // namespace
}  // namespace qstream::cpu
