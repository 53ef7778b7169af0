#include "clients/cpp/mountain_car.h"

#include <array>

#include "gtest/gtest.h"

namespace qstream::actor {
namespace {

// Reference values: gymnasium 1.x MountainCar-v0 from (-0.5, 0.01).
TEST(MountainCarTest, StepMatchesGymnasium) {
  const std::array<std::array<double, 2>, 3> expected = {{{-0.4911768436431885, 0.008823157288134098},
                                                          {-0.49017685651779175, 0.009823157452046871},
                                                          {-0.48917683959007263, 0.01082315668463707}}};
  MountainCar env(1);
  std::array<float, 2> obs;
  env.Reset(obs);
  for (int action = 0; action < 3; ++action) {
    env.set_state({-0.5, 0.01});
    StepResult r = env.Step(action, obs);
    EXPECT_NEAR(env.state().position, expected[action][0], 1e-6) << action;
    EXPECT_NEAR(env.state().velocity, expected[action][1], 1e-6) << action;
    EXPECT_EQ(r.reward, -1.0f);
    EXPECT_FALSE(r.terminated);
  }
}

TEST(MountainCarTest, ReachingTheFlagTerminates) {
  MountainCar env(1);
  std::array<float, 2> obs;
  env.Reset(obs);
  env.set_state({0.49, 0.02});
  StepResult r = env.Step(2, obs);
  EXPECT_TRUE(r.terminated);
  EXPECT_FALSE(r.truncated);
}

TEST(MountainCarTest, LeftWallStopsTheCar) {
  MountainCar env(1);
  std::array<float, 2> obs;
  env.Reset(obs);
  env.set_state({-1.19, -0.03});
  env.Step(0, obs);
  EXPECT_DOUBLE_EQ(env.state().position, MountainCar::kMinPosition);
  EXPECT_DOUBLE_EQ(env.state().velocity, 0.0);
}

TEST(MountainCarTest, ResetStartsAtRestInTheValleyAndTruncatesAt200) {
  MountainCar env(4);
  std::array<float, 2> obs;
  env.Reset(obs);
  EXPECT_GE(obs[0], -0.6f);
  EXPECT_LE(obs[0], -0.4f);
  EXPECT_EQ(obs[1], 0.0f);
  for (int t = 1; t <= MountainCar::kMaxEpisodeSteps; ++t) {
    StepResult r = env.Step(1, obs);  // doing nothing never reaches the flag
    ASSERT_FALSE(r.terminated);
    EXPECT_EQ(r.truncated, t == MountainCar::kMaxEpisodeSteps);
  }
}

}  // namespace
}  // namespace qstream::actor
