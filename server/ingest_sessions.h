// IngestSessions: the owner of ingest state below the RPC layer. One session
// per stream_id holds what the daemon has committed for that client: the last
// committed sequence and the per-env n-step windows (KIND_STEP). A stream
// reactor only translates wire messages into calls here; the session decides
// what is new, a duplicate or must wait, builds the replay columns, hands
// them to the Learner and commits the sequence and the windows in the
// insert's callback (the learner runs every such callback of the batches in
// the replay before it takes a checkpoint snapshot, so a snapshot is a
// consistent cut of replay + sessions). The committed windows are kept
// lazily (CommittedWindows: a log of committed batches, folded in when it
// grows or the windows are read), since only a checkpoint, a rollback after
// a failed insert or the end of a session reads them.
//
// The contract it implements is written in proto/qstream/v1/experience.proto.
// Per session, batches are processed in arrival order and pipelined: each is
// assembled against the state the session will have once the batches before
// it committed (the "issued" state) and goes to the learner without waiting
// for them; commits and `done` callbacks run strictly in submission order. A
// resend of a sequence still in flight waits for that outcome (duplicate if
// it committed, processed afresh if it failed). The learner inserts in
// Enqueue order and fails an insert only when it stops (and then every later
// one), so the issued state never gets ahead of what ends up committed.
//
// Sessions are bounded (server.max_sessions) and expire by age: a session
// whose stream broke off keeps its windows for server.stream_resume_seconds,
// then they are flushed into the replay as shorter-horizon transitions; its
// sequence record is forgotten after server.session_ttl_seconds, or earlier
// (longest-detached first) when more than max_sessions exist.
//
// Memory is bounded: each session holds at most server.max_envs_per_stream
// windows, and server.max_queued_bytes caps the bytes of batches submitted
// but not yet in the replay plus the windows of every session (with the
// batches committed but not yet folded into them); a batch that
// finds the budget full fails with RESOURCE_EXHAUSTED (nothing of it is
// inserted, its sequence is not committed) and the stream ends so that the
// client resends it after a backoff.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "qstream/v1/checkpoint.pb.h"
#include "qstream/v1/config.pb.h"
#include "qstream/v1/experience.pb.h"
#include "server/episode_reports.h"
#include "server/ingest_counters.h"
#include "server/nstep.h"
#include "server/validate.h"
#include "trainer/learner.h"
#include "trainer/network_spec.h"

namespace qstream {

// A stream's handle on its session (the token Attach returns).
class IngestSession;
// One session's committed state and its queue of work (ingest_sessions.cc).
struct IngestRecord;

// The outcome of one submitted batch, as the ack will carry it.
struct IngestOutcome {
  // Not OK: the batch could not be inserted (learner stopped, backend
  // failure, server.max_queued_bytes full: RESOURCE_EXHAUSTED); nothing of
  // it is in the replay and its sequence is not committed. The stream should
  // end with this status.
  absl::Status status;
  // Set when the batch was rejected by the session (e.g. too many env ids);
  // nothing of it was inserted. The stream carries on.
  std::optional<BatchError> error;
  int64_t accepted = 0;     // transitions written to the replay for this batch
  bool duplicate = false;   // sequence already committed; nothing inserted
  // A duplicate's first insert, when the session remembers it (Ack.accepted_before).
  int64_t accepted_before = 0;
  int64_t replay_size = 0;  // after the insert (or the latest known)
  // The batch's episode reports, only when the batch committed as new (status
  // OK, no error, not a duplicate): what the episode metrics count, so a
  // resend is never counted twice.
  EpisodeReports episodes;
};

class IngestSessions {
 public:
  using Done = std::function<void(IngestOutcome)>;

  // `learner` and `counters` must outlive this object.
  IngestSessions(Learner* learner, const NetworkSpec& spec, const v1::TrainerConfig& config,
                 IngestCounters* counters);
  ~IngestSessions();  // Stop()s

  // The expiry thread (checks about once a second).
  void Start() ABSL_LOCKS_EXCLUDED(mu_);
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // A stream attaches to the session of `stream_id` ("" gives a private
  // session that nobody else can attach to). When another stream holds it,
  // that stream's `on_superseded` runs (outside every lock, on this thread)
  // and it must end with ABORTED; the new holder's batches queue behind the
  // old holder's batch in flight. The returned handle is the stream's token.
  std::shared_ptr<IngestSession> Attach(const std::string& stream_id, std::function<void()> on_superseded)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Submits a validated batch (ValidateBatch's columns). `done` runs exactly
  // once, in submission order among the session's batches: inline when
  // nothing is in flight before it (a duplicate, a session-level rejection),
  // else on a learner callback thread once the batch is committed (or
  // failed). `done` must not block. A stream may submit its next batches
  // before `done` ran (pipelining).
  void Submit(const std::shared_ptr<IngestSession>& session, IncomingBatch batch, Done done)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Submit in two halves, for a stream that starts its next read in between
  // (so that the next message is decoded and validated on another thread
  // while this one is assembled and inserted): Queue fixes the batch's place
  // in the session's order (and may run `done` inline, as Submit does);
  // Pump issues whatever is queued, or returns at once while another thread
  // pumps the session (that thread then issues it).
  void Queue(const std::shared_ptr<IngestSession>& session, IncomingBatch batch, Done done)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Pump(const std::shared_ptr<IngestSession>& session) ABSL_LOCKS_EXCLUDED(mu_);

  // The stream ends. clean (a half-close): the session's windows are flushed
  // into the replay and `flushed` runs once they are committed (or failed);
  // otherwise the session stays for a reconnect (private sessions flush at
  // once) and `flushed` runs at once. No-op for a stream that was superseded
  // (its successor owns the session); `flushed` still runs.
  void Detach(const std::shared_ptr<IngestSession>& session, bool clean, Done flushed)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Committed state of every session (learner thread, from the checkpoint
  // snapshot hook; consistent with the replay at that moment). Brings each
  // session's lazily kept committed windows up to date first.
  void Save(v1::IngestState* out) ABSL_LOCKS_EXCLUDED(mu_);
  // Before serving: replaces every session with `state` (all detached, their
  // resume clock starting now). Private sessions ("") are flushed into the
  // replay. InvalidArgument naming the session when a window does not fit
  // the network.
  absl::Status Restore(const v1::IngestState& state) ABSL_LOCKS_EXCLUDED(mu_);

  // One expiry pass at `now` (the thread calls it; tests call it directly).
  void Expire(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

  int64_t num_sessions() const ABSL_LOCKS_EXCLUDED(mu_);
  // Transitions waiting in the committed n-step windows over all sessions
  // (brings them up to date, as Save does).
  int64_t pending_transitions() ABSL_LOCKS_EXCLUDED(mu_);
  // What server.max_queued_bytes counts now: submitted batches not yet
  // finished plus every session's windows.
  int64_t queued_bytes() const { return queued_bytes_.load(std::memory_order_relaxed); }
  // Ack.throttle: queued_bytes() has reached half of server.max_queued_bytes.
  // Past the whole of it batches are refused (RESOURCE_EXHAUSTED), so this is
  // the early word to the actors to keep fewer batches in flight. Lock-free.
  bool pressured() const { return 2 * queued_bytes() >= config_.server().max_queued_bytes(); }

  // How many of its newest committed batches a session remembers with their
  // accepted counts: a duplicate of one is acknowledged with its count
  // (Ack.accepted_before).
  static constexpr size_t kRecentBatches = 64;

 private:
  friend struct IngestRecord;
  struct Work;
  struct Ticket;

  // Issued but undelivered work items per session: the pipeline's depth
  // (the reactor's server.max_in_flight_per_stream bounds a stream's share;
  // this bounds a session taken over while its old stream's items run).
  static constexpr size_t kMaxTicketsPerSession = 1024;

  // Queues `work` on the record and pumps it (unless `pump` is false).
  void Post(const std::shared_ptr<IngestRecord>& r, Work work, bool pump = true) ABSL_LOCKS_EXCLUDED(mu_);
  // Issues queued work items of `r` while they may go (one thread at a time).
  void Pump(const std::shared_ptr<IngestRecord>& r) ABSL_LOCKS_EXCLUDED(mu_);
  // Assembles one work item against the record's issued state and hands its
  // columns to the learner, or completes it at once (duplicate, rejection,
  // nothing to insert).
  void Issue(const std::shared_ptr<IngestRecord>& r, Work& work) ABSL_LOCKS_EXCLUDED(mu_);
  // Commits and runs the `done` of every completed ticket at the front, in
  // issue order (one thread at a time).
  void Deliver(const std::shared_ptr<IngestRecord>& r) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops a private session once its stream is gone and its windows are in
  // the replay.
  void MaybeForgetPrivate(const std::shared_ptr<IngestRecord>& r) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the longest-detached sessions beyond max_sessions; their windows
  // are to be flushed by the caller.
  void EvictLocked(std::vector<std::shared_ptr<IngestRecord>>* evicted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpiryLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // Adds `bytes` to queued_bytes_ while it is below server.max_queued_bytes.
  bool TryReserve(int64_t bytes);
  void Release(int64_t bytes);
  absl::Status QueueFull(int64_t bytes) const;

  // Every pending insert callback captures `this`: the learner must be
  // stopped (its callbacks run) before this object is destroyed.
  Learner* const learner_;
  const NetworkSpec spec_;
  const v1::TrainerConfig config_;
  IngestCounters* const counters_;
  const NStepAssembler assembler_;  // stateless; windows live in the records
  // Latest replay size reported by an insert (for acks that insert nothing).
  std::atomic<int64_t> replay_size_{0};
  // Bytes of batches between Submit and their outcome, plus window_bytes per
  // committed window and per window a batch in the learner may open, plus
  // the committed batches not yet folded into the committed windows.
  std::atomic<int64_t> queued_bytes_{0};

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<IngestRecord>> sessions_ ABSL_GUARDED_BY(mu_);
  // Sessions of streams without a stream_id, by handle id.
  absl::flat_hash_map<uint64_t, std::shared_ptr<IngestRecord>> private_ ABSL_GUARDED_BY(mu_);
  uint64_t next_handle_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread expiry_thread_;  // Start/Stop run on one thread
};

}  // namespace qstream
