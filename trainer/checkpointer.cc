#include "trainer/checkpointer.h"

#include <cstdio>
#include <utility>

#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace qstream {

Checkpointer::Checkpointer(std::string root, int keep)
    : root_(std::move(root)), keep_(keep), thread_([this] { Run(); }) {}

Checkpointer::~Checkpointer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

bool Checkpointer::busy() const {
  absl::MutexLock lock(&mu_);
  return job_.has_value() || running_job_;
}

void Checkpointer::Write(std::string name, CheckpointData data, double snapshot_seconds, Done done) {
  absl::MutexLock lock(&mu_);
  job_ = Job{std::move(name), std::move(data), snapshot_seconds, std::move(done)};
}

void Checkpointer::WaitIdle() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](Checkpointer* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) { return !c->job_.has_value() && !c->running_job_; },
      this));
}

void Checkpointer::RecordSnapshotFailure(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  ++stats_.failures["snapshot"];
  stats_.last_error = status.ToString();
}

CheckpointerStats Checkpointer::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void Checkpointer::Run() {
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Checkpointer* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) { return c->stop_ || c->job_.has_value(); },
          this));
      if (!job_.has_value()) return;  // stopping with nothing queued
      job = std::move(*job_);
      job_.reset();
      running_job_ = true;
    }
    const int64_t step = job.data.manifest.learner_step();
    absl::StatusOr<CheckpointWriteResult> result = WriteCheckpoint(root_, job.name, job.data);
    job.data = CheckpointData{};  // the snapshot can be large: free it before pruning
    absl::Status pruned = absl::OkStatus();
    if (result.ok()) pruned = PruneCheckpoints(root_, keep_);
    if (result.ok()) {
      spdlog::info("checkpoint {} written: step {}, {:.1f} MB in {:.2f} s (snapshot {:.3f} s)", result->name,
                   step, static_cast<double>(result->bytes) / 1e6, result->seconds, job.snapshot_seconds);
    } else {
      spdlog::error("checkpoint {} failed: {}", job.name, result.status().ToString());
    }
    if (!pruned.ok()) spdlog::error("pruning checkpoints: {}", pruned.ToString());
    {
      absl::MutexLock lock(&mu_);
      if (result.ok()) {
        ++stats_.written;
        stats_.last_step = step;
        stats_.last_unix_seconds = absl::ToUnixSeconds(absl::Now());
        stats_.last_write_seconds = result->seconds;
        stats_.last_snapshot_seconds = job.snapshot_seconds;
        stats_.last_bytes = result->bytes;
      } else {
        ++stats_.failures["write"];
        stats_.last_error = result.status().ToString();
      }
      if (!pruned.ok()) {
        ++stats_.failures["prune"];
        stats_.last_error = pruned.ToString();
      }
    }
    if (job.done) job.done(result);
    absl::MutexLock lock(&mu_);
    running_job_ = false;
  }
}

}  // namespace qstream
