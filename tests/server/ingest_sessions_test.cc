// IngestSessions against a real Learner on the CPU backend: de-duplication,
// waiting behind a batch in flight, commit only with the insert, n-step
// windows across half-close / reconnect / expiry, Save/Restore, and a
// property test of many concurrent streams with resends and takeovers. The
// backend is wrapped so that every inserted row can be read back; every row
// carries a unique tag in obs[0].
#include "server/ingest_sessions.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "server/batch_columns.h"
#include "tests/trainer/forwarding_backend.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/cpu/cpu_backend.h"

namespace qstream {
namespace {

struct Row {
  float obs, reward, discount, next_obs;
};

// Every row the backend received, in insert order. While `hold` is set an
// insert waits (the learner thread holds its round); while `fail` is set it
// fails.
struct InsertLog {
  absl::Mutex mu;
  std::vector<Row> rows ABSL_GUARDED_BY(mu);
  bool hold ABSL_GUARDED_BY(mu) = false;
  bool fail ABSL_GUARDED_BY(mu) = false;

  void Hold(bool on) {
    absl::MutexLock lock(&mu);
    hold = on;
  }
  void Fail(bool on) {
    absl::MutexLock lock(&mu);
    fail = on;
  }

  std::vector<Row> Rows() {
    absl::MutexLock lock(&mu);
    return rows;
  }
  void WaitForRows(size_t n) {
    absl::MutexLock lock(&mu);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return rows.size() >= n; };
    mu.Await(absl::Condition(&reached));
  }
};

class RecordingBackend final : public testing::ForwardingBackend {
 public:
  RecordingBackend(std::unique_ptr<Backend> inner, std::shared_ptr<InsertLog> log)
      : ForwardingBackend(std::move(inner)), log_(std::move(log)) {}
  absl::Status Insert(const TransitionColumns& batch) override {
    {
      absl::MutexLock lock(&log_->mu);
      log_->mu.Await(absl::Condition(
          +[](bool* hold) { return !*hold; }, &log_->hold));
      if (log_->fail) return absl::InternalError("insert failed (test)");
    }
    absl::Status st = ForwardingBackend::Insert(batch);
    if (st.ok()) {
      absl::MutexLock lock(&log_->mu);
      for (int64_t i = 0; i < batch.n; ++i) {
        log_->rows.push_back({batch.obs[i * batch.obs_dim], batch.rewards[i], batch.discounts[i],
                              batch.next_obs[i * batch.obs_dim]});
      }
    }
    return st;
  }

 private:
  std::shared_ptr<InsertLog> log_;
};

// obs_dim 1, one branch of 4 actions, n = 3, gamma = 0.5.
v1::TrainerConfig Config() {
  v1::TrainerConfig c;
  auto* n = c.mutable_network();
  n->set_obs_dim(1);
  n->add_trunk_hidden(4);
  n->set_head_hidden(4);
  n->set_num_atoms(5);
  n->set_v_min(-4);
  n->set_v_max(4);
  n->add_branch_actions(4);
  c.mutable_replay()->set_capacity(1 << 16);
  c.mutable_replay()->set_batch_size(4);
  c.mutable_rate_limiter()->set_min_size_to_sample(1 << 16);  // no training steps: inserts only
  c.mutable_rate_limiter()->set_samples_per_insert(0);
  c.mutable_returns()->set_n_step(3);
  c.mutable_returns()->set_gamma(0.5f);
  c.mutable_server()->set_stream_resume_seconds(60);
  c.mutable_server()->set_session_ttl_seconds(3600);
  c.mutable_server()->set_max_sessions(64);
  c.mutable_checkpoint()->set_every_seconds(0);
  c.set_seed(3);
  FillDefaults(&c);
  return c;
}

// A Learner (not started) with its sessions.
struct Rig {
  explicit Rig(const v1::TrainerConfig& c = Config()) : config(c), log(std::make_shared<InsertLog>()) {
    auto spec = NetworkSpec::Create(config.network());
    EXPECT_TRUE(spec.ok()) << spec.status();
    auto cpu = CreateCpuBackend(config);
    EXPECT_TRUE(cpu.ok()) << cpu.status();
    auto l = Learner::Create(config, std::make_unique<RecordingBackend>(*std::move(cpu), log));
    EXPECT_TRUE(l.ok()) << l.status();
    learner = *std::move(l);
    sessions = std::make_unique<IngestSessions>(learner.get(), *spec, config, &counters);
  }
  ~Rig() {
    learner->Stop();  // runs every pending callback before the sessions go
    sessions.reset();
  }

  v1::TrainerConfig config;
  std::shared_ptr<InsertLog> log;
  IngestCounters counters;
  std::unique_ptr<Learner> learner;
  std::unique_ptr<IngestSessions> sessions;
};

// A validated batch of `kind` and `n` rows (what ValidateBatch hands on).
IncomingBatch Incoming(v1::TransitionBatch::Kind kind, uint64_t sequence, const std::string& stream_id,
                       size_t n) {
  IncomingBatch b;
  b.kind = kind;
  b.sequence = sequence;
  b.stream_id = stream_id;
  b.columns.n = static_cast<int64_t>(n);
  b.columns.obs_dim = 1;
  b.columns.num_branches = 1;
  b.columns.Reserve(static_cast<int64_t>(n));
  return b;
}

// KIND_NSTEP batch whose rows have obs = reward = tag.
IncomingBatch NStep(uint64_t sequence, const std::string& stream_id, const std::vector<float>& tags) {
  IncomingBatch b = Incoming(v1::TransitionBatch::KIND_NSTEP, sequence, stream_id, tags.size());
  for (float t : tags) {
    b.columns.obs.push_back(t);
    b.columns.next_obs.push_back(t + 0.5f);
    b.columns.actions.push_back(0);
    b.columns.rewards.push_back(t);
    b.columns.discounts.push_back(0.5f);
  }
  return b;
}

struct StepIn {
  uint32_t env = 0;
  float obs = 0;  // next_obs = obs + 1
  float reward = 0;
  bool done = false;
};

IncomingBatch Step(uint64_t sequence, const std::string& stream_id, const std::vector<StepIn>& steps) {
  IncomingBatch b = Incoming(v1::TransitionBatch::KIND_STEP, sequence, stream_id, steps.size());
  for (const StepIn& s : steps) {
    b.columns.obs.push_back(s.obs);
    b.columns.next_obs.push_back(s.obs + 1);
    b.columns.actions.push_back(0);
    b.columns.rewards.push_back(s.reward);
    b.done.push_back(s.done ? 1 : 0);
    b.env_ids.push_back(s.env);
  }
  return b;
}

// Submits and waits for the outcome (the learner must be started, or the
// outcome must come inline).
IngestOutcome SubmitAndWait(IngestSessions* sessions, const std::shared_ptr<IngestSession>& s,
                            const IncomingBatch& b) {
  absl::Notification n;
  IngestOutcome out;
  sessions->Submit(s, b, [&](IngestOutcome o) {
    out = std::move(o);
    n.Notify();
  });
  n.WaitForNotification();
  return out;
}

IngestOutcome DetachAndWait(IngestSessions* sessions, const std::shared_ptr<IngestSession>& s, bool clean) {
  absl::Notification n;
  IngestOutcome out;
  sessions->Detach(s, clean, [&](IngestOutcome o) {
    out = std::move(o);
    n.Notify();
  });
  n.WaitForNotification();
  return out;
}

void ExpectRow(const Row& r, float obs, float reward, float discount, float next_obs) {
  EXPECT_FLOAT_EQ(r.obs, obs);
  EXPECT_FLOAT_EQ(r.reward, reward);
  EXPECT_FLOAT_EQ(r.discount, discount);
  EXPECT_FLOAT_EQ(r.next_obs, next_obs);
}

TEST(IngestSessionsTest, DuplicateOfACommittedSequenceInsertsNothing) {
  Rig rig;
  rig.learner->Start();
  auto s = rig.sessions->Attach("actor-1", [] {});
  IngestOutcome first = SubmitAndWait(rig.sessions.get(), s, NStep(1, "actor-1", {1, 2}));
  ASSERT_TRUE(first.status.ok()) << first.status;
  EXPECT_EQ(first.accepted, 2);
  EXPECT_FALSE(first.duplicate);
  EXPECT_EQ(first.replay_size, 2);
  for (int i = 0; i < 2; ++i) {
    IngestOutcome again = SubmitAndWait(rig.sessions.get(), s, NStep(1, "actor-1", {1, 2}));
    EXPECT_TRUE(again.duplicate);
    EXPECT_EQ(again.accepted, 0);
    EXPECT_EQ(again.replay_size, 2);
  }
  // A gap is fine; anything at or below the last committed one is a duplicate.
  EXPECT_EQ(SubmitAndWait(rig.sessions.get(), s, NStep(5, "actor-1", {3})).accepted, 1);
  EXPECT_TRUE(SubmitAndWait(rig.sessions.get(), s, NStep(4, "actor-1", {9})).duplicate);
  EXPECT_EQ(rig.log->Rows().size(), 3u);
}

// A duplicate carries what its first arrival inserted (accepted_before),
// for the session's newest kRecentBatches committed batches, KIND_STEP too
// (its count is the items its steps completed then), and across a
// Save/Restore; older ones, flushes and rejected batches report 0.
TEST(IngestSessionsTest, ADuplicateCarriesItsFirstInsertsCount) {
  v1::IngestState saved;
  std::mt19937 rng(5);
  std::vector<int64_t> counts(IngestSessions::kRecentBatches + 40);
  {
    Rig rig;
    rig.learner->Start();
    auto s = rig.sessions->Attach("actor-d", [] {});
    for (size_t i = 0; i < counts.size(); ++i) {
      const int rows = 1 + static_cast<int>(rng() % 4);
      std::vector<float> obs(rows, static_cast<float>(i));
      const IngestOutcome o = SubmitAndWait(rig.sessions.get(), s, NStep(i + 1, "actor-d", obs));
      ASSERT_TRUE(o.status.ok()) << o.status;
      counts[i] = o.accepted;
      EXPECT_EQ(o.accepted, rows);
      EXPECT_EQ(o.accepted_before, 0);
    }
    // Every remembered one, newest first and in a random order of the rest.
    std::vector<uint64_t> probe;
    for (uint64_t q = counts.size(); q > counts.size() - IngestSessions::kRecentBatches; --q)
      probe.push_back(q);
    std::shuffle(probe.begin() + 1, probe.end(), rng);
    for (uint64_t q : probe) {
      const IngestOutcome again = SubmitAndWait(rig.sessions.get(), s, NStep(q, "actor-d", {9}));
      EXPECT_TRUE(again.duplicate);
      EXPECT_EQ(again.accepted, 0);
      EXPECT_EQ(again.accepted_before, counts[q - 1]) << "sequence " << q;
    }
    // Older than the newest kRecentBatches: still a duplicate, count unknown.
    for (uint64_t q : {uint64_t{1}, uint64_t{40}}) {
      const IngestOutcome old = SubmitAndWait(rig.sessions.get(), s, NStep(q, "actor-d", {9}));
      EXPECT_TRUE(old.duplicate);
      EXPECT_EQ(old.accepted_before, 0) << "sequence " << q;
    }
    // KIND_STEP: the count its steps completed when it first came.
    auto w = rig.sessions->Attach("actor-w", [] {});
    const IngestOutcome wait =
        SubmitAndWait(rig.sessions.get(), w, Step(1, "actor-w", {{3, 0, 1}, {3, 1, 2}}));
    const IngestOutcome done =
        SubmitAndWait(rig.sessions.get(), w, Step(2, "actor-w", {{3, 2, 3}, {3, 3, 4}}));
    ASSERT_EQ(wait.accepted, 0);  // n = 3: both steps wait in the window
    ASSERT_EQ(done.accepted, 2);
    EXPECT_EQ(SubmitAndWait(rig.sessions.get(), w, Step(1, "actor-w", {{3, 0, 1}})).accepted_before, 0);
    EXPECT_EQ(SubmitAndWait(rig.sessions.get(), w, Step(2, "actor-w", {{3, 2, 3}})).accepted_before, 2);
    rig.sessions->Save(&saved);
  }
  std::map<std::string, const v1::IngestSessionState*> by_id;
  for (const auto& st : saved.sessions()) by_id[st.stream_id()] = &st;
  ASSERT_TRUE(by_id.count("actor-d"));
  ASSERT_EQ(by_id["actor-d"]->recent_size(), static_cast<int>(IngestSessions::kRecentBatches));
  Rig rig;
  ASSERT_TRUE(rig.sessions->Restore(saved).ok());
  rig.learner->Start();
  auto s = rig.sessions->Attach("actor-d", [] {});
  const uint64_t last = counts.size();
  EXPECT_EQ(SubmitAndWait(rig.sessions.get(), s, NStep(last, "actor-d", {9})).accepted_before,
            counts[last - 1]);
  EXPECT_EQ(SubmitAndWait(rig.sessions.get(), s, NStep(last - 50, "actor-d", {9})).accepted_before,
            counts[last - 51]);
  auto w = rig.sessions->Attach("actor-w", [] {});
  EXPECT_EQ(SubmitAndWait(rig.sessions.get(), w, Step(2, "actor-w", {{3, 2, 3}})).accepted_before, 2);

  // Remembered batches out of order, or past last_sequence, are refused naming the session and field.
  for (int variant = 0; variant < 2; ++variant) {
    v1::IngestState bad = saved;
    for (auto& st : *bad.mutable_sessions()) {
      if (st.stream_id() != "actor-d") continue;
      if (variant == 0) {
        st.mutable_recent(5)->set_sequence(st.recent(4).sequence());
      } else {
        st.mutable_recent(st.recent_size() - 1)->set_sequence(st.last_sequence() + 1);
      }
    }
    Rig other;
    const absl::Status status = other.sessions->Restore(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
    EXPECT_NE(status.message().find("\"actor-d\": recent.sequence"), std::string::npos) << status;
  }
}

TEST(IngestSessionsTest, SequenceZeroIsNeverDeduplicated) {
  Rig rig;
  rig.learner->Start();
  auto s = rig.sessions->Attach("actor-0", [] {});
  for (int i = 0; i < 3; ++i) {
    IngestOutcome o = SubmitAndWait(rig.sessions.get(), s, NStep(0, "actor-0", {7}));
    EXPECT_FALSE(o.duplicate);
    EXPECT_EQ(o.accepted, 1);
  }
  EXPECT_EQ(rig.log->Rows().size(), 3u);
  // Sequence 0 does not move the committed sequence: 1 is still new.
  EXPECT_EQ(SubmitAndWait(rig.sessions.get(), s, NStep(1, "actor-0", {8})).accepted, 1);
}

TEST(IngestSessionsTest, ResendWaitsForTheOriginalInFlight) {
  Rig rig;  // not started: Enqueue only queues, the original stays in flight
  std::atomic<bool> superseded{false};
  auto old_stream = rig.sessions->Attach("actor-2", [&] { superseded = true; });
  absl::Mutex mu;
  std::vector<std::string> order;
  absl::Notification original_done, resend_done;
  IngestOutcome original, resend;
  rig.sessions->Submit(old_stream, NStep(1, "actor-2", {5}), [&](IngestOutcome o) {
    original = std::move(o);
    absl::MutexLock lock(&mu);
    order.push_back("original");
    original_done.Notify();
  });
  auto new_stream = rig.sessions->Attach("actor-2", [] {});
  EXPECT_TRUE(superseded);
  rig.sessions->Submit(new_stream, NStep(1, "actor-2", {5}), [&](IngestOutcome o) {
    resend = std::move(o);
    absl::MutexLock lock(&mu);
    order.push_back("resend");
    resend_done.Notify();
  });
  EXPECT_FALSE(original_done.HasBeenNotified());
  EXPECT_FALSE(resend_done.HasBeenNotified());  // never an early ack
  rig.learner->Start();
  resend_done.WaitForNotification();
  ASSERT_TRUE(original_done.HasBeenNotified());
  EXPECT_EQ(original.accepted, 1);
  EXPECT_FALSE(original.duplicate);
  EXPECT_TRUE(resend.duplicate);
  EXPECT_EQ(resend.accepted, 0);
  EXPECT_EQ(order, (std::vector<std::string>{"original", "resend"}));
  EXPECT_EQ(rig.log->Rows().size(), 1u);
  // The superseded stream's detach leaves the session to its successor.
  DetachAndWait(rig.sessions.get(), old_stream, /*clean=*/true);
  EXPECT_TRUE(SubmitAndWait(rig.sessions.get(), new_stream, NStep(1, "actor-2", {5})).duplicate);
}

// Pipelined: batches 1 and 2 go to the learner without waiting for each
// other; a resend of 2 waits for its original; a rejected batch and a
// duplicate behind them are answered after them; n-step windows continue
// across the pipelined batches exactly as if each had waited.
TEST(IngestSessionsTest, PipelinedOutcomesComeInSubmissionOrder) {
  v1::TrainerConfig c = Config();
  c.mutable_server()->set_max_envs_per_stream(2);
  Rig rig(c);  // not started: every insert stays in flight until Start
  auto s = rig.sessions->Attach("actor-p", [] {});
  absl::Mutex mu;
  std::vector<std::pair<int, IngestOutcome>> outcomes;
  auto submit = [&](int index, IncomingBatch b) {
    rig.sessions->Submit(s, std::move(b), [&, index](IngestOutcome o) {
      absl::MutexLock lock(&mu);
      outcomes.emplace_back(index, std::move(o));
    });
  };
  submit(0, Step(1, "actor-p", {{0, 0, 1}, {0, 1, 2}, {0, 2, 4}}));  // one transition, window [1, 2]
  submit(1, Step(2, "actor-p", {{0, 3, 8}, {1, 10, 1}}));            // one more (from step 1)
  submit(2, Step(2, "actor-p", {{0, 3, 8}, {1, 10, 1}}));            // resend of 2 in flight
  submit(3, Step(3, "actor-p", {{2, 20, 1}}));                       // a third env: rejected
  submit(4, NStep(1, "actor-p", {7}));                               // duplicate of 1 (once committed)
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(outcomes.empty());  // nothing answered ahead of the inserts in flight
  }
  rig.learner->Start();
  {
    absl::MutexLock lock(&mu);
    auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return outcomes.size() == 5; };
    mu.Await(absl::Condition(&all));
    for (int i = 0; i < 5; ++i) EXPECT_EQ(outcomes[i].first, i);
    EXPECT_EQ(outcomes[0].second.accepted, 1);
    EXPECT_EQ(outcomes[1].second.accepted, 1);
    EXPECT_FALSE(outcomes[1].second.duplicate);
    EXPECT_TRUE(outcomes[2].second.duplicate);
    ASSERT_TRUE(outcomes[3].second.error.has_value());
    EXPECT_EQ(outcomes[3].second.error->field, "env_ids");
    EXPECT_TRUE(outcomes[4].second.duplicate);
  }
  const auto rows = rig.log->Rows();
  ASSERT_EQ(rows.size(), 2u);
  ExpectRow(rows[0], 0, 1 + 0.5f * 2 + 0.25f * 4, 0.125f, 3);
  ExpectRow(rows[1], 1, 2 + 0.5f * 4 + 0.25f * 8, 0.125f, 4);
  EXPECT_EQ(rig.sessions->pending_transitions(), 3);  // env 0: steps 2, 3; env 1: step 10
}

TEST(IngestSessionsTest, AFailedInsertCommitsNothingAndAResendInserts) {
  v1::IngestState saved;
  {
    Rig rig;
    rig.learner->Stop();  // Enqueue now answers Cancelled inline
    auto s = rig.sessions->Attach("actor-3", [] {});
    ASSERT_EQ(SubmitAndWait(rig.sessions.get(), s, Step(1, "actor-3", {{0, 0, 1}, {0, 1, 2}})).accepted, 0);
    IngestOutcome failed = SubmitAndWait(rig.sessions.get(), s, Step(2, "actor-3", {{0, 2, 4}}));
    EXPECT_FALSE(failed.status.ok());
    EXPECT_EQ(failed.accepted, 0);
    EXPECT_FALSE(SubmitAndWait(rig.sessions.get(), s, NStep(3, "actor-3", {9})).status.ok());
    rig.sessions->Save(&saved);
    ASSERT_EQ(saved.sessions_size(), 1);
    EXPECT_EQ(saved.sessions(0).last_sequence(), 1u);           // 2 and 3 not committed
    EXPECT_EQ(saved.sessions(0).windows(0).rewards_size(), 2);  // the window before batch 2
    EXPECT_EQ(rig.sessions->pending_transitions(), 2);
  }
  Rig rig;
  ASSERT_TRUE(rig.sessions->Restore(saved).ok());
  rig.learner->Start();
  auto s = rig.sessions->Attach("actor-3", [] {});
  IngestOutcome resend = SubmitAndWait(rig.sessions.get(), s, Step(2, "actor-3", {{0, 2, 4}}));
  ASSERT_TRUE(resend.status.ok());
  EXPECT_FALSE(resend.duplicate);
  EXPECT_EQ(resend.accepted, 1);
  EXPECT_EQ(SubmitAndWait(rig.sessions.get(), s, NStep(3, "actor-3", {9})).accepted, 1);
  const auto rows = rig.log->Rows();
  ASSERT_EQ(rows.size(), 2u);
  ExpectRow(rows[0], 0, 1 + 0.5f * 2 + 0.25f * 4, 0.125f, 3);
}

TEST(IngestSessionsTest, HalfCloseFlushesShorterHorizonReturns) {
  Rig rig;
  rig.learner->Start();
  auto s = rig.sessions->Attach("actor-4", [] {});
  IngestOutcome o =
      SubmitAndWait(rig.sessions.get(), s, Step(1, "actor-4", {{0, 0, 1}, {0, 1, 2}, {1, 10, 8}}));
  EXPECT_EQ(o.accepted, 0);
  EXPECT_EQ(rig.sessions->pending_transitions(), 3);
  IngestOutcome flushed = DetachAndWait(rig.sessions.get(), s, /*clean=*/true);
  ASSERT_TRUE(flushed.status.ok());
  EXPECT_EQ(flushed.accepted, 3);
  EXPECT_EQ(rig.sessions->pending_transitions(), 0);
  const auto rows = rig.log->Rows();
  ASSERT_EQ(rows.size(), 3u);
  // R over the steps that exist, discount 0.5^K, bootstrap from the last next_obs.
  ExpectRow(rows[0], 0, 1 + 0.5f * 2, 0.25f, 2);
  ExpectRow(rows[1], 1, 2, 0.5f, 2);
  ExpectRow(rows[2], 10, 8, 0.5f, 11);
  // The sequence record stays: a resend after the close is a duplicate.
  auto again = rig.sessions->Attach("actor-4", [] {});
  EXPECT_TRUE(SubmitAndWait(rig.sessions.get(), again, Step(1, "actor-4", {{0, 0, 1}})).duplicate);
}

TEST(IngestSessionsTest, ReconnectWithinTheResumeWindowContinuesTheWindows) {
  Rig rig;
  rig.learner->Start();
  auto s = rig.sessions->Attach("actor-5", [] {});
  ASSERT_EQ(SubmitAndWait(rig.sessions.get(), s, Step(1, "actor-5", {{0, 0, 1}, {0, 1, 2}})).accepted, 0);
  DetachAndWait(rig.sessions.get(), s, /*clean=*/false);
  EXPECT_EQ(rig.sessions->pending_transitions(), 2);
  rig.sessions->Expire(absl::Now() + absl::Seconds(30));  // within stream_resume_seconds
  EXPECT_EQ(rig.sessions->pending_transitions(), 2);
  auto back = rig.sessions->Attach("actor-5", [] {});
  IngestOutcome o = SubmitAndWait(rig.sessions.get(), back, Step(2, "actor-5", {{0, 2, 4}}));
  EXPECT_EQ(o.accepted, 1);
  const auto rows = rig.log->Rows();
  ASSERT_EQ(rows.size(), 1u);
  ExpectRow(rows[0], 0, 1 + 0.5f * 2 + 0.25f * 4, 0.125f, 3);  // the full 3-step return
}

TEST(IngestSessionsTest, ExpireFlushesWindowsThenForgetsRecords) {
  Rig rig;
  rig.learner->Start();
  auto s = rig.sessions->Attach("actor-6", [] {});
  ASSERT_EQ(SubmitAndWait(rig.sessions.get(), s, Step(1, "actor-6", {{0, 0, 1}, {0, 1, 2}})).accepted, 0);
  DetachAndWait(rig.sessions.get(), s, /*clean=*/false);
  rig.sessions->Expire(absl::Now() + absl::Seconds(61));
  rig.log->WaitForRows(2);
  // The rows are in the replay; the flush commits (windows cleared) right after.
  while (rig.sessions->pending_transitions() > 0) std::this_thread::yield();
  const auto rows = rig.log->Rows();
  ExpectRow(rows[0], 0, 1 + 0.5f * 2, 0.25f, 2);
  ExpectRow(rows[1], 1, 2, 0.5f, 2);
  EXPECT_EQ(rig.sessions->num_sessions(), 1);  // the sequence record stays until the ttl
  rig.sessions->Expire(absl::Now() + absl::Seconds(1800));
  EXPECT_EQ(rig.sessions->num_sessions(), 1);
  rig.sessions->Expire(absl::Now() + absl::Seconds(3601));
  EXPECT_EQ(rig.sessions->num_sessions(), 0);
  auto again = rig.sessions->Attach("actor-6", [] {});
  EXPECT_FALSE(SubmitAndWait(rig.sessions.get(), again, NStep(1, "actor-6", {3})).duplicate);
}

TEST(IngestSessionsTest, BeyondMaxSessionsTheLongestDetachedIsFlushedAndForgotten) {
  v1::TrainerConfig config = Config();
  config.mutable_server()->set_max_sessions(3);
  Rig rig(config);
  rig.learner->Start();
  for (int i = 0; i < 3; ++i) {
    const std::string id = absl::StrCat("m", i);
    auto s = rig.sessions->Attach(id, [] {});
    ASSERT_EQ(SubmitAndWait(rig.sessions.get(), s, Step(1, id, {{0, 100.0f * i, 1}})).accepted, 0);
    DetachAndWait(rig.sessions.get(), s, /*clean=*/false);
  }
  auto fourth = rig.sessions->Attach("m3", [] {});  // evicts m0, flushing its window
  EXPECT_EQ(rig.sessions->num_sessions(), 3);
  rig.log->WaitForRows(1);
  EXPECT_FLOAT_EQ(rig.log->Rows()[0].obs, 0);
  auto m0 = rig.sessions->Attach("m0", [] {});  // forgotten: 1 is new again (evicts m1)
  EXPECT_FALSE(SubmitAndWait(rig.sessions.get(), m0, NStep(1, "m0", {5})).duplicate);
  auto m2 = rig.sessions->Attach("m2", [] {});
  EXPECT_TRUE(SubmitAndWait(rig.sessions.get(), m2, NStep(1, "m2", {6})).duplicate);
}

TEST(IngestSessionsTest, QueuedBytesFullRefusesWithResourceExhaustedUntilTheReplayTakesTheBatch) {
  v1::TrainerConfig config = Config();
  config.mutable_server()->set_max_queued_bytes(1);  // one batch may overshoot it by itself
  Rig rig(config);                                   // not started: the first batch waits for the learner
  auto a = rig.sessions->Attach("qa", [] {});
  auto b = rig.sessions->Attach("qb", [] {});
  absl::Notification a_done;
  IngestOutcome a_outcome;
  rig.sessions->Submit(a, NStep(1, "qa", {1, 2}), [&](IngestOutcome o) {
    a_outcome = std::move(o);
    a_done.Notify();
  });
  EXPECT_FALSE(a_done.HasBeenNotified());
  EXPECT_GT(rig.sessions->queued_bytes(), 0);
  const IngestOutcome refused = SubmitAndWait(rig.sessions.get(), b, NStep(1, "qb", {3}));  // inline
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status.message().find("server.max_queued_bytes = 1 is reached"), std::string::npos)
      << refused.status;
  EXPECT_EQ(refused.accepted, 0);
  EXPECT_EQ(rig.counters.rejected_by_reason()["queued_bytes"], 1);
  rig.learner->Start();
  a_done.WaitForNotification();
  ASSERT_TRUE(a_outcome.status.ok()) << a_outcome.status;
  EXPECT_EQ(rig.sessions->queued_bytes(), 0);
  // Its sequence was not committed: the resend is new.
  const IngestOutcome resent = SubmitAndWait(rig.sessions.get(), b, NStep(1, "qb", {3}));
  ASSERT_TRUE(resent.status.ok()) << resent.status;
  EXPECT_EQ(resent.accepted, 1);
  EXPECT_FALSE(resent.duplicate);
  EXPECT_EQ(rig.sessions->queued_bytes(), 0);
}

// Ack.throttle: pressured() from half of server.max_queued_bytes of queued
// batches, and no longer once the replay took them.
TEST(IngestSessionsTest, PressuredFromHalfOfMaxQueuedBytes) {
  int64_t one_batch = 0;
  {
    Rig probe(Config());  // not started: the batch waits in the queue
    auto s = probe.sessions->Attach("p", [] {});
    probe.sessions->Submit(s, NStep(1, "p", {1}), [](const IngestOutcome&) {});
    one_batch = probe.sessions->queued_bytes();
    ASSERT_GT(one_batch, 0);
    probe.learner->Start();
  }
  v1::TrainerConfig config = Config();
  config.mutable_server()->set_max_queued_bytes(4 * one_batch);
  Rig rig(config);
  auto s = rig.sessions->Attach("p", [] {});
  EXPECT_FALSE(rig.sessions->pressured());
  std::atomic<int> done{0};
  rig.sessions->Submit(s, NStep(1, "p", {1}), [&](const IngestOutcome&) { done.fetch_add(1); });
  EXPECT_EQ(rig.sessions->queued_bytes(), one_batch);
  EXPECT_FALSE(rig.sessions->pressured());  // a quarter
  rig.sessions->Submit(s, NStep(2, "p", {2}), [&](const IngestOutcome&) { done.fetch_add(1); });
  EXPECT_TRUE(rig.sessions->pressured());  // half
  rig.learner->Start();
  while (done.load() < 2) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(rig.sessions->queued_bytes(), 0);
  EXPECT_FALSE(rig.sessions->pressured());
}

TEST(IngestSessionsTest, WindowsCountTowardsTheQueuedBytesUntilFlushed) {
  v1::TrainerConfig config = Config();
  const int64_t window_bytes =
      NStepAssembler(*NetworkSpec::Create(config.network()), 3, 0.5f, 1).window_bytes();
  config.mutable_server()->set_max_queued_bytes(4 * window_bytes);
  Rig rig(config);
  rig.learner->Start();
  auto a = rig.sessions->Attach("wa", [] {});
  // Three envs, one step each: everything waits in its window. Until the
  // committed windows fold the batch in, the batch counts too (with the
  // windows it may open); pending_transitions() folds.
  const IncomingBatch first = Step(1, "wa", {{0, 1, 1}, {1, 2, 1}, {2, 3, 1}});
  ASSERT_EQ(SubmitAndWait(rig.sessions.get(), a, first).accepted, 0);
  EXPECT_EQ(rig.sessions->queued_bytes(), first.bytes() + 3 * window_bytes);
  EXPECT_EQ(rig.sessions->pending_transitions(), 3);
  EXPECT_EQ(rig.sessions->queued_bytes(), 3 * window_bytes);
  // An episode end closes a window; a new env opens one (still below the budget).
  ASSERT_TRUE(SubmitAndWait(rig.sessions.get(), a, Step(2, "wa", {{0, 1, 1, true}, {3, 4, 1}, {4, 5, 1}}))
                  .status.ok());
  EXPECT_EQ(rig.sessions->pending_transitions(), 4);
  EXPECT_EQ(rig.sessions->queued_bytes(), 4 * window_bytes);
  auto b = rig.sessions->Attach("wb", [] {});
  const IngestOutcome refused = SubmitAndWait(rig.sessions.get(), b, NStep(1, "wb", {9}));
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted);
  // The half-close flush gives every window back.
  ASSERT_TRUE(DetachAndWait(rig.sessions.get(), a, /*clean=*/true).status.ok());
  EXPECT_EQ(rig.sessions->queued_bytes(), 0);
  EXPECT_EQ(SubmitAndWait(rig.sessions.get(), b, NStep(1, "wb", {9})).accepted, 1);
}

TEST(IngestSessionsTest, EnvIdsPerSessionAreBoundedByMaxEnvsPerStream) {
  v1::TrainerConfig config = Config();
  config.mutable_server()->set_max_envs_per_stream(2);
  Rig rig(config);
  rig.learner->Start();
  auto s = rig.sessions->Attach("envs", [] {});
  ASSERT_EQ(SubmitAndWait(rig.sessions.get(), s, Step(1, "envs", {{0, 1, 1}, {1, 2, 1}})).accepted, 0);
  const IngestOutcome o = SubmitAndWait(rig.sessions.get(), s, Step(2, "envs", {{5, 3, 1}}));
  ASSERT_TRUE(o.status.ok());
  ASSERT_TRUE(o.error.has_value());
  EXPECT_EQ(o.error->field, "env_ids");
  EXPECT_EQ(o.error->message,
            "env_ids[0]: 5 opens more than server.max_envs_per_stream = 2 environments on this stream");
  // Sequence 2 was not committed: a corrected resend is new.
  EXPECT_FALSE(SubmitAndWait(rig.sessions.get(), s, Step(2, "envs", {{1, 3, 1}})).duplicate);
}

IncomingBatch WithEpisodes(IncomingBatch b, const std::string& env, const std::vector<double>& returns) {
  b.episodes.env = env;
  for (double r : returns) b.episodes.reports.push_back({r, 10, 0});
  return b;
}

// Episode reports come back in the outcome exactly when the batch commits
// as new: never for a duplicate, a rejected or a failed batch.
TEST(IngestSessionsTest, EpisodesComeBackOnlyWhenTheBatchCommitsAsNew) {
  v1::TrainerConfig config = Config();
  config.mutable_server()->set_max_envs_per_stream(1);
  Rig rig(config);
  rig.learner->Start();
  auto s = rig.sessions->Attach("episodes", [] {});
  // Env 3's step waits in its window: committed, nothing inserted yet.
  const IncomingBatch first = WithEpisodes(Step(1, "episodes", {{3, 1, 1}}), "E", {21, 22});
  IngestOutcome o = SubmitAndWait(rig.sessions.get(), s, first);
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.accepted, 0);
  EXPECT_EQ(o.episodes.env, "E");
  ASSERT_EQ(o.episodes.reports.size(), 2u);
  EXPECT_EQ(o.episodes.reports[1].episode_return, 22);
  o = SubmitAndWait(rig.sessions.get(), s, first);
  EXPECT_TRUE(o.duplicate);
  EXPECT_TRUE(o.episodes.empty());
  // Reports alone (count 0), both kinds: committed like any batch, and a
  // KIND_STEP one without env_ids opens no env 0 (the session holds its one
  // env, env 3).
  for (auto kind : {v1::TransitionBatch::KIND_STEP, v1::TransitionBatch::KIND_NSTEP}) {
    const uint64_t sequence = kind == v1::TransitionBatch::KIND_STEP ? 2 : 3;
    const IncomingBatch alone = WithEpisodes(Incoming(kind, sequence, "episodes", 0), "E", {-5});
    o = SubmitAndWait(rig.sessions.get(), s, alone);
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_FALSE(o.error.has_value()) << o.error->message;
    EXPECT_FALSE(o.duplicate);
    EXPECT_EQ(o.accepted, 0);
    ASSERT_EQ(o.episodes.reports.size(), 1u);
    EXPECT_EQ(o.episodes.reports[0].episode_return, -5);
    o = SubmitAndWait(rig.sessions.get(), s, alone);
    EXPECT_TRUE(o.duplicate);
    EXPECT_TRUE(o.episodes.empty());
  }
  // Rejected by the session (a second env): nothing comes back.
  o = SubmitAndWait(rig.sessions.get(), s, WithEpisodes(Step(4, "episodes", {{7, 1, 1, true}}), "E", {1}));
  ASSERT_TRUE(o.error.has_value());
  EXPECT_EQ(o.error->field, "env_ids");
  EXPECT_TRUE(o.episodes.empty());
  // A failed insert: nothing either.
  rig.learner->Stop();
  o = SubmitAndWait(rig.sessions.get(), s, WithEpisodes(Step(5, "episodes", {{3, 1, 1, true}}), "E", {1}));
  EXPECT_FALSE(o.status.ok());
  EXPECT_TRUE(o.episodes.empty());
}

TEST(IngestSessionsTest, SaveRestoreRoundTripAndPrivateSessionsFlushAtRestore) {
  v1::IngestState saved;
  {
    Rig rig;
    rig.learner->Start();
    auto named = rig.sessions->Attach("actor-7", [] {});
    ASSERT_EQ(SubmitAndWait(rig.sessions.get(), named, Step(5, "actor-7", {{2, 0, 1}, {2, 1, 2}})).accepted,
              0);
    auto mine = rig.sessions->Attach("", [] {});
    ASSERT_EQ(SubmitAndWait(rig.sessions.get(), mine, Step(1, "", {{0, 50, 3}})).accepted, 0);
    rig.sessions->Save(&saved);
  }
  ASSERT_EQ(saved.sessions_size(), 2);
  std::map<std::string, const v1::IngestSessionState*> by_id;
  for (const auto& s : saved.sessions()) by_id[s.stream_id()] = &s;
  ASSERT_TRUE(by_id.count("actor-7"));
  EXPECT_EQ(by_id["actor-7"]->last_sequence(), 5u);
  ASSERT_EQ(by_id["actor-7"]->windows_size(), 1);
  EXPECT_EQ(by_id["actor-7"]->windows(0).env_id(), 2u);
  ASSERT_TRUE(by_id.count(""));

  Rig rig;
  ASSERT_TRUE(rig.sessions->Restore(saved).ok());
  EXPECT_EQ(rig.sessions->num_sessions(), 1);
  EXPECT_EQ(rig.sessions->pending_transitions(), 2);
  rig.learner->Start();
  rig.log->WaitForRows(1);  // the private window, flushed
  ExpectRow(rig.log->Rows()[0], 50, 3, 0.5f, 51);
  auto s = rig.sessions->Attach("actor-7", [] {});
  EXPECT_TRUE(SubmitAndWait(rig.sessions.get(), s, Step(5, "actor-7", {{2, 0, 1}})).duplicate);
  EXPECT_EQ(SubmitAndWait(rig.sessions.get(), s, Step(6, "actor-7", {{2, 2, 4}})).accepted, 1);
  const auto rows = rig.log->Rows();
  ASSERT_EQ(rows.size(), 2u);
  ExpectRow(rows[1], 0, 1 + 0.5f * 2 + 0.25f * 4, 0.125f, 3);

  // A window that does not fit the network is refused, naming the session.
  v1::IngestState bad = saved;
  bad.mutable_sessions(0)->mutable_windows(0)->add_obs(1);
  absl::Status st = rig.sessions->Restore(bad);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_NE(st.message().find(absl::StrCat("\"", bad.sessions(0).stream_id(), "\"")), std::string::npos)
      << st;
}

// The committed windows are kept lazily (a log folded every few batches or
// when read): a checkpoint between deliveries, one taken while batches are
// in flight behind a held insert, and one after a failed insert must all
// save exactly the windows of replaying every committed batch in turn, and
// the rows inserted must be the items of assembling them in order.
TEST(IngestSessionsTest, LazyCommittedWindowsEqualTheEagerOnesAtEveryCheckpoint) {
  v1::TrainerConfig c = Config();
  // The learner steps all along, so inserts go through its rounds (not
  // inline) and a held insert keeps the batches behind it in flight.
  c.mutable_rate_limiter()->set_min_size_to_sample(1);
  Rig rig(c);
  rig.learner->Start();
  const NetworkSpec spec = *NetworkSpec::Create(c.network());
  const NStepAssembler reference(spec, 3, 0.5f, c.server().max_envs_per_stream());
  NStepWindows eager;  // every committed batch replayed in turn
  NStepWindows issued;
  TransitionColumns items = EmptyColumns(spec);
  const auto commit = [&](const IncomingBatch& b) {
    ASSERT_FALSE(reference.Add(b, &issued, &items).has_value());
    reference.Replay(b, &eager);
  };
  const auto saved = [&] {
    v1::IngestState state;
    rig.sessions->Save(&state);
    for (const auto& session : state.sessions()) {
      if (session.stream_id() != "lazy") continue;
      v1::IngestSessionState windows;
      *windows.mutable_windows() = session.windows();
      return windows.SerializeAsString();
    }
    return std::string("no session");
  };
  const auto expected = [&] {
    v1::IngestSessionState state;
    reference.Save(eager, state.mutable_windows());
    return state.SerializeAsString();
  };

  std::mt19937 rng(7);
  std::vector<int> t(4, 0);  // per env: the next step's obs is 100 env + t
  uint64_t sequence = 0;
  // 1-6 rows over 4 envs, about one in eight ending its episode (the last
  // one when `end`: the batch then inserts at least that row), in either form.
  const auto next_batch = [&](bool end = false) {
    const bool stream_form = rng() % 2 == 0;
    std::vector<StepIn> steps;
    std::vector<bool> truncated;
    for (int i = 0, rows = 1 + static_cast<int>(rng() % 6); i < rows; ++i) {
      const uint32_t env = rng() % 4;
      const bool ends = rng() % 8 == 0 || (end && i + 1 == rows);
      steps.push_back({env, 100.0f * env + static_cast<float>(t[env]++), static_cast<float>(rng() % 5),
                       ends && rng() % 2 == 0});
      truncated.push_back(ends && !steps.back().done);
    }
    IncomingBatch b = Step(++sequence, "lazy", steps);
    b.truncated.assign(truncated.begin(), truncated.end());
    if (stream_form) {
      // A row's next state is its env's next row's obs (obs + 1); the rows
      // that end their episode carry theirs as final_obs.
      for (size_t i = 0; i < steps.size(); ++i) {
        if (b.done[i] != 0 || b.truncated[i] != 0) b.final_obs.push_back(b.columns.next_obs[i]);
      }
      b.columns.next_obs.clear();
    }
    return b;
  };

  // One row in the replay first, so that the learner steps (never parked:
  // no insert runs inline on the submitting thread, which a hold would block).
  auto fill = rig.sessions->Attach("fill", [] {});
  ASSERT_EQ(SubmitAndWait(rig.sessions.get(), fill, NStep(1, "fill", {-1})).accepted, 1);
  auto s = rig.sessions->Attach("lazy", [] {});
  for (int round = 0; round < 40; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    // Delivered one by one (every fourth round enough rows for the log to
    // fold by itself); a checkpoint between deliveries.
    for (int i = 0, n = round % 4 == 0 ? 30 : static_cast<int>(rng() % 8); i < n; ++i) {
      IncomingBatch b = next_batch();
      commit(b);
      ASSERT_EQ(SubmitAndWait(rig.sessions.get(), s, b).status, absl::OkStatus());
    }
    ASSERT_EQ(saved(), expected());
    // In flight: the learner holds its inserts; the first batch inserts and
    // what is issued behind it is not committed.
    rig.log->Hold(true);
    std::vector<IncomingBatch> in_flight;
    absl::Mutex mu;
    int answered = 0;
    for (int i = 0, n = 1 + static_cast<int>(rng() % 4); i < n; ++i) {
      in_flight.push_back(next_batch(/*end=*/i == 0));
      rig.sessions->Submit(s, in_flight.back(), [&](const IngestOutcome& o) {
        EXPECT_TRUE(o.status.ok()) << o.status;
        absl::MutexLock lock(&mu);
        ++answered;
      });
    }
    EXPECT_EQ(saved(), expected());
    rig.log->Hold(false);
    {
      absl::MutexLock lock(&mu);
      auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
        return answered == static_cast<int>(in_flight.size());
      };
      mu.Await(absl::Condition(&all));
    }
    for (const IncomingBatch& b : in_flight) commit(b);
    ASSERT_EQ(saved(), expected());
    // Every few rounds an insert fails: nothing of it is committed, the
    // session restarts its issued windows from the committed ones and the
    // resend goes in afresh.
    if (round % 3 == 2) {
      IncomingBatch b = next_batch(/*end=*/true);
      rig.log->Fail(true);
      EXPECT_FALSE(SubmitAndWait(rig.sessions.get(), s, b).status.ok());
      rig.log->Fail(false);
      ASSERT_EQ(saved(), expected());
      commit(b);
      ASSERT_EQ(SubmitAndWait(rig.sessions.get(), s, b).status, absl::OkStatus());
      ASSERT_EQ(saved(), expected());
    }
  }
  const auto rows = rig.log->Rows();
  ASSERT_EQ(static_cast<int64_t>(rows.size()), 1 + items.n);
  for (int64_t i = 0; i < items.n; ++i) {
    ExpectRow(rows[1 + i], items.obs[i], items.rewards[i], items.discounts[i], items.next_obs[i]);
  }
  // Every byte counted for batches, logs and windows comes back.
  EXPECT_TRUE(DetachAndWait(rig.sessions.get(), s, /*clean=*/true).status.ok());
  EXPECT_TRUE(DetachAndWait(rig.sessions.get(), fill, /*clean=*/true).status.ok());
  EXPECT_EQ(rig.sessions->queued_bytes(), 0);
}

// Many concurrent streams over a few stream_ids with random resends,
// takeovers and clean/unclean ends: once everything is flushed, the rows
// inserted are exactly the acknowledged ones, each once.
void RunProperty(uint32_t seed, bool pipelined) {
  v1::TrainerConfig c = Config();
  if (pipelined) {
    // The learner steps all along, so inserts go through its rounds and
    // their callbacks run on 4 threads: a stream's outcomes finish out of
    // order and the sessions must still commit and answer them in order.
    c.mutable_rate_limiter()->set_min_size_to_sample(1);
    setenv("QSTREAM_CALLBACK_THREADS", "4", 1);
  }
  Rig rig(c);
  unsetenv("QSTREAM_CALLBACK_THREADS");
  rig.learner->Start();
  constexpr int kThreads = 8;
  constexpr int kConnections = 60;  // per thread
  const std::vector<std::string> ids = {"p0", "p1", "p2", "p3", ""};

  struct Client {
    absl::Mutex mu;
    uint64_t next ABSL_GUARDED_BY(mu) = 0;
    std::map<uint64_t, IncomingBatch> sent ABSL_GUARDED_BY(mu);
  };
  std::map<std::string, Client> clients;
  for (const auto& id : ids) clients[id];
  std::atomic<int> next_tag{1};

  absl::Mutex mu;
  std::multiset<float> acked;  // tags of batches acknowledged as new
  int duplicates = 0;

  auto connection = [&](std::mt19937& rng) {
    const std::string id = ids[rng() % ids.size()];
    const bool step = id == "p0" || id == "p1" || (id.empty() && rng() % 2);
    Client& shared = clients[id];
    Client own;  // a private session numbers per connection
    Client& client = id.empty() ? own : shared;
    auto superseded = std::make_shared<std::atomic<bool>>(false);
    auto s = rig.sessions->Attach(id, [superseded] { *superseded = true; });
    const int batches = 1 + rng() % 6;
    // Pipelined: up to `window` batches submitted before their outcomes;
    // outcomes must come in submission order.
    const int window = pipelined ? 1 + static_cast<int>(rng() % 8) : 1;
    absl::Mutex flight_mu;
    int in_flight = 0;
    std::vector<int> outcome_order;
    for (int b = 0; b < batches && !*superseded; ++b) {
      {
        absl::MutexLock lock(&flight_mu);
        auto room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(flight_mu) { return in_flight < window; };
        flight_mu.Await(absl::Condition(&room));
        ++in_flight;
      }
      auto batch = std::make_shared<IncomingBatch>();
      {
        absl::MutexLock lock(&client.mu);
        if (client.next > 0 && rng() % 4 == 0) {  // resend an old one
          *batch = client.sent[1 + rng() % client.next];
        } else {
          const int n = 1 + rng() % 4;
          std::vector<float> tags;
          std::vector<StepIn> steps;
          for (int i = 0; i < n; ++i) {
            const float tag = static_cast<float>(next_tag++);
            tags.push_back(tag);
            steps.push_back({static_cast<uint32_t>(rng() % 3), tag, 1, rng() % 5 == 0});
          }
          const uint64_t seq = ++client.next;
          *batch = step ? Step(seq, id, steps) : NStep(seq, id, tags);
          client.sent[seq] = *batch;
        }
        // Submitted under the client's lock: one client sends in sequence order.
        rig.sessions->Submit(s, *batch, [&, batch, b](const IngestOutcome& o) {
          EXPECT_TRUE(o.status.ok()) << o.status;
          EXPECT_FALSE(o.error.has_value());
          {
            absl::MutexLock lock(&mu);
            if (o.duplicate) {
              ++duplicates;
            } else {
              for (float t : batch->columns.obs) acked.insert(t);
            }
          }
          absl::MutexLock lock(&flight_mu);
          outcome_order.push_back(b);
          --in_flight;
        });
      }
    }
    {
      absl::MutexLock lock(&flight_mu);
      auto idle = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(flight_mu) { return in_flight == 0; };
      flight_mu.Await(absl::Condition(&idle));
      for (size_t i = 0; i < outcome_order.size(); ++i) {
        EXPECT_EQ(outcome_order[i], static_cast<int>(i))
            << "outcomes out of submission order (seed " << seed << ")";
      }
    }
    DetachAndWait(rig.sessions.get(), s, /*clean=*/rng() % 2 == 0);
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(seed * 1000 + t);
      for (int c = 0; c < kConnections; ++c) connection(rng);
    });
  }
  for (auto& t : threads) t.join();
  rig.sessions->Expire(absl::Now() + absl::Seconds(61));  // flushes every window left by unclean ends
  // Those flushes (and the ones unclean private ends posted) are committed
  // asynchronously, behind whatever their session still has in flight: the
  // learner must still be running when they reach it.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (rig.sessions->pending_transitions() > 0 && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(2));
  rig.learner->Stop();  // inserts everything queued
  EXPECT_EQ(rig.sessions->pending_transitions(), 0);

  std::multiset<float> inserted;
  for (const Row& r : rig.log->Rows()) inserted.insert(r.obs);
  for (float t : inserted)
    EXPECT_EQ(inserted.count(t), 1u) << "tag " << t << " inserted twice (seed " << seed << ")";
  EXPECT_EQ(inserted, acked) << "seed " << seed;
  EXPECT_GT(duplicates, 0);
}

TEST(IngestSessionsPropertyTest, InsertedEqualsAcknowledgedExactlyOnce) {
  for (uint32_t seed : {1u, 2u, 3u, 4u, 5u, 6u}) RunProperty(seed, /*pipelined=*/false);
}

// The same with each connection keeping up to 8 batches in flight (what the
// stream reactor does with server.max_in_flight_per_stream): every batch
// assembled against the state its predecessors leave, outcomes in order.
TEST(IngestSessionsPropertyTest, PipelinedInsertedEqualsAcknowledgedExactlyOnce) {
  for (uint32_t seed : {11u, 12u, 13u, 14u, 15u, 16u}) RunProperty(seed, /*pipelined=*/true);
}

// The same streams with a checkpoint taken at a random moment while they run,
// then a "crash" (everything after the checkpoint is lost) and a restore into
// a new learner and new sessions, after which every client resends all it
// ever sent. Each transition ends up in the replay exactly once: what the
// checkpoint held is acknowledged as duplicate, the rest is inserted again.
void RunRestartProperty(uint32_t seed) {
  const std::string dir = absl::StrCat(std::filesystem::temp_directory_path().string(),
                                       "/qstream-ingest-restart-", getpid(), "-", seed);
  std::filesystem::remove_all(dir);
  const std::vector<std::string> ids = {"r0", "r1", "r2", "r3"};  // named: resumable
  struct Client {
    absl::Mutex mu;
    uint64_t next ABSL_GUARDED_BY(mu) = 0;
    std::map<uint64_t, IncomingBatch> sent ABSL_GUARDED_BY(mu);
  };
  std::map<std::string, Client> clients;
  for (const auto& id : ids) clients[id];
  std::set<float> all_tags;
  absl::Mutex tags_mu;
  std::atomic<int> next_tag{1};
  {
    Rig rig;
    rig.learner->EnableCheckpoints(
        dir, [&rig](v1::CheckpointManifest* m) { rig.sessions->Save(m->mutable_ingest()); });
    rig.learner->Start();
    std::atomic<int> connections_done{0};
    auto connection = [&](std::mt19937& rng) {
      const std::string id = ids[rng() % ids.size()];
      const bool step = id == "r0" || id == "r1";
      Client& client = clients[id];
      auto superseded = std::make_shared<std::atomic<bool>>(false);
      auto s = rig.sessions->Attach(id, [superseded] { *superseded = true; });
      const int batches = 1 + rng() % 6;
      for (int b = 0; b < batches && !*superseded; ++b) {
        absl::Notification done;
        absl::MutexLock lock(&client.mu);
        IncomingBatch batch;
        if (client.next > 0 && rng() % 4 == 0) {
          batch = client.sent[1 + rng() % client.next];
        } else {
          std::vector<float> tags;
          std::vector<StepIn> steps;
          for (int i = 0, n = 1 + static_cast<int>(rng() % 4); i < n; ++i) {
            const float tag = static_cast<float>(next_tag++);
            tags.push_back(tag);
            steps.push_back({static_cast<uint32_t>(rng() % 3), tag, 1, rng() % 5 == 0});
            absl::MutexLock t(&tags_mu);
            all_tags.insert(tag);
          }
          const uint64_t seq = ++client.next;
          batch = step ? Step(seq, id, steps) : NStep(seq, id, tags);
          client.sent[seq] = batch;
        }
        rig.sessions->Submit(s, batch, [&](IngestOutcome o) {
          EXPECT_TRUE(o.status.ok()) << o.status;
          done.Notify();
        });
        done.WaitForNotification();
      }
      DetachAndWait(rig.sessions.get(), s, /*clean=*/rng() % 2 == 0);
      ++connections_done;
    };
    std::vector<std::thread> threads;
    for (int t = 0; t < 6; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(seed * 7919 + t);
        for (int c = 0; c < 40; ++c) connection(rng);
      });
    }
    // The checkpoint lands somewhere in the middle of the traffic.
    std::mt19937 pick(seed);
    const int at = 20 + static_cast<int>(pick() % 160);
    while (connections_done < at) std::this_thread::yield();
    absl::Notification written;
    rig.learner->RequestCheckpoint("cut", [&](const absl::StatusOr<CheckpointWriteResult>& r) {
      EXPECT_TRUE(r.ok()) << r.status();
      written.Notify();
    });
    written.WaitForNotification();
    for (auto& t : threads) t.join();
  }  // the crash: this learner and its sessions are gone

  auto data = ReadCheckpoint(dir + "/cut");
  ASSERT_TRUE(data.ok()) << data.status();
  Rig rig;
  ASSERT_TRUE(rig.learner->Restore(*data).ok());
  ASSERT_TRUE(rig.sessions->Restore(data->manifest.ingest()).ok());
  rig.learner->Start();
  int duplicates = 0;
  for (const auto& id : ids) {
    Client& client = clients[id];
    auto s = rig.sessions->Attach(id, [] {});
    absl::MutexLock lock(&client.mu);
    for (const auto& [seq, batch] : client.sent)
      duplicates += SubmitAndWait(rig.sessions.get(), s, batch).duplicate;
    DetachAndWait(rig.sessions.get(), s, /*clean=*/true);
  }
  rig.learner->Stop();
  std::multiset<float> inserted;
  for (int64_t i = 0; i < data->state.replay.size; ++i) inserted.insert(data->state.replay.rows.obs[i]);
  for (const Row& r : rig.log->Rows()) inserted.insert(r.obs);
  for (float t : inserted)
    EXPECT_EQ(inserted.count(t), 1u) << "tag " << t << " inserted twice (seed " << seed << ")";
  EXPECT_EQ(std::set<float>(inserted.begin(), inserted.end()), all_tags) << "seed " << seed;
  EXPECT_EQ(inserted.size(), all_tags.size()) << "seed " << seed;
  EXPECT_GT(duplicates, 0) << "seed " << seed;
  std::filesystem::remove_all(dir);
}

TEST(IngestSessionsPropertyTest, AfterACheckpointCrashAndFullResendEveryTransitionIsInOnce) {
  for (uint32_t seed : {1u, 2u, 3u, 4u}) RunRestartProperty(seed);
}

}  // namespace
}  // namespace qstream
