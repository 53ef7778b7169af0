// CommittedWindows: an ingest session's committed n-step windows (what a
// checkpoint saves, what the session restarts from after a failed insert),
// kept lazily. A KIND_STEP batch whose insert succeeded joins a log instead
// of being replayed into the windows at once; NStepAssembler::Fold brings
// the windows up to date when the log holds kFoldRowsPerWindow x n_step rows
// per window, or when they are read (checkpoint, rollback, expiry, a private
// session's end). The session's issued windows hold every step already, so
// the committed set is only read at those moments; folding many batches at
// once copies only the last n steps of each env instead of every step.
//
// Memory: a batch in the log stays counted in server.max_queued_bytes (the
// bytes the session counted for it: its own and the windows it may open)
// until it is folded; a window at NStepAssembler::window_bytes. Each call
// that changes the count returns the bytes to release.
#pragma once

#include <cstdint>
#include <vector>

#include "server/nstep.h"
#include "server/validate.h"

namespace qstream {

class CommittedWindows {
 public:
  // `assembler` must outlive this object.
  explicit CommittedWindows(const NStepAssembler* assembler) : assembler_(assembler) {}

  // A batch whose insert succeeded, counted at `bytes` until it is folded.
  // Returns the bytes to release (a fold may run).
  int64_t Commit(IncomingBatch batch, int64_t bytes);
  // The windows were flushed into the replay: empties them and the log.
  // Returns the bytes to release (all of them).
  int64_t Clear();
  // Folds the log into the windows. Returns the bytes to release.
  int64_t Fold();
  // The windows as of the last Fold (Fold first to read the committed state).
  const NStepWindows& windows() const { return windows_; }
  // Replaces everything with `windows` (a restore); the log is dropped.
  void Reset(NStepWindows windows);

  // What server.max_queued_bytes counts for it now.
  int64_t counted_bytes() const;

  // Rows per window the log holds before it is folded, in units of n_step:
  // the fold copies at most n steps per window, so at 4 it copies at most a
  // quarter of the rows (a replay at delivery copied every row), while the
  // log holds at most 4 x n_step x max_envs_per_stream rows beyond one batch.
  static constexpr int64_t kFoldRowsPerWindow = 4;

 private:
  const NStepAssembler* const assembler_;
  NStepWindows windows_;
  std::vector<IncomingBatch> log_;  // committed after windows_, in order
  int64_t log_rows_ = 0;
  int64_t log_bytes_ = 0;
};

}  // namespace qstream
