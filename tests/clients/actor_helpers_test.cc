#include <cmath>

#include "clients/cpp/env_registry.h"
#include "clients/cpp/epsilon_schedule.h"
#include "clients/cpp/in_flight_window.h"
#include "clients/cpp/return_tracker.h"
#include "gtest/gtest.h"

namespace qstream::actor {
namespace {

// Ack.throttle: the first throttled ack halves the window, the next cut
// needs a window of acks, unthrottled acks grow it by one up to the max.
TEST(InFlightWindowTest, HalvesOncePerWindowOnThrottleAndGrowsByOne) {
  InFlightWindow w(8);
  EXPECT_EQ(w.size(), 8);
  w.OnAck(true);
  EXPECT_EQ(w.size(), 4);
  for (int i = 0; i < 3; ++i) w.OnAck(true);  // 3 acks since the cut: < 4
  EXPECT_EQ(w.size(), 4);
  w.OnAck(true);
  EXPECT_EQ(w.size(), 2);
  for (int i = 0; i < 10; ++i) w.OnAck(true);
  EXPECT_EQ(w.size(), 1);  // never below one
  w.OnAck(false);
  EXPECT_EQ(w.size(), 2);
  for (int i = 0; i < 20; ++i) w.OnAck(false);
  EXPECT_EQ(w.size(), 8);  // never above the max
}

TEST(EpsilonScheduleTest, DecaysLinearlyThenHolds) {
  EpsilonSchedule e{1.0, 0.1, 100};
  EXPECT_DOUBLE_EQ(e.At(0), 1.0);
  EXPECT_DOUBLE_EQ(e.At(50), 0.55);
  EXPECT_DOUBLE_EQ(e.At(100), 0.1);
  EXPECT_DOUBLE_EQ(e.At(1000), 0.1);
  EpsilonSchedule constant{1.0, 0.05, 0};
  EXPECT_DOUBLE_EQ(constant.At(0), 0.05);
}

TEST(ReturnTrackerTest, MeanOverLastWindowEpisodes) {
  ReturnTracker t(2, 3);
  t.AddReward(0, 1);
  t.AddReward(1, 10);
  t.AddReward(0, 1);
  EXPECT_EQ(t.steps(0), 2);
  EXPECT_EQ(t.steps(1), 1);
  EXPECT_DOUBLE_EQ(t.EndEpisode(0), 2);
  EXPECT_EQ(t.steps(0), 0);  // the next episode counts from 0
  EXPECT_EQ(t.steps(1), 1);
  EXPECT_FALSE(t.full());
  EXPECT_DOUBLE_EQ(t.EndEpisode(1), 10);
  t.AddReward(0, 3);
  t.EndEpisode(0);
  EXPECT_TRUE(t.full());
  EXPECT_DOUBLE_EQ(t.mean(), 5);
  t.AddReward(1, 6);
  t.EndEpisode(1);  // window drops the first episode (2)
  EXPECT_DOUBLE_EQ(t.mean(), (10 + 3 + 6) / 3.0);
  EXPECT_EQ(t.episodes(), 4);
}

TEST(EnvRegistryTest, KnownAndUnknownNames) {
  auto cp = MakeEnv("CartPole-v1", 1);
  ASSERT_TRUE(cp.ok());
  EXPECT_EQ((*cp)->obs_dim(), 4);
  EXPECT_EQ((*cp)->num_actions(), 2);
  auto mc = MakeEnv("MountainCar", 1);
  ASSERT_TRUE(mc.ok());
  EXPECT_EQ((*mc)->num_actions(), 3);
  auto bad = MakeEnv("Pong", 1);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("CartPole"), std::string::npos);
}

}  // namespace
}  // namespace qstream::actor
