// Learner::PauseAtStep against the real CPU backend: the learner stops at
// exactly that step count, Status reports the pending stop and then clears
// it, Resume continues, and a step already reached pauses at once.
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>

#include "gtest/gtest.h"
#include "tests/trainer/cpu_learner_util.h"
#include "trainer/config.h"
#include "trainer/learner.h"

namespace qstream {
namespace {

using testing::InsertAndWait;
using testing::MakeCpuLearner;
using testing::RandomItems;
using testing::SetSmallNetwork;

constexpr int kBatchSize = 8;

// A small network; with samples_per_insert 1 and an error buffer of one
// batch the learner takes exactly inserts / batch_size steps and then waits
// for data (sampling needs inserts - samples >= batch_size).
v1::TrainerConfig Config(bool rate_limited) {
  v1::TrainerConfig c;
  SetSmallNetwork(&c);
  c.mutable_replay()->set_capacity(4096);
  c.mutable_replay()->set_batch_size(kBatchSize);
  c.mutable_rate_limiter()->set_min_size_to_sample(kBatchSize);
  c.mutable_rate_limiter()->set_samples_per_insert(rate_limited ? 1 : 0);
  c.mutable_rate_limiter()->set_error_buffer(kBatchSize);
  c.mutable_server()->set_publish_every(1000);
  c.mutable_server()->set_stats_every(1);
  c.mutable_checkpoint()->set_every_seconds(0);
  c.set_seed(3);
  FillDefaults(&c);
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  return c;
}

void Insert(Learner* learner, int n, uint32_t seed) { InsertAndWait(learner, RandomItems(n, seed)); }

// Polls the learner's status until `pred` holds or 30 s pass; returns the last status.
template <typename Pred>
LearnerStatus WaitForStatus(const Learner& learner, Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  LearnerStatus s = learner.status();
  while (!pred(s) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    s = learner.status();
  }
  EXPECT_TRUE(pred(s)) << "timed out: steps " << s.steps << " paused " << s.paused << " pause_at_step "
                       << s.pause_at_step;
  return s;
}

// Waits until a rate-limited learner has taken every step its inserts allow.
LearnerStatus WaitForIdleAt(const Learner& learner, int64_t steps) {
  return WaitForStatus(learner,
                       [steps](const LearnerStatus& s) { return s.steps == steps && s.sample_blocked; });
}

TEST(LearnerPauseTest, PausesAtExactlyTheStepThenResumeContinues) {
  auto learner = MakeCpuLearner(Config(/*rate_limited=*/true));
  learner->Start();
  Insert(learner.get(), 10 * kBatchSize, 1);
  WaitForIdleAt(*learner, 10);

  learner->PauseAtStep(13);
  LearnerStatus s = learner->status();
  EXPECT_EQ(s.pause_at_step, 13);
  EXPECT_FALSE(s.paused);
  EXPECT_EQ(s.steps, 10);

  // Enough data for 10 more steps; the learner takes 3 of them.
  Insert(learner.get(), 10 * kBatchSize, 2);
  s = WaitForStatus(*learner, [](const LearnerStatus& st) { return st.paused; });
  EXPECT_EQ(s.steps, 13);
  EXPECT_EQ(s.pause_at_step, 0);
  EXPECT_EQ(s.last_stats.step, 13);

  // The 7 steps the data still allows.
  learner->Resume();
  s = WaitForIdleAt(*learner, 20);
  EXPECT_FALSE(s.paused);
  EXPECT_EQ(s.pause_at_step, 0);
  learner->Stop();
}

TEST(LearnerPauseTest, StopsAtTheStepWhileSteppingFlatOut) {
  auto learner = MakeCpuLearner(Config(/*rate_limited=*/false));
  learner->PauseAtStep(250);
  EXPECT_EQ(learner->status().pause_at_step, 250);
  learner->Start();
  Insert(learner.get(), 4 * kBatchSize, 1);
  const LearnerStatus s = WaitForStatus(*learner, [](const LearnerStatus& st) { return st.paused; });
  EXPECT_EQ(s.steps, 250);
  EXPECT_EQ(s.pause_at_step, 0);
  // Nothing stops a running learner now but the pause: it stays at 250.
  learner->Stop();
  EXPECT_EQ(learner->status().steps, 250);
}

TEST(LearnerPauseTest, AStepAlreadyReachedPausesAtOnce) {
  auto learner = MakeCpuLearner(Config(/*rate_limited=*/true));
  learner->Start();
  Insert(learner.get(), 6 * kBatchSize, 1);
  WaitForIdleAt(*learner, 6);
  // The learner waits for data; the request wakes it.
  learner->PauseAtStep(2);
  LearnerStatus s = WaitForStatus(*learner, [](const LearnerStatus& st) { return st.paused; });
  EXPECT_EQ(s.steps, 6);
  EXPECT_EQ(s.pause_at_step, 0);
  learner->Resume();
  Insert(learner.get(), 2 * kBatchSize, 2);
  WaitForIdleAt(*learner, 8);

  // Exactly the current count: paused there too.
  learner->PauseAtStep(8);
  s = WaitForStatus(*learner, [](const LearnerStatus& st) { return st.paused; });
  EXPECT_EQ(s.steps, 8);
  EXPECT_EQ(s.pause_at_step, 0);
  learner->Stop();
}

TEST(LearnerPauseTest, ResumeDropsAPendingStop) {
  auto learner = MakeCpuLearner(Config(/*rate_limited=*/true));
  learner->Start();
  Insert(learner.get(), 4 * kBatchSize, 1);
  WaitForIdleAt(*learner, 4);
  learner->PauseAtStep(6);
  EXPECT_EQ(learner->status().pause_at_step, 6);
  learner->Resume();
  EXPECT_EQ(learner->status().pause_at_step, 0);
  Insert(learner.get(), 4 * kBatchSize, 2);
  const LearnerStatus s = WaitForIdleAt(*learner, 8);
  EXPECT_FALSE(s.paused);
  learner->Stop();
}

TEST(LearnerPauseTest, AtStepZeroPausesNow) {
  auto learner = MakeCpuLearner(Config(/*rate_limited=*/true));
  learner->Start();
  Insert(learner.get(), 3 * kBatchSize, 1);
  WaitForIdleAt(*learner, 3);
  learner->PauseAtStep(0);  // like Pause: returns once no step is in flight
  LearnerStatus s = learner->status();
  EXPECT_TRUE(s.paused);
  EXPECT_EQ(s.pause_at_step, 0);
  EXPECT_EQ(s.steps, 3);
  learner->Stop();
}

}  // namespace
}  // namespace qstream
