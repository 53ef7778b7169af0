// The Learner's checkpoints against the real CPU backend and the real
// checkpoint files: triggers, pruning, requests while paused, restore of the
// counters and the policy version, the bitwise resume through files, and the
// guard's rollback / halt after repeated trips.
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "tests/trainer/cpu_learner_util.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/cpu/cpu_backend.h"
#include "trainer/learner.h"

namespace qstream {
namespace {

namespace fs = std::filesystem;
using testing::InsertAndWait;
using testing::MakeCpuLearner;
using testing::RandomItems;
using testing::SetSmallNetwork;

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / absl::StrCat("qstream-learner-ckpt-", getpid(), "-", counter_++);
    fs::remove_all(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string path() const { return path_.string(); }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

v1::TrainerConfig Config() {
  v1::TrainerConfig c;
  SetSmallNetwork(&c);
  c.mutable_replay()->set_capacity(256);
  c.mutable_replay()->set_batch_size(8);
  c.mutable_rate_limiter()->set_min_size_to_sample(8);
  c.mutable_rate_limiter()->set_samples_per_insert(0);
  c.mutable_server()->set_publish_every(25);
  c.mutable_server()->set_stats_every(1);
  c.mutable_checkpoint()->set_every_seconds(0);
  c.set_seed(11);
  FillDefaults(&c);
  return c;
}

// Polls `pred` until it holds or 30 s pass.
template <typename Pred>
bool WaitFor(Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

TEST(LearnerCheckpointTest, EveryStepsWritesAndKeepsTheNewest) {
  TempDir dir;
  v1::TrainerConfig config = Config();
  config.mutable_checkpoint()->set_every_steps(40);
  config.mutable_checkpoint()->set_keep(2);
  auto learner = MakeCpuLearner(config);
  learner->EnableCheckpoints(dir.path(), nullptr);
  learner->Start();
  InsertAndWait(learner.get(), RandomItems(64, 1));
  ASSERT_TRUE(WaitFor([&] { return learner->status().checkpoints.written >= 4; }));
  learner->Stop();
  auto list = ListCheckpoints(dir.path());
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 2u);
  for (const CheckpointEntry& e : *list) {
    EXPECT_TRUE(e.automatic);
    EXPECT_EQ(e.name, AutoCheckpointName(e.learner_step));
    EXPECT_GE(e.learner_step, 40) << e.name;
    auto data = ReadCheckpoint(e.dir);
    ASSERT_TRUE(data.ok()) << data.status();
    EXPECT_EQ(data->manifest.learner_step(), e.learner_step);
    EXPECT_TRUE(data->manifest.replay().included());
    EXPECT_EQ(data->manifest.replay().size(), 64);
  }
  // Due every 40 steps; taken as soon as the writer is free after that.
  EXPECT_GE((*list)[0].learner_step / 40, (*list)[1].learner_step / 40 + 1);
  const LearnerStatus s = learner->status();
  EXPECT_EQ(s.checkpoints.last_step, (*list)[0].learner_step);
  EXPECT_GT(s.checkpoints.last_bytes, 0u);
  EXPECT_TRUE(s.checkpoints.failures.empty());
}

TEST(LearnerCheckpointTest, RequestWhilePausedAndNamedOnesAreKept) {
  TempDir dir;
  v1::TrainerConfig config = Config();
  config.mutable_checkpoint()->set_keep(1);
  auto learner = MakeCpuLearner(config);
  int hook_calls = 0;
  learner->EnableCheckpoints(dir.path(), [&](v1::CheckpointManifest* m) {
    ++hook_calls;
    auto* session = m->mutable_ingest()->add_sessions();
    session->set_stream_id("actor-7");
    session->set_last_sequence(42);
  });
  learner->Start();
  InsertAndWait(learner.get(), RandomItems(32, 2));
  ASSERT_TRUE(WaitFor([&] { return learner->status().steps >= 30; }));
  learner->Pause();
  const int64_t paused_at = learner->status().steps;
  for (const std::string& name : {std::string("before-exp"), std::string(""), std::string("")}) {
    absl::Notification done;
    absl::StatusOr<CheckpointWriteResult> result;
    learner->RequestCheckpoint(name, [&](const absl::StatusOr<CheckpointWriteResult>& r) {
      result = r;
      done.Notify();
    });
    done.WaitForNotification();
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->learner_step, paused_at);
    EXPECT_EQ(result->name, name.empty() ? AutoCheckpointName(paused_at) : name);
  }
  EXPECT_EQ(learner->status().steps, paused_at);  // still paused
  learner->Stop();
  EXPECT_EQ(hook_calls, 3);
  auto named = ReadCheckpoint(dir.path() + "/before-exp");
  ASSERT_TRUE(named.ok()) << named.status();
  ASSERT_EQ(named->manifest.ingest().sessions_size(), 1);
  EXPECT_EQ(named->manifest.ingest().sessions(0).last_sequence(), 42u);
  auto list = ListCheckpoints(dir.path());
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->size(), 2u);  // the named one and the newest automatic one
}

TEST(LearnerCheckpointTest, WithoutCheckpointDirRequestsFail) {
  auto learner = MakeCpuLearner(Config());
  absl::Status status;
  learner->RequestCheckpoint("x", [&](const absl::StatusOr<CheckpointWriteResult>& r) { status = r.status(); });
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(learner->WriteFinalCheckpoint().ok());
}

// A restored learner continues the step count, the counters and the policy
// version (checkpoint's + 1), and trains on the restored replay at once.
TEST(LearnerCheckpointTest, RestoreContinuesStepsVersionAndReplay) {
  TempDir dir;
  v1::TrainerConfig config = Config();
  auto a = MakeCpuLearner(config);
  a->EnableCheckpoints(dir.path(), nullptr);
  a->Start();
  InsertAndWait(a.get(), RandomItems(100, 3));
  ASSERT_TRUE(WaitFor([&] { return a->status().policy_version >= 3; }));
  a->Stop();
  ASSERT_TRUE(a->WriteFinalCheckpoint().ok());
  const LearnerStatus sa = a->status();

  std::vector<std::string> refused;
  auto data = ReadLatestCheckpoint(dir.path(), config, &refused);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_TRUE(refused.empty());
  EXPECT_EQ(data->manifest.learner_step(), sa.steps);
  EXPECT_EQ(data->manifest.policy_version(), sa.policy_version);

  v1::TrainerConfig changed = config;
  changed.mutable_optimizer()->set_lr(0.0005f);  // allowed: logged
  auto b = MakeCpuLearner(changed);
  ASSERT_TRUE(b->Restore(*data).ok());
  LearnerStatus sb = b->status();
  EXPECT_EQ(sb.steps, sa.steps);
  EXPECT_EQ(sb.replay_size, 100);
  EXPECT_EQ(sb.policy_version, sa.policy_version + 1);
  EXPECT_EQ(b->policy()->params, data->state.params);
  EXPECT_EQ(sb.rate_limiter_inserts, sa.rate_limiter_inserts);
  b->Start();
  ASSERT_TRUE(WaitFor([&] { return b->status().steps >= sa.steps + 10; }));  // min size met by the restored replay
  b->Stop();

  v1::TrainerConfig wider = config;
  wider.mutable_network()->set_trunk_hidden(0, 9);
  auto c = MakeCpuLearner(wider);
  const absl::Status refused_shape = c->Restore(*data);
  EXPECT_EQ(refused_shape.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused_shape.message().find("network.trunk_hidden"), std::string::npos) << refused_shape;
}

void ExpectBitwiseEqual(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << what;
}

// The bitwise-resume test of the durable-state contract: a CPU backend
// checkpointed to disk after 100 steps and restored from the files takes the
// next 100 steps (with the same inserts in between) bit for bit as the
// uninterrupted one.
TEST(CheckpointResumeTest, CpuNext100StepsBitwiseEqualAfterRestoreFromFiles) {
  TempDir dir;
  v1::TrainerConfig config = Config();
  config.mutable_replay()->set_capacity(128);  // the ring wraps during the run
  auto make = [&] { return *CreateCpuBackend(config); };
  auto schedule = [](Backend* b, int64_t first, int steps) {
    for (int64_t t = first; t < first + steps; ++t) {
      if (t % 5 == 0) {
        ASSERT_TRUE(b->Insert(RandomItems(7, 500 + static_cast<uint32_t>(t))).ok());
      }
      ASSERT_TRUE(b->Step().ok());
    }
  };
  std::unique_ptr<Backend> uninterrupted = make();
  ASSERT_TRUE(uninterrupted->Insert(RandomItems(40, 9)).ok());
  schedule(uninterrupted.get(), 0, 100);

  CheckpointData data;
  ASSERT_TRUE(uninterrupted->SaveState(true, &data.state).ok());
  data.manifest.set_format_version(kCheckpointFormatVersion);
  data.manifest.set_learner_step(data.state.steps);
  data.manifest.set_optimizer_step(data.state.applied_updates);
  *data.manifest.mutable_config() = config;
  auto* replay = data.manifest.mutable_replay();
  replay->set_included(true);
  replay->set_capacity(data.state.replay.capacity);
  replay->set_size(data.state.replay.size);
  replay->set_cursor(data.state.replay.cursor);
  replay->set_max_priority(data.state.replay.max_priority);
  for (int64_t t : data.state.guard_trips) data.manifest.mutable_guard()->add_trips(t);
  auto written = WriteCheckpoint(dir.path(), AutoCheckpointName(100), data);
  ASSERT_TRUE(written.ok()) << written.status();
  auto read = ReadCheckpoint(written->dir);
  ASSERT_TRUE(read.ok()) << read.status();

  std::unique_ptr<Backend> resumed = make();
  ASSERT_TRUE(resumed->LoadState(read->state, StateParts::kAll).ok());
  schedule(uninterrupted.get(), 100, 100);
  schedule(resumed.get(), 100, 100);
  BackendState x, y;
  ASSERT_TRUE(uninterrupted->SaveState(true, &x).ok());
  ASSERT_TRUE(resumed->SaveState(true, &y).ok());
  EXPECT_EQ(x.steps, 200);
  EXPECT_EQ(y.steps, 200);
  EXPECT_EQ(x.applied_updates, y.applied_updates);
  ExpectBitwiseEqual(x.params, y.params, "params");
  ExpectBitwiseEqual(x.target, y.target, "target");
  ExpectBitwiseEqual(x.adam_m, y.adam_m, "adam_m");
  ExpectBitwiseEqual(x.adam_v, y.adam_v, "adam_v");
  ExpectBitwiseEqual(x.replay.priorities, y.replay.priorities, "priorities");
  EXPECT_EQ(x.replay.cursor, y.replay.cursor);
  EXPECT_EQ(x.replay.max_priority, y.replay.max_priority);
}

// Non-finite observations fill the replay after a good checkpoint: every step
// trips, the learner rolls back to that checkpoint's network once, and when
// the trips go on it halts (listener told, no more steps).
TEST(LearnerGuardTest, RepeatedTripsRollBackThenHalt) {
  TempDir dir;
  v1::TrainerConfig config = Config();
  config.mutable_guard()->set_max_consecutive_trips(20);
  config.mutable_checkpoint()->set_every_steps(30);
  auto learner = MakeCpuLearner(config);
  learner->EnableCheckpoints(dir.path(), nullptr);
  std::atomic<int> halts{0};
  std::atomic<int> clears{0};
  learner->SetHaltListener([&](bool halted) { (halted ? halts : clears) += 1; });
  learner->Start();
  InsertAndWait(learner.get(), RandomItems(64, 4));
  ASSERT_TRUE(WaitFor([&] { return learner->status().checkpoints.written >= 1; }));
  InsertAndWait(learner.get(), RandomItems(256, 5, /*poison=*/true));  // overwrites the whole ring
  ASSERT_TRUE(WaitFor([&] { return learner->status().halted; }));
  const LearnerStatus s = learner->status();
  EXPECT_EQ(s.guard_rollbacks, 1);
  EXPECT_NE(s.halt_reason.find("after a rollback"), std::string::npos) << s.halt_reason;
  EXPECT_EQ(halts.load(), 1);
  // No update applied since the rollback: the weights are the checkpoint's.
  auto list = ListCheckpoints(dir.path());
  ASSERT_TRUE(list.ok() && !list->empty());
  std::vector<float> params = learner->policy()->params;
  bool matches_a_checkpoint = false;
  for (const CheckpointEntry& e : *list) {
    auto data = ReadCheckpoint(e.dir);
    ASSERT_TRUE(data.ok()) << data.status();
    if (data->manifest.guard().consecutive_trips() == 0 && data->state.params == params) matches_a_checkpoint = true;
  }
  EXPECT_TRUE(matches_a_checkpoint);
  const int64_t halted_at = s.steps;
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(learner->status().steps, halted_at);
  learner->Resume();  // clears the halt (the poisoned replay trips again later)
  EXPECT_EQ(clears.load(), 1);
  learner->Stop();
}

TEST(LearnerGuardTest, HaltModeHaltsWithoutRollback) {
  v1::TrainerConfig config = Config();
  config.mutable_guard()->set_max_consecutive_trips(10);
  config.mutable_guard()->set_on_repeated_trips(v1::GuardConfig::HALT);
  auto learner = MakeCpuLearner(config);
  learner->Start();
  InsertAndWait(learner.get(), RandomItems(64, 6, /*poison=*/true));
  ASSERT_TRUE(WaitFor([&] { return learner->status().halted; }));
  const LearnerStatus s = learner->status();
  EXPECT_EQ(s.guard_rollbacks, 0);
  EXPECT_GE(s.steps, 10);
  EXPECT_NE(s.halt_reason.find("10 consecutive"), std::string::npos) << s.halt_reason;
  learner->Stop();
}

}  // namespace
}  // namespace qstream
