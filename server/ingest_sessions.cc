#include "server/ingest_sessions.h"

#include <algorithm>
#include <deque>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/batch_columns.h"
#include "server/committed_windows.h"
#include "trainer/callback_runner.h"

namespace qstream {

class IngestSession {
 public:
  IngestSession(std::shared_ptr<IngestRecord> record, uint64_t id, std::function<void()> on_superseded)
      : record_(std::move(record)), id_(id), on_superseded_(std::move(on_superseded)) {}

  const std::shared_ptr<IngestRecord>& record() const { return record_; }
  uint64_t id() const { return id_; }
  const std::function<void()>& on_superseded() const { return on_superseded_; }

 private:
  const std::shared_ptr<IngestRecord> record_;
  const uint64_t id_;
  const std::function<void()> on_superseded_;
};

struct IngestSessions::Work {
  enum class Type {
    kBatch,        // a submitted batch
    kFlush,        // flush every window (clean half-close, private detach, eviction)
    kExpiryFlush,  // flush every window unless a stream re-attached since `epoch`
  };
  Type type = Type::kBatch;
  // Its columns move on into the replay (KIND_NSTEP) or the assembler.
  IncomingBatch batch;
  uint64_t epoch = 0;
  // The batch's bytes reserved in queued_bytes_ by Submit, released with
  // its outcome.
  int64_t reserved_bytes = 0;
  Done done;

  static Work Of(Type type, Done done = nullptr, uint64_t epoch = 0) {
    Work w;
    w.type = type;
    w.done = std::move(done);
    w.epoch = epoch;
    return w;
  }
};

// One issued work item, from Issue until its outcome is delivered. Tickets
// are delivered (committed, then `done` run) strictly in issue order, whatever
// order the learner's callback threads finish them in.
struct IngestSessions::Ticket {
  bool completed = false;     // the outcome is known (inline, or the insert called back)
  bool inserts = false;       // went to the learner (its status decides the commit)
  bool flush = false;         // a window flush (counted as accepted with lag 0)
  uint64_t sequence = 0;      // committed with the windows; 0: nothing to commit
  // What the item does to the committed windows at delivery: a KIND_STEP
  // batch's steps join them (CommittedWindows::Commit), a flush empties them.
  std::optional<IncomingBatch> step_batch;
  bool clear_windows = false;
  // Returned to queued_bytes_ at delivery; a committed step batch's stay
  // counted until the committed windows fold it.
  int64_t release_bytes = 0;
  IngestOutcome outcome;
  Done done;
};

struct IngestRecord {
  IngestRecord(std::string id, uint64_t key, const NStepAssembler* assembler)
      : stream_id(std::move(id)), private_key(key), windows(assembler) {}

  const std::string stream_id;  // "" for a private session
  const uint64_t private_key;   // the owning handle's id for a private session, else 0

  absl::Mutex mu;
  // Committed with the insert that made them true (what a checkpoint saves).
  uint64_t last_sequence ABSL_GUARDED_BY(mu) = 0;
  CommittedWindows windows ABSL_GUARDED_BY(mu);
  // The newest committed batches' (sequence, accepted), ascending, at most
  // IngestSessions::kRecentBatches: a duplicate's accepted_before.
  std::deque<std::pair<uint64_t, uint32_t>> recent ABSL_GUARDED_BY(mu);
  // The same as they will be once every issued ticket committed: the next
  // work item is assembled against these, so a stream's batches pipeline
  // into the learner instead of waiting one learner round each.
  uint64_t issued_sequence ABSL_GUARDED_BY(mu) = 0;
  NStepWindows issued_windows ABSL_GUARDED_BY(mu);
  // An issued insert failed (the learner stopped): nothing more is issued
  // until the tickets drained, then the issued state is the committed one again.
  bool failed ABSL_GUARDED_BY(mu) = false;
  // Handle id of the attached stream (0: detached) and the handle itself.
  uint64_t holder ABSL_GUARDED_BY(mu) = 0;
  std::weak_ptr<IngestSession> holder_handle ABSL_GUARDED_BY(mu);
  uint64_t epoch ABSL_GUARDED_BY(mu) = 0;  // Attach count
  absl::Time detached_at ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
  bool expiry_flush_queued ABSL_GUARDED_BY(mu) = false;
  // One thread issues (pumping) and one delivers (delivering) at a time.
  bool pumping ABSL_GUARDED_BY(mu) = false;
  bool delivering ABSL_GUARDED_BY(mu) = false;
  std::deque<IngestSessions::Work> queue ABSL_GUARDED_BY(mu);  // not yet issued
  // Issued, not yet delivered. A ticket stays at its address until it is
  // delivered (a deque keeps references across push_back / pop_front), so
  // its insert callback holds a pointer to it.
  std::deque<IngestSessions::Ticket> tickets ABSL_GUARDED_BY(mu);

  // Committed sequences only grow (a lower one is a duplicate, one between
  // the committed and the issued waits), and Restore checks the saved ones:
  // `recent` stays ascending for AcceptedBefore's search.
  void Remember(uint64_t sequence, int64_t accepted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (recent.size() == IngestSessions::kRecentBatches) recent.pop_front();
    recent.emplace_back(sequence, static_cast<uint32_t>(accepted));
  }

  int64_t AcceptedBefore(uint64_t sequence) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const auto it = std::lower_bound(recent.begin(), recent.end(), std::make_pair(sequence, uint32_t{0}));
    return it != recent.end() && it->first == sequence ? it->second : 0;
  }

  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return !pumping && !delivering && queue.empty() && tickets.empty();
  }

  // May the front of the queue be issued now? A batch whose sequence is
  // above the committed one but not above the issued one is a resend of a
  // batch still in flight: it waits for that outcome (duplicate if it
  // committed, processed afresh if it failed). After a failed insert nothing
  // is issued until the tickets drained.
  bool CanIssue() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (queue.empty() || failed || tickets.size() >= IngestSessions::kMaxTicketsPerSession) return false;
    const IngestSessions::Work& w = queue.front();
    if (w.type != IngestSessions::Work::Type::kBatch) return true;
    const uint64_t sequence = w.batch.sequence;
    return sequence == 0 || sequence <= last_sequence || sequence > issued_sequence;
  }
};

namespace {

IngestOutcome Outcome(int64_t replay_size) {
  IngestOutcome o;
  o.replay_size = replay_size;
  return o;
}

}  // namespace

IngestSessions::IngestSessions(Learner* learner, const NetworkSpec& spec, const v1::TrainerConfig& config,
                               IngestCounters* counters)
    : learner_(learner),
      spec_(spec),
      config_(config),
      counters_(counters),
      assembler_(spec, config.returns().n_step(), config.returns().gamma(),
                 config.server().max_envs_per_stream()) {
  replay_size_.store(learner_->status().replay_size, std::memory_order_relaxed);
}

IngestSessions::~IngestSessions() { Stop(); }

void IngestSessions::Start() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_ || expiry_thread_.joinable()) return;
  }
  expiry_thread_ = std::thread([this] { ExpiryLoop(); });
}

void IngestSessions::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (expiry_thread_.joinable()) expiry_thread_.join();
}

bool IngestSessions::TryReserve(int64_t bytes) {
  const int64_t max = config_.server().max_queued_bytes();
  int64_t current = queued_bytes_.load(std::memory_order_relaxed);
  do {
    if (current >= max) return false;
  } while (!queued_bytes_.compare_exchange_weak(current, current + bytes, std::memory_order_relaxed));
  return true;
}

void IngestSessions::Release(int64_t bytes) {
  if (bytes != 0) queued_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
}

absl::Status IngestSessions::QueueFull(int64_t bytes) const {
  return absl::ResourceExhaustedError(
      absl::StrCat("server.max_queued_bytes = ", config_.server().max_queued_bytes(), " is reached (",
                   queued_bytes_.load(std::memory_order_relaxed),
                   " bytes of batches and n-step windows wait for the replay; this batch needs ", bytes,
                   "); resend it later"));
}

void IngestSessions::ExpiryLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Seconds(1))) return;
    }
    Expire(absl::Now());
  }
}

std::shared_ptr<IngestSession> IngestSessions::Attach(const std::string& stream_id,
                                                      std::function<void()> on_superseded) {
  std::shared_ptr<IngestSession> handle;
  std::function<void()> supersede;
  std::vector<std::shared_ptr<IngestRecord>> evicted;
  {
    absl::MutexLock lock(&mu_);
    const uint64_t id = next_handle_id_++;
    std::shared_ptr<IngestRecord> r;
    if (stream_id.empty()) {
      r = std::make_shared<IngestRecord>("", id, &assembler_);
      private_[id] = r;
    } else {
      std::shared_ptr<IngestRecord>& slot = sessions_[stream_id];
      if (slot == nullptr) slot = std::make_shared<IngestRecord>(stream_id, 0, &assembler_);
      r = slot;
    }
    handle = std::make_shared<IngestSession>(r, id, std::move(on_superseded));
    {
      absl::MutexLock record_lock(&r->mu);
      if (r->holder != 0) {
        if (auto old = r->holder_handle.lock()) supersede = old->on_superseded();
      }
      r->holder = id;
      r->holder_handle = handle;
      r->detached_at = absl::InfiniteFuture();
      ++r->epoch;
    }
    if (static_cast<int64_t>(sessions_.size()) > config_.server().max_sessions()) EvictLocked(&evicted);
  }
  if (supersede) supersede();
  for (const auto& r : evicted) Post(r, Work::Of(Work::Type::kFlush));
  return handle;
}

void IngestSessions::Submit(const std::shared_ptr<IngestSession>& session, IncomingBatch batch, Done done) {
  Queue(session, std::move(batch), std::move(done));
  Pump(session->record());
}

void IngestSessions::Pump(const std::shared_ptr<IngestSession>& session) { Pump(session->record()); }

void IngestSessions::Queue(const std::shared_ptr<IngestSession>& session, IncomingBatch batch, Done done) {
  const int64_t bytes = batch.bytes();
  if (!TryReserve(bytes)) {
    counters_->Rejected("queued_bytes");
    IngestOutcome outcome = Outcome(replay_size_.load(std::memory_order_relaxed));
    outcome.status = QueueFull(bytes);
    done(std::move(outcome));
    return;
  }
  Work work = Work::Of(Work::Type::kBatch, std::move(done));
  work.reserved_bytes = bytes;
  work.batch = std::move(batch);
  Post(session->record(), std::move(work), /*pump=*/false);
}

void IngestSessions::Detach(const std::shared_ptr<IngestSession>& session, bool clean, Done flushed) {
  const std::shared_ptr<IngestRecord>& r = session->record();
  const bool is_private = r->stream_id.empty();
  {
    absl::MutexLock lock(&r->mu);
    if (r->holder != session->id()) {  // superseded: the successor owns the session
      flushed(Outcome(replay_size_.load(std::memory_order_relaxed)));
      return;
    }
    r->holder = 0;
    r->holder_handle.reset();
    r->detached_at = absl::Now();
  }
  if (!clean && !is_private) {  // kept for a reconnect
    flushed(Outcome(replay_size_.load(std::memory_order_relaxed)));
    return;
  }
  Work work = Work::Of(Work::Type::kFlush);
  if (clean) {
    work.done = [this, r, flushed = std::move(flushed)](IngestOutcome outcome) {
      MaybeForgetPrivate(r);
      flushed(std::move(outcome));
    };
    Post(r, std::move(work));
    return;
  }
  work.done = [this, r](IngestOutcome) { MaybeForgetPrivate(r); };
  Post(r, std::move(work));
  flushed(Outcome(replay_size_.load(std::memory_order_relaxed)));
}

void IngestSessions::Post(const std::shared_ptr<IngestRecord>& r, Work work, bool pump) {
  {
    absl::MutexLock lock(&r->mu);
    r->queue.push_back(std::move(work));
  }
  if (pump) Pump(r);
}

void IngestSessions::Pump(const std::shared_ptr<IngestRecord>& r) {
  {
    absl::MutexLock lock(&r->mu);
    if (r->pumping) return;  // that thread issues this work too
    r->pumping = true;
  }
  // The acks of the batches this pump delivers go out together at its end.
  CallbackScope scope;
  while (true) {
    Work work;
    {
      absl::MutexLock lock(&r->mu);
      if (r->failed && r->tickets.empty()) {
        r->failed = false;
        r->issued_sequence = r->last_sequence;
        Release(r->windows.Fold());
        r->issued_windows = r->windows.windows();
      }
      if (!r->CanIssue()) {
        r->pumping = false;
        return;
      }
      work = std::move(r->queue.front());
      r->queue.pop_front();
    }
    Issue(r, work);
    Deliver(r);
  }
}

void IngestSessions::Issue(const std::shared_ptr<IngestRecord>& r, Work& work) {
  const bool flush = work.type != Work::Type::kBatch;
  const int64_t window_bytes = assembler_.window_bytes();
  TransitionColumns columns = EmptyColumns(spec_);
  Ticket* ticket = nullptr;
  {
    absl::MutexLock lock(&r->mu);
    Ticket& t = r->tickets.emplace_back();
    ticket = &t;
    t.done = std::move(work.done);
    t.flush = flush;
    t.release_bytes = work.reserved_bytes;
    t.outcome = Outcome(replay_size_.load(std::memory_order_relaxed));
    t.completed = true;  // unless it goes to the learner below
    if (flush) {
      if (work.type == Work::Type::kExpiryFlush) {
        r->expiry_flush_queued = false;
        if (r->holder != 0 || r->epoch != work.epoch) return;  // a stream re-attached: keep them
      }
      if (r->issued_windows.empty()) return;
      assembler_.Flush(r->issued_windows, &columns);
      r->issued_windows.clear();
      t.clear_windows = true;
    } else {
      IncomingBatch& batch = work.batch;
      if (batch.sequence != 0 && batch.sequence <= r->last_sequence) {
        t.outcome.duplicate = true;
        t.outcome.accepted_before = r->AcceptedBefore(batch.sequence);
        return;
      }
      t.sequence = batch.sequence;
      t.outcome.episodes = std::move(batch.episodes);
      if (batch.kind == v1::TransitionBatch::KIND_STEP) {
        // The issued windows move on now; the committed ones at delivery.
        int64_t opened = 0;
        if (auto error = assembler_.Add(batch, &r->issued_windows, &columns, &opened)) {
          t.outcome.error = std::move(*error);
          t.sequence = 0;
          t.outcome.episodes = {};
          return;
        }
        // Part of the batch that Submit admitted (its overshoot, if any).
        const int64_t opened_bytes = opened * window_bytes;
        queued_bytes_.fetch_add(opened_bytes, std::memory_order_relaxed);
        t.release_bytes += opened_bytes;
        t.step_batch = std::move(batch);  // its steps, replayed into the committed windows at delivery
      } else {
        columns = std::move(batch.columns);
      }
    }
    r->issued_sequence = std::max(r->issued_sequence, t.sequence);
    if (columns.n == 0) return;  // every step waits in its window: commits at delivery
    t.completed = false;
    t.inserts = true;
    t.outcome.accepted = columns.n;
  }
  // Outside the record's lock: an idle learner inserts on this thread and
  // calls back at once. Issue order is Enqueue order (one pumping thread).
  learner_->Enqueue(std::move(columns), [this, r, ticket](absl::Status status, int64_t replay_size) {
    {
      absl::MutexLock lock(&r->mu);
      Ticket& t = *ticket;
      t.completed = true;
      t.outcome.status = std::move(status);
      if (t.outcome.status.ok()) {
        replay_size_.store(replay_size, std::memory_order_relaxed);
        t.outcome.replay_size = replay_size;
      } else {
        t.outcome.accepted = 0;
        t.outcome.episodes = {};
      }
    }
    Deliver(r);
  });
}

void IngestSessions::Deliver(const std::shared_ptr<IngestRecord>& r) {
  bool delivered = false;
  {
    absl::MutexLock lock(&r->mu);
    if (r->delivering) return;  // that thread delivers this outcome too, in order
    r->delivering = true;
  }
  while (true) {
    std::vector<Ticket> ready;
    {
      absl::MutexLock lock(&r->mu);
      while (!r->tickets.empty() && r->tickets.front().completed) {
        Ticket& t = r->tickets.front();
        if (t.inserts && !t.outcome.status.ok()) {
          r->failed = true;
        } else if (r->failed) {
          // Issued after an earlier insert of this session, which failed:
          // assembled on windows that never were. Only a stopping learner
          // fails an insert, and it fails every later one too; whatever this
          // item would commit is dropped and its stream ends.
          if (t.inserts || t.sequence != 0 || t.step_batch.has_value() || t.clear_windows ||
              !t.outcome.episodes.empty()) {
            t.outcome.status = absl::AbortedError("an earlier batch of this stream was not inserted");
            t.outcome.episodes = {};
          }
        } else {
          if (t.clear_windows) {
            t.release_bytes += r->windows.Clear();
          } else if (t.step_batch.has_value()) {
            // Its bytes (and the windows it may open) stay counted in the log.
            t.release_bytes = r->windows.Commit(std::move(*t.step_batch), t.release_bytes);
            t.step_batch.reset();
          }
          r->last_sequence = std::max(r->last_sequence, t.sequence);
          if (t.sequence != 0) r->Remember(t.sequence, t.outcome.accepted);
        }
        ready.push_back(std::move(t));
        r->tickets.pop_front();
      }
      if (ready.empty()) {
        r->delivering = false;
        break;
      }
    }
    delivered = true;
    for (Ticket& t : ready) {
      Release(t.release_bytes);
      if (t.flush && t.outcome.status.ok() && t.outcome.accepted > 0)
        counters_->Accepted(t.outcome.accepted, 0);
      if (t.done) t.done(std::move(t.outcome));
    }
  }
  if (delivered) Pump(r);  // a drained ticket may let the queue's front go
}

void IngestSessions::MaybeForgetPrivate(const std::shared_ptr<IngestRecord>& r) {
  if (!r->stream_id.empty()) return;
  absl::MutexLock lock(&mu_);
  absl::MutexLock record_lock(&r->mu);
  // Windows that could not be inserted (learner stopped) stay for the
  // final checkpoint, whose restore flushes them.
  if (r->holder != 0 || !r->Idle()) return;
  Release(r->windows.Fold());
  if (r->windows.windows().empty()) private_.erase(r->private_key);
}

void IngestSessions::EvictLocked(std::vector<std::shared_ptr<IngestRecord>>* evicted) {
  const int64_t max_sessions = config_.server().max_sessions();
  std::vector<std::pair<absl::Time, std::string>> detached;
  for (const auto& [id, r] : sessions_) {
    absl::MutexLock lock(&r->mu);
    if (r->holder == 0) detached.emplace_back(r->detached_at, id);
  }
  std::sort(detached.begin(), detached.end());
  for (const auto& [at, id] : detached) {
    if (static_cast<int64_t>(sessions_.size()) <= max_sessions) break;
    auto it = sessions_.find(id);
    evicted->push_back(it->second);
    sessions_.erase(it);
  }
}

void IngestSessions::Expire(absl::Time now) {
  const absl::Duration resume = absl::Seconds(config_.server().stream_resume_seconds());
  const absl::Duration ttl = absl::Seconds(config_.server().session_ttl_seconds());
  std::vector<std::pair<std::shared_ptr<IngestRecord>, uint64_t>> expired;  // record, epoch
  std::vector<std::shared_ptr<IngestRecord>> evicted;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::string> forget;
    for (const auto& [id, r] : sessions_) {
      absl::MutexLock record_lock(&r->mu);
      if (r->holder != 0) continue;
      const absl::Duration age = now - r->detached_at;
      if (!r->issued_windows.empty() && age >= resume && !r->expiry_flush_queued) {
        r->expiry_flush_queued = true;
        expired.emplace_back(r, r->epoch);
      }
      if (age < ttl || !r->Idle()) continue;
      Release(r->windows.Fold());
      if (r->windows.windows().empty()) forget.push_back(id);
    }
    for (const std::string& id : forget) sessions_.erase(id);
    if (static_cast<int64_t>(sessions_.size()) > config_.server().max_sessions()) EvictLocked(&evicted);
  }
  for (auto& [r, epoch] : expired) Post(r, Work::Of(Work::Type::kExpiryFlush, nullptr, epoch));
  for (const auto& r : evicted) Post(r, Work::Of(Work::Type::kFlush));
}

void IngestSessions::Save(v1::IngestState* out) {
  absl::MutexLock lock(&mu_);
  // Private sessions are saved only while they hold windows (flushed at restore).
  const auto save = [this, out](IngestRecord& r, bool only_with_windows) {
    absl::MutexLock record_lock(&r.mu);
    Release(r.windows.Fold());
    if (only_with_windows && r.windows.windows().empty()) return;
    v1::IngestSessionState* s = out->add_sessions();
    s->set_stream_id(r.stream_id);
    s->set_last_sequence(r.last_sequence);
    assembler_.Save(r.windows.windows(), s->mutable_windows());
    for (const auto& [sequence, accepted] : r.recent) {
      v1::CommittedBatch* c = s->add_recent();
      c->set_sequence(sequence);
      c->set_accepted(accepted);
    }
  };
  for (const auto& [id, r] : sessions_) save(*r, false);
  for (const auto& [id, r] : private_) save(*r, true);
}

absl::Status IngestSessions::Restore(const v1::IngestState& state) {
  absl::flat_hash_map<std::string, std::shared_ptr<IngestRecord>> restored;
  TransitionColumns flush = EmptyColumns(spec_);
  const absl::Time now = absl::Now();
  for (const v1::IngestSessionState& s : state.sessions()) {
    NStepWindows windows;
    if (auto st = assembler_.Load(s.windows(), &windows); !st.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("ingest session \"", s.stream_id(), "\": ", st.message()));
    }
    if (s.stream_id().empty()) {
      assembler_.Flush(windows, &flush);
      continue;
    }
    if (restored.count(s.stream_id())) {
      return absl::InvalidArgumentError(
          absl::StrCat("ingest session \"", s.stream_id(), "\": appears twice"));
    }
    uint64_t previous = 0;
    for (const v1::CommittedBatch& c : s.recent()) {
      if (c.sequence() <= previous || c.sequence() > s.last_sequence()) {
        return absl::InvalidArgumentError(
            absl::StrCat("ingest session \"", s.stream_id(), "\": recent.sequence ", c.sequence(),
                         " is not above the one before it (", previous, ") and at most last_sequence (",
                         s.last_sequence(), ")"));
      }
      previous = c.sequence();
    }
    auto r = std::make_shared<IngestRecord>(s.stream_id(), 0, &assembler_);
    absl::MutexLock lock(&r->mu);
    r->last_sequence = r->issued_sequence = s.last_sequence();
    for (const v1::CommittedBatch& c : s.recent()) r->Remember(c.sequence(), c.accepted());
    r->issued_windows = windows;
    r->windows.Reset(std::move(windows));
    r->detached_at = now;
    restored.emplace(s.stream_id(), std::move(r));
  }
  // The budget counts the restored windows instead of the replaced ones.
  int64_t bytes = 0;
  const auto count = [&bytes](const auto& records, int64_t sign) {
    for (const auto& [id, r] : records) {
      absl::MutexLock lock(&r->mu);
      bytes += sign * r->windows.counted_bytes();
    }
  };
  count(restored, 1);
  {
    absl::MutexLock lock(&mu_);
    count(sessions_, -1);
    count(private_, -1);
    sessions_ = std::move(restored);
    private_.clear();
  }
  queued_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  if (flush.n > 0) {
    const int64_t n = flush.n;
    learner_->Enqueue(std::move(flush), [this, n](absl::Status status, int64_t replay_size) {
      if (!status.ok()) return;
      replay_size_.store(replay_size, std::memory_order_relaxed);
      counters_->Accepted(n, 0);
    });
  }
  return absl::OkStatus();
}

int64_t IngestSessions::num_sessions() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(sessions_.size() + private_.size());
}

int64_t IngestSessions::pending_transitions() {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  const auto pending = [this, &total](const auto& records) {
    for (const auto& [id, r] : records) {
      absl::MutexLock record_lock(&r->mu);
      Release(r->windows.Fold());
      total += NStepAssembler::Pending(r->windows.windows());
    }
  };
  pending(sessions_);
  pending(private_);
  return total;
}

}  // namespace qstream
