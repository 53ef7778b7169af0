// Health: the pure rule, and the monitor against a real learner (CPU backend)
// whose steps can be made to hang, as a hung device would.
#include "server/health_monitor.h"

#include <atomic>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/trainer/forwarding_backend.h"
#include "trainer/backends/backend_factory.h"
#include "trainer/config.h"

namespace qstream {
namespace {

TEST(EvaluateHealth, FollowsTheRule) {
  HealthInputs in;
  in.liveness_timeout_seconds = 10;
  EXPECT_FALSE(EvaluateHealth(in).serving);  // restoring
  EXPECT_TRUE(EvaluateHealth(in).live);      // but alive
  EXPECT_NE(EvaluateHealth(in).reason.find("restoring"), std::string::npos);
  in.started = true;
  EXPECT_TRUE(EvaluateHealth(in).serving);
  EXPECT_EQ(EvaluateHealth(in).reason, "");
  in.progress = {.waiting = false, .busy_seconds = 9.9};
  EXPECT_TRUE(EvaluateHealth(in).serving);
  in.progress.busy_seconds = 10.1;
  const HealthVerdict stuck = EvaluateHealth(in);
  EXPECT_FALSE(stuck.serving);
  EXPECT_FALSE(stuck.live);
  EXPECT_NE(stuck.reason.find("liveness_timeout_seconds"), std::string::npos) << stuck.reason;
  // Waiting for work is live however long it lasts.
  in.progress = {.waiting = true, .busy_seconds = 0};
  EXPECT_TRUE(EvaluateHealth(in).serving);
  // 0 disables the liveness check.
  in.progress = {.waiting = false, .busy_seconds = 1e6};
  in.liveness_timeout_seconds = 0;
  EXPECT_TRUE(EvaluateHealth(in).serving);
  in.halted = true;
  EXPECT_FALSE(EvaluateHealth(in).serving);
  EXPECT_TRUE(EvaluateHealth(in).live);  // a restart would not cure a guard halt
  EXPECT_NE(EvaluateHealth(in).reason.find("guard"), std::string::npos);
  in.halted = false;
  in.progress.step_failed = true;
  EXPECT_FALSE(EvaluateHealth(in).serving);
  EXPECT_TRUE(EvaluateHealth(in).live);
  EXPECT_NE(EvaluateHealth(in).reason.find("step failed"), std::string::npos);
  in.progress.step_failed = false;
  in.stopped = true;
  EXPECT_FALSE(EvaluateHealth(in).serving);
  EXPECT_FALSE(EvaluateHealth(in).live);
}

// The CPU backend, whose Step() blocks while `hang` is set and fails while
// `fail` is.
class HangingBackend : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  void SetHang(bool hang) {
    absl::MutexLock lock(&mu_);
    hang_ = hang;
  }
  void SetFail(bool fail) {
    absl::MutexLock lock(&mu_);
    fail_ = fail;
  }
  bool Hanging() {
    absl::MutexLock lock(&mu_);
    return in_hang_;
  }
  absl::Status Step() override {
    {
      absl::MutexLock lock(&mu_);
      in_hang_ = hang_;
      mu_.Await(absl::Condition(
          +[](bool* hang) { return !*hang; }, &hang_));
      in_hang_ = false;
      if (fail_) return absl::InternalError("injected device fault");
    }
    return ForwardingBackend::Step();
  }

 private:
  absl::Mutex mu_;
  bool hang_ ABSL_GUARDED_BY(mu_) = false;
  bool in_hang_ ABSL_GUARDED_BY(mu_) = false;
  bool fail_ ABSL_GUARDED_BY(mu_) = false;
};

v1::TrainerConfig SmallConfig() {
  v1::TrainerConfig c = DefaultConfig();
  c.mutable_network()->set_obs_dim(4);
  c.mutable_network()->clear_trunk_hidden();
  c.mutable_network()->add_trunk_hidden(16);
  c.mutable_network()->set_head_hidden(8);
  c.mutable_network()->clear_branch_actions();
  c.mutable_network()->add_branch_actions(2);
  c.mutable_replay()->set_capacity(256);
  c.mutable_replay()->set_batch_size(8);
  c.mutable_rate_limiter()->set_min_size_to_sample(8);
  c.mutable_rate_limiter()->set_samples_per_insert(0);
  return c;
}

TransitionColumns Rows(int64_t n) {
  TransitionColumns b;
  b.n = n;
  b.obs_dim = 4;
  b.num_branches = 1;
  for (int64_t i = 0; i < n; ++i) {
    for (int d = 0; d < 4; ++d) {
      b.obs.push_back(0.1f * static_cast<float>(d + i % 3));
      b.next_obs.push_back(0.1f * static_cast<float>(d + 1));
    }
    b.actions.push_back(static_cast<int32_t>(i % 2));
    b.rewards.push_back(1.0f);
    b.discounts.push_back(0.99f);
  }
  return b;
}

// Polls `pred` for up to `timeout`.
template <typename Pred>
bool Eventually(Pred pred, absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return pred();
}

TEST(HealthMonitor, NotServingWhileTheLearnerHangsAndBackOnceItMovesOn) {
  const v1::TrainerConfig config = SmallConfig();
  auto cpu = CreateBackend(config, BackendKind::kCpu);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto owned = std::make_unique<HangingBackend>(std::move(*cpu));
  HangingBackend* backend = owned.get();
  auto learner = Learner::Create(config, std::move(owned));
  ASSERT_TRUE(learner.ok()) << learner.status();

  std::vector<std::pair<bool, bool>> reported;  // (serving, live)
  absl::Mutex reported_mu;
  HealthMonitor monitor(learner->get(), /*liveness_timeout_seconds=*/0.3, absl::Milliseconds(20),
                        [&](bool serving, bool live) {
                          absl::MutexLock lock(&reported_mu);
                          reported.emplace_back(serving, live);
                        });
  EXPECT_FALSE(monitor.serving());  // restoring: not started
  (*learner)->Start();
  monitor.Start();
  EXPECT_TRUE(monitor.serving());

  // Idle (no data): waiting is live, however long.
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_TRUE(monitor.serving()) << monitor.reason();

  // Training, then a step that never returns.
  backend->SetHang(true);
  std::atomic<int> acked{0};
  (*learner)->Enqueue(Rows(64), [&](const absl::Status& s, int64_t) {
    EXPECT_TRUE(s.ok()) << s;
    acked.fetch_add(1);
  });
  ASSERT_TRUE(Eventually([&] { return backend->Hanging(); }, absl::Seconds(10)));
  EXPECT_TRUE(monitor.serving());  // not yet past the timeout
  ASSERT_TRUE(Eventually([&] { return !monitor.serving(); }, absl::Seconds(10)));
  EXPECT_NE(monitor.reason().find("liveness_timeout_seconds"), std::string::npos) << monitor.reason();
  EXPECT_FALSE(monitor.live());
  EXPECT_GT((*learner)->progress().busy_seconds, 0.3);

  // The step returns: serving again with the next check.
  backend->SetHang(false);
  ASSERT_TRUE(Eventually([&] { return monitor.serving(); }, absl::Seconds(10))) << monitor.reason();
  ASSERT_TRUE(Eventually([&] { return (*learner)->status().steps > 3; }, absl::Seconds(10)));
  EXPECT_TRUE(monitor.serving());

  // A failed step pauses the learner: not serving (but live) until Resume.
  backend->SetFail(true);
  ASSERT_TRUE(Eventually([&] { return !monitor.serving(); }, absl::Seconds(10)));
  EXPECT_TRUE(monitor.live());
  EXPECT_NE(monitor.reason().find("step failed"), std::string::npos) << monitor.reason();
  EXPECT_TRUE((*learner)->status().paused);
  backend->SetFail(false);
  (*learner)->Resume();
  ASSERT_TRUE(Eventually([&] { return monitor.serving(); }, absl::Seconds(10))) << monitor.reason();

  // A guard halt (as the learner's halt listener reports it), then shutdown.
  monitor.SetHalted(true);
  EXPECT_FALSE(monitor.serving());
  EXPECT_TRUE(monitor.live());
  monitor.SetHalted(false);
  EXPECT_TRUE(monitor.serving());
  monitor.Stop();
  EXPECT_FALSE(monitor.serving());
  (*learner)->Stop();
  EXPECT_EQ(acked.load(), 1);

  absl::MutexLock lock(&reported_mu);
  // start, stuck, moving, failed, resumed, halted, resumed, stopped: each
  // change once, in order.
  const std::vector<std::pair<bool, bool>> expected = {{true, true},  {false, false}, {true, true},
                                                       {false, true}, {true, true},   {false, true},
                                                       {true, true},  {false, false}};
  EXPECT_EQ(reported, expected);
}

}  // namespace
}  // namespace qstream
