#include "clients/cpp/cartpole.h"

#include <array>
#include <cmath>

#include "gtest/gtest.h"

namespace qstream::actor {
namespace {

// From rest, pushing right (force +10): with cos = 1, sin = 0,
//   temp      = 10 / 1.1                                   = 9.0909...
//   theta_acc = -temp / (0.5 * (4/3 - 0.1 / 1.1))          = -14.6341...
//   x_acc     = temp - 0.05 * theta_acc / 1.1              = 9.7561...
// and one Euler step of 0.02 s moves only the velocities.
TEST(CartPoleTest, StepFromRestMatchesHandComputedPhysics) {
  CartPole env(1);
  std::array<float, 4> obs;
  env.Reset(obs);
  env.set_state({0, 0, 0, 0});
  StepResult r = env.Step(1, obs);
  const double temp = 10.0 / 1.1;
  const double theta_acc = -temp / (0.5 * (4.0 / 3.0 - 0.1 / 1.1));
  const double x_acc = temp - 0.05 * theta_acc / 1.1;
  EXPECT_DOUBLE_EQ(env.state().x, 0.0);
  EXPECT_NEAR(env.state().x_dot, 0.02 * x_acc, 1e-12);
  EXPECT_NEAR(env.state().x_dot, 0.1951219512195122, 1e-12);
  EXPECT_DOUBLE_EQ(env.state().theta, 0.0);
  EXPECT_NEAR(env.state().theta_dot, -0.2926829268292683, 1e-12);
  EXPECT_FLOAT_EQ(obs[1], 0.19512195f);
  EXPECT_EQ(r.reward, 1.0f);
  EXPECT_FALSE(r.terminated);
  EXPECT_FALSE(r.truncated);
}

// Reference values: gymnasium 1.x CartPole-v1 stepped from the same state.
TEST(CartPoleTest, StepMatchesGymnasiumFromTiltedState) {
  CartPole env(1);
  std::array<float, 4> obs;
  env.Reset(obs);
  env.set_state({0.1, -0.2, 0.05, 0.3});
  env.Step(0, obs);
  EXPECT_NEAR(env.state().x, 0.096, 1e-12);
  EXPECT_NEAR(env.state().x_dot, -0.3957976546439626, 1e-12);
  EXPECT_NEAR(env.state().theta, 0.056, 1e-12);
  EXPECT_NEAR(env.state().theta_dot, 0.6080233136061515, 1e-12);

  env.set_state({0.1, -0.2, 0.05, 0.3});
  env.Step(1, obs);
  EXPECT_NEAR(env.state().x_dot, -0.005625065781779709, 1e-12);
  EXPECT_NEAR(env.state().theta_dot, 0.02349585151852651, 1e-12);
}

TEST(CartPoleTest, ResetDrawsSmallStartStateAndIsSeeded) {
  CartPole a(7), b(7), c(8);
  std::array<float, 4> oa, ob, oc;
  a.Reset(oa);
  b.Reset(ob);
  c.Reset(oc);
  EXPECT_EQ(oa, ob);
  EXPECT_NE(oa, oc);
  for (float v : oa) {
    EXPECT_LE(std::abs(v), 0.05f);
  }
  EXPECT_EQ(a.elapsed_steps(), 0);
}

TEST(CartPoleTest, TerminatesWhenPoleFallsPastTwelveDegrees) {
  CartPole env(1);
  std::array<float, 4> obs;
  env.Reset(obs);
  const double limit = 12 * 2 * M_PI / 360;
  // theta moves by tau * theta_dot = 0.02 * 1.0 this step: just past the limit.
  env.set_state({0, 0, limit - 0.01, 1.0});
  StepResult r = env.Step(1, obs);
  EXPECT_GT(env.state().theta, limit);
  EXPECT_TRUE(r.terminated);
  EXPECT_FALSE(r.truncated);
  EXPECT_EQ(r.reward, 1.0f);

  env.set_state({0, 0, -(limit - 0.01), -1.0});
  EXPECT_TRUE(env.Step(0, obs).terminated);

  env.set_state({0, 0, limit - 0.03, 1.0});
  EXPECT_FALSE(env.Step(0, obs).terminated);
}

TEST(CartPoleTest, TerminatesWhenCartLeavesTrack) {
  CartPole env(1);
  std::array<float, 4> obs;
  env.Reset(obs);
  env.set_state({2.39, 1.0, 0, 0});
  EXPECT_TRUE(env.Step(1, obs).terminated);
  env.set_state({-2.39, -1.0, 0, 0});
  EXPECT_TRUE(env.Step(0, obs).terminated);
  env.set_state({2.3, 1.0, 0, 0});
  EXPECT_FALSE(env.Step(0, obs).terminated);
}

// Holding the pole upright by hand (bang-bang on the pole's angular
// velocity) survives: the episode ends by the 500-step time limit, reported
// as truncated, not terminated, exactly on step 500.
TEST(CartPoleTest, TruncatesAtFiveHundredSteps) {
  CartPole env(3);
  std::array<float, 4> obs;
  env.Reset(obs);
  for (int t = 1; t <= CartPole::kMaxEpisodeSteps; ++t) {
    const int action = obs[2] + 0.5f * obs[3] > 0 ? 1 : 0;
    StepResult r = env.Step(action, obs);
    ASSERT_FALSE(r.terminated) << "fell at step " << t;
    EXPECT_EQ(r.truncated, t == CartPole::kMaxEpisodeSteps) << "step " << t;
  }
  EXPECT_EQ(env.elapsed_steps(), 500);
  env.Reset(obs);
  EXPECT_EQ(env.elapsed_steps(), 0);
}

TEST(CartPoleTest, RandomPolicyTerminatesEarly) {
  CartPole env(5);
  std::array<float, 4> obs;
  env.Reset(obs);
  int steps = 0;
  StepResult r;
  do {
    r = env.Step(1, obs);  // always push right: falls within a few dozen steps
    ++steps;
  } while (!r.terminated && !r.truncated);
  EXPECT_TRUE(r.terminated);
  EXPECT_LT(steps, 100);
}

}  // namespace
}  // namespace qstream::actor
