// Learner: owns a Backend and the thread that trains it continuously.
//
// Ingest hands validated batches to Enqueue(); the learner thread moves them
// into the replay between steps (on the CUDA backend the uploads are ordered
// against the graph replays on one stream) as the RateLimiter allows, then
// runs the batch's callback. Callers that wait for the callback before
// reading more data get backpressure without dropping anything.
// Every publish_every steps the online parameters are published as a
// PolicySnapshot (version = 1, 2, ...; version 0 is the initial weights).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
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
  int64_t steps = 0;
  int64_t replay_size = 0;
  int64_t replay_capacity = 0;
  int64_t transitions_inserted = 0;
  int64_t batches_inserted = 0;
  int64_t pending_batches = 0;
  int64_t rate_limiter_inserts = 0;
  int64_t rate_limiter_samples = 0;
  bool sample_blocked = false;  // learner is waiting for data
  bool insert_blocked = false;  // pending batches wait for the learner
  bool paused = false;
  bool running = false;
  StepStats last_stats;
  std::vector<int64_t> guard_trips;  // index = GuardReason
  int64_t policy_version = 0;
  // Last failed backend step ("" when none); a failed step pauses the learner.
  std::string last_error;
};

class Learner {
 public:
  using InsertDone = std::function<void(absl::Status status, int64_t replay_size)>;
  using PolicyListener = std::function<void(std::shared_ptr<const PolicySnapshot>)>;

  static absl::StatusOr<std::unique_ptr<Learner>> Create(const v1::TrainerConfig& config,
                                                         std::unique_ptr<Backend> backend);
  ~Learner();  // Stop()s and joins

  void Start();
  // Stops the thread; pending batches are inserted first (nothing accepted is
  // lost), then their callbacks run. Idempotent.
  void Stop();

  // Queues a batch; `done` runs once it is in the replay (OK) or when the
  // learner is stopped before it could be (Cancelled). Runs on the learner
  // thread or inside Enqueue/Stop; it must not block or call back into Learner.
  void Enqueue(TransitionColumns batch, InsertDone done);

  // Pause returns once no step is in flight; not to be called from a listener.
  void Pause();
  void Resume();

  LearnerStatus status() const;
  // True while the rate limiter holds inserts back (ingest should throttle).
  bool throttled() const;

  std::shared_ptr<const PolicySnapshot> policy() const;
  // Listener runs on the learner thread for every new snapshot; returns an id.
  int64_t AddPolicyListener(PolicyListener listener);
  void RemovePolicyListener(int64_t id);

  // Step-time windows since the last call (see Backend::DrainStepTimes).
  std::vector<std::pair<double, int64_t>> DrainStepTimes();

  // Online Q-values of the latest snapshot (CPU forward; thread-safe).
  absl::Status ComputeQ(const float* obs, int64_t n, std::vector<float>* q) const;

  // Writes the latest snapshot as a binary qstream.v1.Policy to `path`.
  absl::Status Checkpoint(const std::string& path);

  const v1::TrainerConfig& config() const { return config_; }

 private:
  Learner(const v1::TrainerConfig& config, std::unique_ptr<Backend> backend);
  struct Pending;
  void Run();
  void Publish() ABSL_LOCKS_EXCLUDED(mu_);
  // Moves batches into the backend and runs their callbacks (caller owns the backend).
  void InsertBatches(std::deque<Pending>* batches) ABSL_LOCKS_EXCLUDED(mu_);
  // Copies the backend's statistics and step-time windows into
  // status_/step_times_, unless already done at this step count.
  void RefreshStats(int64_t steps) ABSL_LOCKS_EXCLUDED(mu_);

  const v1::TrainerConfig config_;
  std::unique_ptr<Backend> backend_;  // touched only by the learner thread once started
  RateLimiter limiter_;

  mutable absl::Mutex mu_;
  struct Pending {
    TransitionColumns batch;
    InsertDone done;
  };
  int64_t refreshed_at_step_ = -1;  // learner thread only
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  bool stepping_ ABSL_GUARDED_BY(mu_) = false;  // the thread is inserting or stepping
  LearnerStatus status_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const PolicySnapshot> policy_ ABSL_GUARDED_BY(mu_);
  // Held while listeners run, so RemovePolicyListener returns only once its
  // listener is no longer running (listeners may call policy()/status()).
  absl::Mutex listener_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::map<int64_t, PolicyListener> listeners_ ABSL_GUARDED_BY(listener_mu_);
  int64_t next_listener_id_ ABSL_GUARDED_BY(listener_mu_) = 1;
  std::vector<std::pair<double, int64_t>> step_times_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace qstream
