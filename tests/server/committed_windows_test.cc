#include "server/committed_windows.h"

#include <vector>

#include "gtest/gtest.h"
#include "trainer/config.h"

namespace qstream {
namespace {

// obs_dim 1, one branch of 4 actions, n = 3.
NetworkSpec Spec() {
  v1::NetworkConfig net = DefaultConfig().network();
  net.set_obs_dim(1);
  net.clear_branch_actions();
  net.add_branch_actions(4);
  return *NetworkSpec::Create(net);
}

// One step per env of `envs`, none ending its episode.
IncomingBatch Steps(const std::vector<uint32_t>& envs, float t) {
  IncomingBatch b;
  b.kind = v1::TransitionBatch::KIND_STEP;
  b.columns.n = static_cast<int64_t>(envs.size());
  b.columns.obs_dim = 1;
  b.columns.num_branches = 1;
  for (uint32_t e : envs) {
    b.columns.obs.push_back(100.0f * e + t);
    b.columns.next_obs.push_back(100.0f * e + t + 1);
    b.columns.actions.push_back(0);
    b.columns.rewards.push_back(1);
    b.done.push_back(0);
    b.env_ids.push_back(e);
  }
  return b;
}

TEST(CommittedWindowsTest, ABatchCountsUntilFoldedThenItsWindowsDo) {
  const NStepAssembler a(Spec(), 3, 0.5f, 16);
  const int64_t wb = a.window_bytes();
  CommittedWindows c(&a);
  EXPECT_EQ(c.Commit(Steps({0, 1}, 0), 1000), 0);  // 2 rows: below 4 x 3 x 1 window
  EXPECT_EQ(c.counted_bytes(), 1000);
  EXPECT_TRUE(c.windows().empty());  // not folded yet
  EXPECT_EQ(c.Fold(), 1000 - 2 * wb);
  EXPECT_EQ(c.counted_bytes(), 2 * wb);
  EXPECT_EQ(NStepAssembler::Pending(c.windows()), 2);
  EXPECT_EQ(c.Fold(), 0);  // nothing to fold
  EXPECT_EQ(c.Clear(), 2 * wb);
  EXPECT_EQ(c.counted_bytes(), 0);
  EXPECT_TRUE(c.windows().empty());
}

TEST(CommittedWindowsTest, TheLogFoldsOnceItHoldsFourTimesNStepRowsPerWindow) {
  const NStepAssembler a(Spec(), 3, 0.5f, 16);
  const int64_t wb = a.window_bytes();
  CommittedWindows c(&a);
  ASSERT_EQ(c.Commit(Steps({0, 1}, 0), 10), 0);
  ASSERT_EQ(c.Fold(), 10 - 2 * wb);  // two windows: the log folds at 4 x 3 x 2 = 24 rows
  for (int t = 1; t < 12; ++t) ASSERT_EQ(c.Commit(Steps({0, 1}, static_cast<float>(t)), 10), 0) << t;
  EXPECT_EQ(c.counted_bytes(), 2 * wb + int64_t{11} * 10);
  EXPECT_EQ(c.Commit(Steps({0, 1}, 12), 10), 12 * 10);  // the 24th row: folded, same two windows
  EXPECT_EQ(c.counted_bytes(), 2 * wb);
  // Each window holds its newest n - 1 steps (t = 11, 12).
  google::protobuf::RepeatedPtrField<v1::NStepWindowState> saved;
  a.Save(c.windows(), &saved);
  ASSERT_EQ(saved.size(), 2);
  EXPECT_EQ(saved[1].obs(0), 111);
  EXPECT_EQ(saved[1].obs(1), 112);
  EXPECT_EQ(saved[1].last_next_obs(0), 113);
}

TEST(CommittedWindowsTest, ResetReplacesWindowsAndLog) {
  const NStepAssembler a(Spec(), 3, 0.5f, 16);
  CommittedWindows c(&a);
  ASSERT_EQ(c.Commit(Steps({0}, 0), 10), 0);
  NStepWindows restored;
  a.Replay(Steps({4, 5, 6}, 0), &restored);
  c.Reset(restored);
  EXPECT_EQ(c.counted_bytes(), 3 * a.window_bytes());
  EXPECT_EQ(c.Fold(), 0);
  EXPECT_EQ(c.windows().size(), 3u);
}

}  // namespace
}  // namespace qstream
