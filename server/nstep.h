// Server-side n-step assembly for KIND_STEP batches: one window of the last
// n one-step transitions per env_id of an ingest session. A transition leaves
// its window as the n-step item
//   (s_t, a_t, R = sum_{k<K} gamma^k r_{t+k}, discount = gamma^K (1 - terminal), s_{t+K})
// with K = n once n steps followed it; when the episode ends (done) every
// remaining item is flushed with discount 0; when it is cut by a time limit
// (truncated), or the session flushes its windows (clean half-close, resume
// timeout), every remaining item leaves with its shorter K and bootstraps
// from the window's last next_obs.
//
// In the step-stream form (KIND_STEP without next_obs) a step's next state is
// the obs of its env's next row: the window then waits for it ("awaiting"),
// holding up to n steps, and the row that brings it completes the oldest
// item; an episode's end brings its own (final_obs). A flush of an awaiting
// window bootstraps from the newest step's obs and drops that step (it has
// no next state).
//
// The assembler holds no windows itself: they belong to the ingest session,
// which keeps two sets: the issued windows (after every batch handed to the
// learner) and the committed ones (after every batch whose insert
// succeeded). Add advances the issued windows in place and yields the items;
// Replay advances the committed windows by the same batch, once its insert
// succeeded, without items, and Fold by many batches at once, copying only
// the steps that stay (the session's CommittedWindows folds its log of
// committed batches so). No window is copied whole (at a thousand envs per
// message, whole-window copies were most of the daemon's work). A failed
// insert leaves the committed windows as they were; the session then
// restarts its issued windows from them.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "qstream/v1/checkpoint.pb.h"
#include "qstream/v1/experience.pb.h"
#include "server/validate.h"
#include "trainer/network_spec.h"
#include "trainer/transitions.h"

namespace qstream {

// Ring of at most n steps: obs, actions and rewards per step, plus the
// next_obs of the newest step (the bootstrap state of every item in it),
// unless `awaiting` (the newest step's next state is the next row's obs).
// Two allocations per window (a window is copied per batch that touches it,
// so their number is the assembly's cost at many envs per message):
// `values` = n x obs_dim obs | n rewards | obs_dim last_next_obs.
struct NStepWindow {
  std::vector<float> values;
  std::vector<int32_t> actions;  // n x num_branches
  int head = 0;
  int size = 0;
  bool awaiting = false;
};

// A session's windows by env_id (a hash map: one lookup per row of a batch).
// Its iteration order is arbitrary: Flush and Save go by ascending env_id,
// so flushes and checkpoints are deterministic. Only windows holding steps
// are kept once committed. A reference into it is valid until the next insert.
using NStepWindows = absl::flat_hash_map<uint32_t, NStepWindow>;

class NStepAssembler {
 public:
  // `max_envs` bounds the windows of one session (memory a client can pin;
  // server.max_envs_per_stream).
  NStepAssembler(const NetworkSpec& spec, int n_step, float gamma, int64_t max_envs);

  // Appends the items a validated KIND_STEP batch completes to `out` (whose
  // obs_dim/num_branches must match the spec) and advances `windows` past it
  // (windows are opened, and dropped once empty). `opened`, when not null,
  // gets the number of windows the batch opened that `windows` did not hold
  // (what it may add to the session's memory). On error (too many env ids)
  // nothing is appended and `windows` is unchanged.
  std::optional<BatchError> Add(const IncomingBatch& batch, NStepWindows* windows, TransitionColumns* out,
                                int64_t* opened = nullptr) const;
  // Advances `windows` past a batch exactly as Add did (Add succeeded on an
  // equal set of windows), without the items. Returns how many windows
  // `windows` gained (negative: lost).
  int64_t Replay(const IncomingBatch& batch, NStepWindows* windows) const;
  // Advances `windows` past `batches` in order, to the windows that Replay
  // of each in turn leaves (the same steps, Save form), copying only the
  // steps they keep: a window holds at most the newest n steps since its
  // episode's start, so of each env only the rows after its last episode end
  // in `batches`, at most the last n, are replayed (from an empty window
  // when an end or n rows came before them). One backward pass over the
  // rows finds them. Returns how many windows `windows` gained.
  int64_t Fold(const std::vector<const IncomingBatch*>& batches, NStepWindows* windows) const;

  // Appends every item of every window as a shorter-horizon, non-terminal
  // transition (R over the steps that exist, discount gamma^K, bootstrap
  // from last_next_obs; an awaiting window's items up to its newest step,
  // bootstrapping from that step's obs, and not the newest step itself),
  // env by env, oldest first. The windows stay as they
  // are: the caller clears them once the items are inserted.
  void Flush(const NStepWindows& windows, TransitionColumns* out) const;


  // Steps waiting in `windows` for later steps.
  static int64_t Pending(const NStepWindows& windows);
  // Heap bytes one window holds (its columns, the map node, allocator
  // overhead): what server.max_queued_bytes counts per window.
  int64_t window_bytes() const;

  // Checkpoint form (NStepWindowState, oldest step first), env by env.
  void Save(const NStepWindows& windows, google::protobuf::RepeatedPtrField<v1::NStepWindowState>* out) const;
  // The inverse of Save. InvalidArgument naming the window and the field
  // when a window does not fit the network or holds n or more steps.
  absl::Status Load(const google::protobuf::RepeatedPtrField<v1::NStepWindowState>& in,
                    NStepWindows* out) const;

  int n_step() const { return n_; }

 private:
  NStepWindow EmptyWindow() const;
  // The env_ids of `windows`, ascending.
  static std::vector<uint32_t> SortedIds(const NStepWindows& windows);
  // (head + k) mod n for a slot head < n and an offset k <= n: without the
  // integer division, which ran several times per row and per item.
  int Wrap(int i) const { return i < n_ ? i : i - n_; }
  // Views into a window's `values` (layout above).
  float* obs(NStepWindow& w, int slot) const {
    return w.values.data() + static_cast<size_t>(slot) * obs_dim_;
  }
  const float* obs(const NStepWindow& w, int slot) const {
    return w.values.data() + static_cast<size_t>(slot) * obs_dim_;
  }
  float* rewards(NStepWindow& w) const { return w.values.data() + static_cast<size_t>(n_) * obs_dim_; }
  const float* rewards(const NStepWindow& w) const {
    return w.values.data() + static_cast<size_t>(n_) * obs_dim_;
  }
  float* last_next_obs(NStepWindow& w) const { return rewards(w) + n_; }
  const float* last_next_obs(const NStepWindow& w) const { return rewards(w) + n_; }
  // The window of each row of `batch` in `rows`, with one hash lookup per
  // row (a row of an env that `windows` lacks: two), opening the windows the
  // batch needs. When they would be more than `max_envs`, TOO_LARGE naming
  // the first row past it, and `windows` is unchanged. `opened`, when not
  // null, gets the number of windows opened.
  std::optional<BatchError> Resolve(const IncomingBatch& batch, NStepWindows* windows, int64_t max_envs,
                                    std::vector<NStepWindow*>* rows, int64_t* opened) const;
  // Add's and Replay's work on the windows Resolve found: items to `out`
  // when not null.
  void Advance(const IncomingBatch& batch, const std::vector<NStepWindow*>& rows, NStepWindows* windows,
               TransitionColumns* out) const;
  // Advances `w` past a row that does not end its episode, without items.
  void Keep(NStepWindow& w, const float* obs, const int32_t* actions, float reward,
            const float* next_obs) const;
  // Adds a step at the back; `next_obs` null leaves the window awaiting.
  void Push(NStepWindow& w, const float* obs, const int32_t* actions, float reward,
            const float* next_obs) const;
  // Appends the item `offset` steps after the head: its return over the
  // steps [offset, end), bootstrapping from `next`.
  void Emit(const NStepWindow& w, int offset, int end, const float* next, bool terminal,
            TransitionColumns* out) const;
  // Appends every item of `w` that has a next state (all but an awaiting
  // window's newest step).
  void EmitAll(const NStepWindow& w, bool terminal, TransitionColumns* out) const;

  const int obs_dim_;
  const int branches_;
  const std::vector<int> branch_actions_;
  const int n_;
  const double gamma_;
  const int64_t max_envs_;
};

}  // namespace qstream
