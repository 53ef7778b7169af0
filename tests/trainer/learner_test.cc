#include "trainer/learner.h"

#include <atomic>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "trainer/config.h"

namespace qstream {
namespace {

constexpr absl::Duration kShortWait = absl::Milliseconds(50);

// Shared between a FakeBackend (owned by the Learner) and the test.
struct FakeState {
  absl::Mutex mu;
  int64_t inserted_rows ABSL_GUARDED_BY(mu) = 0;
  int64_t inserted_batches ABSL_GUARDED_BY(mu) = 0;
  int64_t steps ABSL_GUARDED_BY(mu) = 0;
  int64_t last_stats_calls ABSL_GUARDED_BY(mu) = 0;
  int64_t drained_steps ABSL_GUARDED_BY(mu) = 0;
  bool fail_steps ABSL_GUARDED_BY(mu) = false;  // Step() returns an error while set
  int64_t failed_steps ABSL_GUARDED_BY(mu) = 0;

  int64_t Steps() {
    absl::MutexLock lock(&mu);
    return steps;
  }
  int64_t Rows() {
    absl::MutexLock lock(&mu);
    return inserted_rows;
  }
  void WaitForSteps(int64_t n) {
    absl::MutexLock lock(&mu);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return steps >= n; };
    mu.Await(absl::Condition(&reached));
  }
};

// Counts what the learner does; parameters encode the step count so that a
// snapshot shows which step it was taken at.
class FakeBackend : public Backend {
 public:
  FakeBackend(NetworkSpec spec, int64_t capacity, std::shared_ptr<FakeState> state)
      : spec_(std::move(spec)), capacity_(capacity), state_(std::move(state)) {}

  std::string name() const override { return "fake"; }
  std::string device() const override { return "test double"; }
  const NetworkSpec& spec() const override { return spec_; }

  absl::Status Insert(const TransitionColumns& batch) override {
    absl::MutexLock lock(&state_->mu);
    state_->inserted_rows += batch.n;
    state_->inserted_batches += 1;
    return absl::OkStatus();
  }
  int64_t replay_size() const override {
    absl::MutexLock lock(&state_->mu);
    return std::min(state_->inserted_rows, capacity_);
  }
  int64_t replay_capacity() const override { return capacity_; }

  absl::Status Step() override {
    absl::MutexLock lock(&state_->mu);
    if (state_->inserted_rows == 0) return absl::FailedPreconditionError("empty replay");
    if (state_->fail_steps) {
      state_->failed_steps += 1;
      return absl::InternalError("injected device failure");
    }
    state_->steps += 1;
    return absl::OkStatus();
  }
  int64_t steps() const override {
    absl::MutexLock lock(&state_->mu);
    return state_->steps;
  }
  StepStats last_stats() override {
    absl::MutexLock lock(&state_->mu);
    state_->last_stats_calls += 1;
    StepStats s;
    s.step = state_->steps;
    s.loss = 0.5f;
    return s;
  }
  std::vector<int64_t> guard_trips() override {
    absl::MutexLock lock(&state_->mu);
    std::vector<int64_t> trips(kNumGuardReasons, 0);
    trips[static_cast<int>(GuardReason::kGradNorm)] = state_->steps;  // recognizable
    return trips;
  }
  void DrainStepTimes(std::vector<std::pair<double, int64_t>>* out) override {
    absl::MutexLock lock(&state_->mu);
    const int64_t n = state_->steps - state_->drained_steps;
    if (n > 0) out->emplace_back(1e-3, n);
    state_->drained_steps = state_->steps;
  }
  std::vector<float> GetParams() override {
    absl::MutexLock lock(&state_->mu);
    return std::vector<float>(spec_.num_params, static_cast<float>(state_->steps));
  }
  absl::Status SetParams(const std::vector<float>&) override { return absl::UnimplementedError("fake"); }
  absl::Status SaveState(bool, BackendState*) override { return absl::UnimplementedError("fake"); }
  absl::Status LoadState(const BackendState&, StateParts) override {
    return absl::UnimplementedError("fake");
  }

 private:
  NetworkSpec spec_;
  int64_t capacity_;
  std::shared_ptr<FakeState> state_;
};

v1::TrainerConfig TestConfig() {
  v1::TrainerConfig c = DefaultConfig();
  c.mutable_replay()->set_batch_size(4);
  c.mutable_replay()->set_capacity(1000);
  c.mutable_rate_limiter()->set_min_size_to_sample(1);
  c.mutable_rate_limiter()->set_samples_per_insert(0);  // flat out unless a test sets a ratio
  c.mutable_server()->set_publish_every(1000000);
  c.mutable_server()->set_stats_every(1);
  return c;
}

std::unique_ptr<Learner> MakeLearner(const v1::TrainerConfig& config, std::shared_ptr<FakeState> state) {
  auto spec = NetworkSpec::Create(config.network());
  EXPECT_TRUE(spec.ok()) << spec.status();
  auto learner = Learner::Create(
      config, std::make_unique<FakeBackend>(*spec, config.replay().capacity(), std::move(state)));
  EXPECT_TRUE(learner.ok()) << learner.status();
  return std::move(*learner);
}

TransitionColumns Batch(int64_t n, const NetworkSpec& spec) {
  TransitionColumns b;
  b.n = n;
  b.obs_dim = spec.obs_dim;
  b.num_branches = spec.num_branches();
  b.obs.assign(n * spec.obs_dim, 0.f);
  b.next_obs.assign(n * spec.obs_dim, 0.f);
  b.actions.assign(n * spec.num_branches(), 0);
  b.rewards.assign(n, 0.f);
  b.discounts.assign(n, 0.99f);
  return b;
}

// Counts callbacks per batch and lets the test wait for a number of them.
struct Callbacks {
  absl::Mutex mu;
  std::vector<int> calls ABSL_GUARDED_BY(mu);
  std::vector<absl::Status> results ABSL_GUARDED_BY(mu);
  std::vector<int64_t> sizes ABSL_GUARDED_BY(mu);
  int total ABSL_GUARDED_BY(mu) = 0;

  explicit Callbacks(int n) : calls(n, 0), results(n), sizes(n, -1) {}
  Learner::InsertDone For(int i) {
    return [this, i](absl::Status s, int64_t size) {
      absl::MutexLock lock(&mu);
      calls[i] += 1;
      results[i] = s;
      sizes[i] = size;
      total += 1;
    };
  }
  void WaitForTotal(int n) {
    absl::MutexLock lock(&mu);
    auto done = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return total >= n; };
    mu.Await(absl::Condition(&done));
  }
  int Total() {
    absl::MutexLock lock(&mu);
    return total;
  }
};

TEST(LearnerTest, InsertsReachBackendAndCallbacksFireOnce) {
  v1::TrainerConfig config = TestConfig();
  config.mutable_rate_limiter()->set_min_size_to_sample(1000);  // no steps: inserts only
  auto state = std::make_shared<FakeState>();
  auto learner = MakeLearner(config, state);
  const NetworkSpec& spec = learner->policy()->spec;
  constexpr int kBatches = 10;
  Callbacks cb(kBatches);
  learner->Start();
  for (int i = 0; i < kBatches; ++i) learner->Enqueue(Batch(7, spec), cb.For(i));
  cb.WaitForTotal(kBatches);
  EXPECT_EQ(state->Rows(), 7 * kBatches);
  LearnerStatus s = learner->status();
  EXPECT_EQ(s.transitions_inserted, 7 * kBatches);
  EXPECT_EQ(s.batches_inserted, kBatches);
  EXPECT_EQ(s.replay_size, 7 * kBatches);
  EXPECT_EQ(s.steps, 0);
  EXPECT_TRUE(s.running);
  learner->Stop();
  absl::MutexLock lock(&cb.mu);
  for (int i = 0; i < kBatches; ++i) {
    EXPECT_EQ(cb.calls[i], 1) << i;
    EXPECT_TRUE(cb.results[i].ok()) << cb.results[i];
    // Batches are inserted in order; the callback sees the size after its batch.
    EXPECT_EQ(cb.sizes[i], 7 * (i + 1));
  }
}

// Inserts and steps interleave: batches that are always waiting (every
// callback queues the next one) do not stop the learner from stepping, and
// the inserts go on as well.
TEST(LearnerTest, StepsGoOnWhileBatchesAreAlwaysWaiting) {
  auto state = std::make_shared<FakeState>();
  auto learner = MakeLearner(TestConfig(), state);  // samples_per_insert 0: no rate limit
  const NetworkSpec spec = learner->policy()->spec;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> callbacks{0};
  std::function<void(absl::Status, int64_t)> again;
  again = [&](const absl::Status& s, int64_t) {
    EXPECT_TRUE(s.ok() || absl::IsCancelled(s)) << s;
    callbacks.fetch_add(1);
    if (!stop.load() && s.ok()) learner->Enqueue(Batch(4, spec), again);
  };
  for (int i = 0; i < 16; ++i) learner->Enqueue(Batch(4, spec), again);
  learner->Start();
  state->WaitForSteps(200);  // hangs (test timeout) if inserts starved the steps
  const int64_t rows_at_200_steps = state->Rows();
  stop.store(true);
  learner->Stop();
  EXPECT_GT(rows_at_200_steps, 16 * 4) << "the inserts went on too";
  EXPECT_GT(callbacks.load(), 16);
}

// A paused learner waits; a batch enqueued then is inserted on the caller's
// thread (no hand-off to the waiting learner thread), its callback has run
// when Enqueue returns, and Resume still finds that the replay can be
// sampled now.
TEST(LearnerTest, PausedLearnerInsertsOnTheCallersThreadAndResumeSteps) {
  auto state = std::make_shared<FakeState>();
  auto learner = MakeLearner(TestConfig(), state);
  const NetworkSpec spec = learner->policy()->spec;
  learner->Start();
  learner->Pause();
  absl::SleepFor(kShortWait);  // the learner thread goes idle
  std::thread::id ran_on;
  int calls = 0;
  learner->Enqueue(Batch(8, spec), [&](const absl::Status& s, int64_t size) {
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(size, 8);
    ran_on = std::this_thread::get_id();
    ++calls;
  });
  EXPECT_EQ(calls, 1) << "inserted inline, callback done before Enqueue returned";
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_EQ(state->Rows(), 8);
  EXPECT_EQ(learner->status().replay_size, 8);
  EXPECT_EQ(state->Steps(), 0);
  learner->Resume();
  state->WaitForSteps(5);  // hangs if the learner kept its stale "nothing to sample"
  learner->Stop();
}

TEST(LearnerTest, PauseStopsStepsAndResumeRestartsThem) {
  auto state = std::make_shared<FakeState>();
  auto learner = MakeLearner(TestConfig(), state);
  learner->Enqueue(Batch(16, learner->policy()->spec), nullptr);
  learner->Start();
  state->WaitForSteps(5);
  learner->Pause();
  const int64_t paused_at = state->Steps();
  absl::SleepFor(kShortWait);
  EXPECT_EQ(state->Steps(), paused_at);
  EXPECT_TRUE(learner->status().paused);
  EXPECT_EQ(learner->status().steps, paused_at);
  // Data keeps flowing in while paused.
  Callbacks cb(1);
  learner->Enqueue(Batch(3, learner->policy()->spec), cb.For(0));
  cb.WaitForTotal(1);
  EXPECT_EQ(state->Rows(), 19);
  EXPECT_EQ(state->Steps(), paused_at);
  learner->Resume();
  state->WaitForSteps(paused_at + 5);
  EXPECT_FALSE(learner->status().paused);
  learner->Stop();
  EXPECT_FALSE(learner->status().running);
}

TEST(LearnerTest, RateLimiterBoundsStepsPerInsert) {
  v1::TrainerConfig config = TestConfig();
  // spi 2, min size 8, error buffer 4: min_diff = 12. With 16 rows inserted
  // (diff 32) a step of 4 samples runs while 32 - 4 s - 4 >= 12: s = 0..4.
  config.mutable_rate_limiter()->set_min_size_to_sample(8);
  config.mutable_rate_limiter()->set_samples_per_insert(2);
  config.mutable_rate_limiter()->set_error_buffer(4);
  auto state = std::make_shared<FakeState>();
  auto learner = MakeLearner(config, state);
  const NetworkSpec& spec = learner->policy()->spec;
  learner->Start();
  Callbacks cb(1);
  learner->Enqueue(Batch(7, spec), cb.For(0));  // below min size: no step
  cb.WaitForTotal(1);
  EXPECT_TRUE(learner->status().sample_blocked);
  absl::SleepFor(kShortWait);
  EXPECT_EQ(state->Steps(), 0);
  learner->Enqueue(Batch(9, spec), nullptr);
  state->WaitForSteps(5);
  absl::SleepFor(kShortWait);
  EXPECT_EQ(state->Steps(), 5);
  learner->Pause();  // no step in flight from here: the counters are final
  LearnerStatus s = learner->status();
  EXPECT_EQ(s.steps, 5);
  EXPECT_EQ(s.rate_limiter_inserts, 16);
  EXPECT_EQ(s.rate_limiter_samples, 20);
  learner->Resume();
  learner->Enqueue(Batch(2, spec), nullptr);  // +4 samples allowed: one more step
  state->WaitForSteps(6);
  absl::SleepFor(kShortWait);
  EXPECT_EQ(state->Steps(), 6);
}

TEST(LearnerTest, StopInsertsPendingBatchesEvenWhenLimiterBlocks) {
  v1::TrainerConfig config = TestConfig();
  // spi 1, error buffer 2: max_diff = 3, so after one batch of 10 the limiter
  // blocks inserts until steps catch up, and the paused learner never steps.
  config.mutable_rate_limiter()->set_samples_per_insert(1);
  config.mutable_rate_limiter()->set_error_buffer(2);
  auto state = std::make_shared<FakeState>();
  auto learner = MakeLearner(config, state);
  const NetworkSpec& spec = learner->policy()->spec;
  constexpr int kBatches = 20;
  Callbacks cb(kBatches);
  for (int i = 0; i < kBatches; ++i) learner->Enqueue(Batch(10, spec), cb.For(i));
  learner->Pause();
  learner->Start();
  cb.WaitForTotal(1);
  absl::SleepFor(kShortWait);
  EXPECT_EQ(cb.Total(), 1);
  EXPECT_EQ(state->Rows(), 10);
  LearnerStatus s = learner->status();
  EXPECT_EQ(s.pending_batches, kBatches - 1);
  EXPECT_TRUE(s.insert_blocked);
  learner->Stop();
  EXPECT_EQ(state->Rows(), 10 * kBatches);
  EXPECT_EQ(state->Steps(), 0);
  {
    absl::MutexLock lock(&cb.mu);
    for (int i = 0; i < kBatches; ++i) {
      EXPECT_EQ(cb.calls[i], 1) << i;
      EXPECT_TRUE(cb.results[i].ok()) << cb.results[i];
    }
  }
  EXPECT_EQ(learner->status().pending_batches, 0);
  // After Stop nothing is accepted: the callback says so at once.
  absl::Status late;
  learner->Enqueue(Batch(1, spec), [&late](absl::Status s, int64_t) { late = s; });
  EXPECT_TRUE(absl::IsCancelled(late)) << late;
  EXPECT_EQ(state->Rows(), 10 * kBatches);
}

TEST(LearnerTest, StopWithoutStartInsertsPending) {
  auto state = std::make_shared<FakeState>();
  auto learner = MakeLearner(TestConfig(), state);
  Callbacks cb(3);
  for (int i = 0; i < 3; ++i) learner->Enqueue(Batch(5, learner->policy()->spec), cb.For(i));
  learner->Stop();
  EXPECT_EQ(cb.Total(), 3);
  EXPECT_EQ(state->Rows(), 15);
  EXPECT_EQ(state->Steps(), 0);
}

TEST(LearnerTest, PolicyVersionsIncreaseEveryPublishEvery) {
  v1::TrainerConfig config = TestConfig();
  config.mutable_server()->set_publish_every(3);
  auto state = std::make_shared<FakeState>();
  auto learner = MakeLearner(config, state);
  auto initial = learner->policy();
  EXPECT_EQ(initial->version, 0);
  EXPECT_EQ(initial->learner_steps, 0);
  EXPECT_EQ(static_cast<int64_t>(initial->params.size()), initial->spec.num_params);

  absl::Mutex mu;
  std::vector<std::shared_ptr<const PolicySnapshot>> seen;
  const int64_t id = learner->AddPolicyListener([&](std::shared_ptr<const PolicySnapshot> p) {
    absl::MutexLock lock(&mu);
    seen.push_back(std::move(p));
  });
  learner->Enqueue(Batch(8, initial->spec), nullptr);
  learner->Start();
  state->WaitForSteps(30);
  learner->RemovePolicyListener(id);
  size_t seen_at_removal;
  {
    absl::MutexLock lock(&mu);
    seen_at_removal = seen.size();
  }
  learner->Stop();
  const int64_t steps = state->Steps();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(seen.size(), seen_at_removal);  // no call after RemovePolicyListener returned
  ASSERT_GE(seen.size(), 9u);
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i]->version, static_cast<int64_t>(i) + 1);
    EXPECT_EQ(seen[i]->learner_steps, 3 * seen[i]->version);
    EXPECT_EQ(seen[i]->params[0], static_cast<float>(seen[i]->learner_steps));
  }
  EXPECT_EQ(learner->policy()->version, steps / 3);
  EXPECT_EQ(learner->status().policy_version, steps / 3);
}

TEST(LearnerTest, StatsAreReadEveryStatsEverySteps) {
  v1::TrainerConfig config = TestConfig();
  config.mutable_server()->set_stats_every(10);
  auto state = std::make_shared<FakeState>();
  auto learner = MakeLearner(config, state);
  learner->Enqueue(Batch(8, learner->policy()->spec), nullptr);
  learner->Start();
  state->WaitForSteps(200);
  learner->Stop();
  const int64_t steps = state->Steps();
  LearnerStatus s = learner->status();
  EXPECT_EQ(s.steps, steps);
  EXPECT_EQ(s.last_stats.step, steps);  // refreshed when stopping
  EXPECT_FLOAT_EQ(s.last_stats.loss, 0.5f);
  ASSERT_EQ(s.guard_trips.size(), static_cast<size_t>(kNumGuardReasons));
  EXPECT_EQ(s.guard_trips[static_cast<int>(GuardReason::kGradNorm)], steps);
  {
    absl::MutexLock lock(&state->mu);
    // Every 10 steps, plus a few refreshes when idle (before data, at stop).
    EXPECT_LE(state->last_stats_calls, steps / 10 + 3);
    EXPECT_GE(state->last_stats_calls, steps / 10);
  }
  int64_t timed = 0;
  for (const auto& [seconds, n] : learner->DrainStepTimes()) {
    EXPECT_DOUBLE_EQ(seconds, 1e-3);
    timed += n;
  }
  EXPECT_EQ(timed, steps);
  EXPECT_TRUE(learner->DrainStepTimes().empty());
}

// Polls `done` until it holds: waits for an event, asserts nothing about time.
template <typename F>
void WaitUntil(F done) {
  while (!done()) absl::SleepFor(absl::Milliseconds(1));
}

TEST(LearnerTest, FailedStepPausesUntilResume) {
  auto state = std::make_shared<FakeState>();
  auto learner = MakeLearner(TestConfig(), state);
  {
    absl::MutexLock lock(&state->mu);
    state->fail_steps = true;
  }
  learner->Enqueue(Batch(8, learner->policy()->spec), nullptr);
  learner->Start();
  WaitUntil([&] { return learner->status().paused; });
  absl::SleepFor(kShortWait);
  LearnerStatus s = learner->status();
  EXPECT_NE(s.last_error.find("injected device failure"), std::string::npos) << s.last_error;
  EXPECT_EQ(s.steps, 0);
  {
    absl::MutexLock lock(&state->mu);
    EXPECT_EQ(state->failed_steps, 1);  // no retry loop while paused
    state->fail_steps = false;
  }
  learner->Resume();
  state->WaitForSteps(3);
  learner->Stop();
}

TEST(LearnerTest, RejectsDeadlockingRateLimiter) {
  v1::TrainerConfig config = TestConfig();
  config.mutable_replay()->set_batch_size(64);
  config.mutable_rate_limiter()->set_samples_per_insert(4);
  config.mutable_rate_limiter()->set_error_buffer(10);
  auto spec = NetworkSpec::Create(config.network());
  ASSERT_TRUE(spec.ok());
  auto learner =
      Learner::Create(config, std::make_unique<FakeBackend>(*spec, 1000, std::make_shared<FakeState>()));
  EXPECT_TRUE(absl::IsInvalidArgument(learner.status())) << learner.status();
}

}  // namespace
}  // namespace qstream
