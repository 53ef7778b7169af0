// Checkpointer: writes checkpoints (trainer/checkpoint.h) on its own thread,
// so the learner only pays for the snapshot (device -> host copy) and never
// for the disk. One write at a time; after each successful write the
// automatic checkpoints beyond `keep` are pruned.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "trainer/checkpoint.h"

namespace qstream {

struct CheckpointerStats {
  int64_t written = 0;
  int64_t last_step = -1;           // learner step of the newest checkpoint written
  int64_t last_unix_seconds = 0;    // when it was completed
  double last_write_seconds = 0;    // background write of the newest one
  double last_snapshot_seconds = 0; // learner-thread snapshot of the newest one
  uint64_t last_bytes = 0;
  std::map<std::string, int64_t> failures;  // by reason: "snapshot", "write", "prune"
  std::string last_error;
};

class Checkpointer {
 public:
  using Done = std::function<void(const absl::StatusOr<CheckpointWriteResult>&)>;

  Checkpointer(std::string root, int keep);
  ~Checkpointer();  // finishes a queued write, joins

  const std::string& root() const { return root_; }
  // A write is queued or running.
  bool busy() const ABSL_LOCKS_EXCLUDED(mu_);
  // Queues one write (the data is moved in); `done` runs on the writer
  // thread after it, outside every lock. Precondition: !busy().
  void Write(std::string name, CheckpointData data, double snapshot_seconds, Done done) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until no write is queued or running.
  void WaitIdle() ABSL_LOCKS_EXCLUDED(mu_);
  // A snapshot that could not be taken (counted under "snapshot").
  void RecordSnapshotFailure(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  CheckpointerStats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Job {
    std::string name;
    CheckpointData data;
    double snapshot_seconds = 0;
    Done done;
  };
  void Run();

  const std::string root_;
  const int keep_;
  mutable absl::Mutex mu_;
  std::optional<Job> job_ ABSL_GUARDED_BY(mu_);
  bool running_job_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  CheckpointerStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace qstream
