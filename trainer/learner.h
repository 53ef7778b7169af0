// Learner: owns a Backend and the thread that trains it continuously.
//
// Ingest hands validated batches to Enqueue(); the learner thread moves them
// into the replay between steps (on the CUDA backend the uploads are ordered
// against the graph replays on one stream) as the RateLimiter allows, then
// runs the batch's callback. Callers that wait for the callback before
// reading more data get backpressure without dropping anything.
// Every publish_every steps the online parameters are published as a
// PolicySnapshot (version = 1, 2, ...; version 0 is the initial weights; a
// restore publishes the checkpoint's version + 1).
//
// Checkpoints (EnableCheckpoints): every checkpoint.every_steps steps and/or
// every_seconds, on RequestCheckpoint, and once more after Stop
// (WriteFinalCheckpoint). The snapshot is taken on the learner thread
// between steps and inserts (Backend::SaveState plus the snapshot hook), so
// replay and ingest sessions are one consistent cut; a background
// Checkpointer writes it.
//
// Guard: after guard.max_consecutive_trips tripped steps in a row the
// learner rolls back to the network of the newest checkpoint written before
// the trips began, or halts (guard.on_repeated_trips; see config.proto).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "qstream/v1/config.pb.h"
#include "trainer/backend.h"
#include "trainer/callback_runner.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpointer.h"
#include "trainer/rate_limiter.h"
#include "trainer/transitions.h"

namespace qstream {

struct PolicySnapshot {
  int64_t version = 0;
  int64_t learner_steps = 0;
  NetworkSpec spec;
  std::vector<float> params;
};

struct LearnerStatus {
  std::string backend;
  std::string device;
  DeviceMemory device_memory;
  int64_t steps = 0;
  int64_t replay_size = 0;
  int64_t replay_capacity = 0;
  int64_t transitions_inserted = 0;
  int64_t batches_inserted = 0;
  int64_t pending_batches = 0;
  // Insert rounds of the learner thread so far, the seconds they took in
  // all (staging waits included), and the current row budget of a round
  // that a step follows (README "Limits": inserts and steps interleave).
  int64_t insert_rounds = 0;
  double insert_round_seconds = 0;
  int64_t insert_round_budget = 0;
  int64_t rate_limiter_inserts = 0;
  int64_t rate_limiter_samples = 0;
  bool sample_blocked = false;  // learner is waiting for data
  bool insert_blocked = false;  // pending batches wait for the learner
  bool paused = false;
  // The learner pauses once it has taken this many steps (PauseAtStep; 0: none).
  int64_t pause_at_step = 0;
  bool running = false;
  StepStats last_stats;
  std::vector<int64_t> guard_trips;  // index = GuardReason
  int64_t policy_version = 0;
  // Last failed backend step ("" when none); a failed step pauses the learner.
  std::string last_error;
  // Halted by the guard (no steps until Resume); why.
  bool halted = false;
  std::string halt_reason;
  int64_t guard_rollbacks = 0;
  bool checkpoints_enabled = false;
  CheckpointerStats checkpoints;
};

class Learner {
 public:
  using InsertDone = std::function<void(absl::Status status, int64_t replay_size)>;
  using PolicyListener = std::function<void(std::shared_ptr<const PolicySnapshot>)>;
  using SnapshotHook = std::function<void(v1::CheckpointManifest*)>;
  using CheckpointDone = std::function<void(const absl::StatusOr<CheckpointWriteResult>&)>;
  using HaltListener = std::function<void(bool halted)>;
  // The network part of the newest good checkpoint, for a guard rollback.
  struct GoodNetwork {
    int64_t step = -1;
    BackendState state;  // no replay
  };

  static absl::StatusOr<std::unique_ptr<Learner>> Create(const v1::TrainerConfig& config,
                                                         std::unique_ptr<Backend> backend);
  ~Learner();  // Stop()s and joins

  void Start();
  // Stops the thread; pending batches are inserted first (nothing accepted is
  // lost), then their callbacks run; a checkpoint being written is finished.
  // Idempotent.
  void Stop();

  // Before Start: checkpoints under `root` as config.checkpoint says. `hook`
  // adds the state kept above the learner (ingest sessions) to every
  // snapshot; it runs on the learner thread, never between an insert and
  // that batch's callback.
  void EnableCheckpoints(const std::string& root, SnapshotHook hook);
  // Before Start: continue from `data` (the backend state, counters, policy
  // version + 1, rate limiter). FailedPrecondition when the network shape
  // differs from this learner's config; other differing fields are logged.
  absl::Status Restore(const CheckpointData& data);
  // Queues a checkpoint named `name` ("" = ckpt-<step>, pruned by
  // checkpoint.keep; named ones are kept); `done` runs on the writer thread
  // once it is on disk or failed. Works while paused. FailedPrecondition
  // (via done) when checkpoints are not enabled or the learner stopped.
  void RequestCheckpoint(const std::string& name, CheckpointDone done);
  // After Stop(): writes the final state (on the calling thread, waits),
  // unless the newest checkpoint already holds it. OK without checkpoints.
  absl::Status WriteFinalCheckpoint();
  // Runs (on the thread that changes it) when the guard halts the learner
  // or Resume clears the halt.
  void SetHaltListener(HaltListener listener);

  // Queues a batch; `done` runs once it is in the replay (OK) or when the
  // learner is stopped before it could be (Cancelled). It runs on one of the
  // learner's callback threads (the learner thread hands over the callbacks
  // of every batch of an insert round at once and goes on stepping), or
  // inside Enqueue once stopped; always outside the learner's locks, and
  // always before the next checkpoint snapshot and before Stop returns. It
  // must not block (it may Enqueue again).
  void Enqueue(TransitionColumns batch, InsertDone done);

  // Pause returns once no step is in flight; not to be called from a listener.
  void Pause();
  // Runs until the learner has taken `step` steps, then pauses (at once when
  // already there). Returns without waiting. The ranks of a data-parallel
  // group pause this way, with the same step on every rank: a step all-reduces,
  // so a rank that stops at another count leaves the others waiting inside
  // the collective.
  void PauseAtStep(int64_t step);
  // Data-parallel group (config distributed): takes rank 0's network state
  // (Backend::SyncGroup) and publishes it. Every rank calls it once, after
  // any restore and before Start.
  absl::Status SyncGroup();
  // Also clears a guard halt.
  void Resume();

  LearnerStatus status() const;

  // Liveness without the learner's lock (readable while its thread is stuck
  // inside the backend): whether the thread waits for work, and how long it
  // has been in its current piece of work (an insert round, a step, a
  // checkpoint snapshot) otherwise.
  struct Progress {
    bool waiting = true;
    double busy_seconds = 0;
    // A backend step failed and paused the learner (until Resume).
    bool step_failed = false;
  };
  Progress progress() const;
  std::shared_ptr<const PolicySnapshot> policy() const;
  // Listener runs on the learner thread for every new snapshot; returns an id.
  int64_t AddPolicyListener(PolicyListener listener);
  void RemovePolicyListener(int64_t id);

  // Step-time windows since the last call (see Backend::DrainStepTimes).
  std::vector<std::pair<double, int64_t>> DrainStepTimes();

  // Online Q-values of the latest snapshot (CPU forward; thread-safe).
  absl::Status ComputeQ(const float* obs, int64_t n, std::vector<float>* q) const;

  const v1::TrainerConfig& config() const { return config_; }

 private:
  Learner(const v1::TrainerConfig& config, std::unique_ptr<Backend> backend);
  struct Pending;
  void Run();
  void Publish() ABSL_LOCKS_EXCLUDED(mu_);
  // Rows an insert round may take before a step (see Run).
  int64_t InsertRoundRows() const;
  // Adjusts insert_round_rows_ after a round that took `seconds` before a step.
  void AdaptInsertRound(double seconds, bool hit_budget);
  // Moves batches into the backend (caller owns the backend), then runs
  // their callbacks: handed to callbacks_ when a step follows (hand_off),
  // else here (no thread hop while the learner has nothing else to do).
  void InsertBatches(std::deque<Pending>* batches, bool hand_off = true) ABSL_LOCKS_EXCLUDED(mu_);
  // Copies the backend's statistics and step-time windows into
  // status_/step_times_, unless already done at this step count.
  void RefreshStats(int64_t steps) ABSL_LOCKS_EXCLUDED(mu_);
  // Snapshot of everything a checkpoint holds (learner thread, or any
  // thread once stopped).
  absl::StatusOr<CheckpointData> Snapshot() ABSL_LOCKS_EXCLUDED(mu_);
  // Takes and hands over a checkpoint when one is requested or due.
  void MaybeCheckpoint(int64_t steps) ABSL_LOCKS_EXCLUDED(mu_);
  bool CheckpointDueLocked(int64_t steps, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RestartCheckpointTimerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Acts on a run of guard trips (rollback or halt).
  void HandleRepeatedTrips(const StepStats& stats, int64_t steps) ABSL_LOCKS_EXCLUDED(mu_);
  void PublishVersion(int64_t version) ABSL_LOCKS_EXCLUDED(mu_);

  struct CheckpointRequest {
    std::string name;
    CheckpointDone done;
  };

  const v1::TrainerConfig config_;
  std::unique_ptr<Backend> backend_;  // touched only by the learner thread once started
  RateLimiter limiter_;

  mutable absl::Mutex mu_;
  struct Pending {
    TransitionColumns batch;
    InsertDone done;
  };
  int64_t refreshed_at_step_ = -1;  // learner thread only
  // Learner thread only: moving average of the period from one step's start
  // to the next (the step and the insert round between), and the rows an
  // insert round may take before a step (AdaptInsertRound).
  double period_seconds_ = 0;
  std::optional<std::chrono::steady_clock::time_point> last_step_started_;
  int64_t insert_round_rows_ = 4096;
  // LearnerStatus's insert-round fields, published by the learner thread.
  std::atomic<int64_t> insert_rounds_{0};
  std::atomic<int64_t> insert_round_nanos_{0};
  std::atomic<int64_t> insert_round_budget_{0};
  // steady_clock nanoseconds when the learner thread began its current piece
  // of work; 0 while it waits for work (or is not running).
  std::atomic<int64_t> busy_since_ns_{0};
  std::atomic<bool> step_failed_{false};
  // Runs the insert callbacks off the learner thread.
  CallbackRunner callbacks_{CallbackRunner::DefaultThreads()};
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  bool stepping_ ABSL_GUARDED_BY(mu_) = false;  // the thread is inserting or stepping
  // The learner thread waits in Run with nothing to do; Enqueue may then
  // insert on its own thread (inline_insert_ while it does, recheck_ after).
  bool parked_ ABSL_GUARDED_BY(mu_) = false;
  bool inline_insert_ ABSL_GUARDED_BY(mu_) = false;
  bool recheck_ ABSL_GUARDED_BY(mu_) = false;
  LearnerStatus status_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const PolicySnapshot> policy_ ABSL_GUARDED_BY(mu_);
  // Held while listeners run, so RemovePolicyListener returns only once its
  // listener is no longer running (listeners may call policy()/status()).
  absl::Mutex listener_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::map<int64_t, PolicyListener> listeners_ ABSL_GUARDED_BY(listener_mu_);
  int64_t next_listener_id_ ABSL_GUARDED_BY(listener_mu_) = 1;
  std::vector<std::pair<double, int64_t>> step_times_ ABSL_GUARDED_BY(mu_);

  std::unique_ptr<Checkpointer> checkpointer_;  // set before Start, then const
  // <root>/.policy_version: the highest version published, rewritten (no
  // fsync) at every publish, so a restore after kill -9 continues above every
  // version an actor may have seen, not only above the checkpoint's.
  int policy_version_fd_ = -1;
  SnapshotHook snapshot_hook_;
  std::deque<CheckpointRequest> checkpoint_requests_ ABSL_GUARDED_BY(mu_);
  bool writing_checkpoint_ ABSL_GUARDED_BY(mu_) = false;
  int64_t checkpoint_step_ ABSL_GUARDED_BY(mu_) = -1;     // step of the newest snapshot handed over
  int64_t checkpoint_inserts_ ABSL_GUARDED_BY(mu_) = -1;  // batches_inserted at that snapshot
  absl::Time next_checkpoint_time_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::shared_ptr<const GoodNetwork> good_network_ ABSL_GUARDED_BY(mu_);
  int64_t rollback_step_ ABSL_GUARDED_BY(mu_) = -1;  // step of the last rollback
  bool halted_ ABSL_GUARDED_BY(mu_) = false;
  // PauseAtStep: pause once `steps` reaches it (0: no such stop). A group
  // halts this way too, at a step every rank computes alike; then
  // pending_halt_reason_ says why.
  int64_t pause_at_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::string pending_halt_reason_ ABSL_GUARDED_BY(mu_);
  HaltListener halt_listener_;
  std::thread thread_;
};

}  // namespace qstream
