// Writer: buffers environment steps into the columns of a TransitionBatch and
// sends them on an ExperienceStream. Batches are KIND_STEP with one env_id per
// environment, so the daemon assembles n-step returns per environment (and
// flushes a window at an episode end). A batch sent by size or time is in
// the step-stream form (unless options.step_stream is false): a step's next state is its env's next obs,
// which the daemon takes from that env's next row, so only the rows that end an episode send theirs
// (final_obs), half the bytes. The batch Flush or Close sends carries next_obs for every row (the full form),
// so the newest step of each env in it is complete when the stream closes (an env whose newest step went out
// earlier by size or time has it dropped at the close: it waits for a next obs that never comes).
//
// A batch goes out when it holds flush_transitions transitions, when its
// oldest transition has waited flush_after (checked on Append and by the
// writer's own sender thread), and on Flush/Close. Two preallocated column
// buffers take turns: the caller fills one while the sender thread turns the
// other into a message (one copy per column) and hands it to the stream,
// which numbers it, keeps at most max_in_flight batches unacknowledged and
// resends after a reconnect. So at most max_in_flight + 2 batches are
// buffered; once they are, Append waits (block = true) or returns
// ResourceExhausted and appends nothing (block = false).
//
// Finished episodes are reported with ReportEpisode: a report rides on the
// next batch that goes out (TransitionBatch.episodes, labelled with
// options.env), and Flush/Close send the reports alone (a batch of count 0)
// when no transition is left to carry them. The daemon counts each once.
//
// Thread-safe; transitions go out in the order they were appended. The
// stream must outlive the writer; the writer is its only sender, so the
// acknowledged counts it reports are its own.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "clients/cpp/experience_stream.h"

namespace qstream::actor {

struct WriterOptions {
  // Floats per observation (required).
  int obs_dim = 0;
  // Actions per transition, one per branch.
  int num_branches = 1;
  // Environments of this writer: env ids 0 .. num_envs - 1, all of them in
  // every AppendStep.
  int num_envs = 1;
  // A batch goes out once it holds this many transitions (at most the
  // daemon's server.max_batch_transitions, and at least num_envs).
  int flush_transitions = 512;
  // ... or once its oldest transition has waited this long.
  absl::Duration flush_after = absl::Milliseconds(20);
  // Batches sent by size or time in the step-stream form (next_obs only of
  // the rows that end an episode, as final_obs: half the bytes); false: every
  // batch in the full form (next_obs for every row).
  bool step_stream = true;
  // When every buffer is taken: true, Append waits for the daemon; false,
  // Append returns ResourceExhausted without appending.
  bool block = true;
  // The environment's name, the env label of the daemon's episode metrics
  // (TransitionBatch.env): up to wire::kMaxEnvBytes of [A-Za-z0-9_.:/-];
  // empty: "unnamed".
  std::string env;
};

// One step of every environment of the writer; row i belongs to env i.
struct VectorStep {
  std::span<const float> obs;           // num_envs x obs_dim
  std::span<const int32_t> actions;     // num_envs x num_branches
  std::span<const float> rewards;       // num_envs
  std::span<const uint8_t> terminated;  // num_envs, 0 or 1
  std::span<const uint8_t> truncated;   // num_envs, 0 or 1; empty: none
  // num_envs x obs_dim: the state each step reached, before any reset. For a
  // step that does not end its episode it must be the env's next obs (the
  // step-stream form sends only the final obs of the steps that end).
  std::span<const float> next_obs;
};

class Writer {
 public:
  static absl::StatusOr<std::unique_ptr<Writer>> Create(ExperienceStream& stream,
                                                        const WriterOptions& options);
  // Stops the sender thread (after the batch it is sending, if any); what
  // was not flushed is dropped: call Close() to send it.
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // One step of environment `env_id`: obs and next_obs of obs_dim floats,
  // num_branches actions. A step both terminated and truncated counts as
  // terminated (no bootstrap). Fails with the first error of the stream.
  absl::Status Append(int env_id, std::span<const float> obs, std::span<const int32_t> actions, float reward,
                      bool terminated, bool truncated, std::span<const float> next_obs);
  // One step of all num_envs environments.
  absl::Status AppendStep(const VectorStep& step);
  // Policy version the following steps are acted with; a batch carries the
  // oldest of its steps.
  void set_policy_version(int64_t version);
  // A finished episode: its undiscounted return, its length in env steps and
  // the policy version its last step was acted with (default: the one set
  // by set_policy_version). Call it after the Append of the episode's last
  // step; the report goes with the next batch. InvalidArgument naming the
  // argument for a return that is not finite or beyond
  // wire::kMaxAbsEpisodeReturn, a length outside [1,
  // wire::kMaxEpisodeLength] or a negative version; once
  // wire::kMaxEpisodesPerBatch reports wait, the buffer goes out first
  // (waiting, or ResourceExhausted with block = false).
  absl::Status ReportEpisode(double episode_return, int64_t length,
                             std::optional<int64_t> policy_version = std::nullopt);

  // Sends what is buffered (rows and episode reports; reports alone in a
  // batch of count 0), waits until every batch is acknowledged, and
  // returns the transitions the daemon accepted since the writer was created
  // (sum of Ack.accepted, as the Python Writer's flush(): with n-step, the
  // steps still in an env's window count once they leave it).
  absl::StatusOr<int64_t> Flush();
  // Flush, then stops the sender; Append fails afterwards. The stream stays
  // open (its Close ends the call and the daemon's n-step windows).
  absl::StatusOr<int64_t> Close();

 private:
  struct Columns;

  Writer(ExperienceStream& stream, const WriterOptions& options);
  absl::Status AppendRows(const VectorStep& rows, int count, uint32_t first_env) ABSL_LOCKS_EXCLUDED(mu_);
  // Queues the filling buffer for the sender and fills the spare next.
  void HandOverLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool DueLocked(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendLoop() ABSL_LOCKS_EXCLUDED(mu_);

  const WriterOptions options_;
  ExperienceStream& stream_;

  mutable absl::Mutex mu_;
  // The buffer Append fills; never null.
  std::unique_ptr<Columns> filling_ ABSL_GUARDED_BY(mu_);
  // The other buffer is in exactly one place: free (spare_), queued for the
  // sender (ready_), or held by the sender thread while it sends.
  std::unique_ptr<Columns> spare_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Columns> ready_ ABSL_GUARDED_BY(mu_);
  const int64_t accepted_at_start_;  // the stream's accepted total when the writer was created
  int64_t policy_version_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sender_;
};

}  // namespace qstream::actor
