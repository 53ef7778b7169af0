#include "server/ingest_sessions.h"

#include <algorithm>
#include <deque>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/batch_columns.h"

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

struct IngestSessions::Finished {
  Done done;
  IngestOutcome outcome;
  int64_t release_bytes = 0;  // returned to queued_bytes_ before `done` runs
};

struct IngestRecord {
  IngestRecord(std::string id, uint64_t key) : stream_id(std::move(id)), private_key(key) {}

  const std::string stream_id;  // "" for a private session
  const uint64_t private_key;   // the owning handle's id for a private session, else 0

  absl::Mutex mu;
  // Committed with the insert that made them true.
  uint64_t last_sequence ABSL_GUARDED_BY(mu) = 0;
  NStepWindows windows ABSL_GUARDED_BY(mu);
  // Handle id of the attached stream (0: detached) and the handle itself.
  uint64_t holder ABSL_GUARDED_BY(mu) = 0;
  std::weak_ptr<IngestSession> holder_handle ABSL_GUARDED_BY(mu);
  uint64_t epoch ABSL_GUARDED_BY(mu) = 0;  // Attach count
  absl::Time detached_at ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
  bool expiry_flush_queued ABSL_GUARDED_BY(mu) = false;
  // A work item is being processed or is in the learner; the rest wait.
  bool busy ABSL_GUARDED_BY(mu) = false;
  std::deque<IngestSessions::Work> queue ABSL_GUARDED_BY(mu);

  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return !busy && queue.empty(); }
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
      r = std::make_shared<IngestRecord>("", id);
      private_[id] = r;
    } else {
      std::shared_ptr<IngestRecord>& slot = sessions_[stream_id];
      if (slot == nullptr) slot = std::make_shared<IngestRecord>(stream_id, 0);
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
  const std::shared_ptr<IngestRecord>& r = session->record();
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
  {
    absl::MutexLock lock(&r->mu);
    if (!r->Idle()) {
      r->queue.push_back(std::move(work));
      return;
    }
    r->busy = true;
  }
  Run(r, std::move(work));
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

void IngestSessions::Post(const std::shared_ptr<IngestRecord>& r, Work work) {
  {
    absl::MutexLock lock(&r->mu);
    if (!r->Idle()) {
      r->queue.push_back(std::move(work));
      return;
    }
    r->busy = true;
  }
  Run(r, std::move(work));
}

void IngestSessions::Run(const std::shared_ptr<IngestRecord>& r, Work work) {
  while (true) {
    std::optional<Finished> finished = Process(r, work);
    if (!finished) return;  // the insert callback carries on
    std::optional<Work> next;
    {
      absl::MutexLock lock(&r->mu);
      if (r->queue.empty()) {
        r->busy = false;
      } else {
        next = std::move(r->queue.front());
        r->queue.pop_front();
      }
    }
    Release(finished->release_bytes);
    if (finished->done) finished->done(std::move(finished->outcome));
    if (!next) return;
    work = std::move(*next);
  }
}

std::optional<IngestSessions::Finished> IngestSessions::Process(const std::shared_ptr<IngestRecord>& r,
                                                                Work& work) {
  const bool flush = work.type != Work::Type::kBatch;
  Finished finished{std::move(work.done), Outcome(replay_size_.load(std::memory_order_relaxed)),
                    work.reserved_bytes};
  const int64_t window_bytes = assembler_.window_bytes();
  int64_t opened_bytes = 0;  // reserved for the windows this batch may open
  uint64_t sequence = 0;
  NStepWindows delta;
  TransitionColumns columns = EmptyColumns(spec_);
  {
    absl::MutexLock lock(&r->mu);
    if (flush) {
      if (work.type == Work::Type::kExpiryFlush) {
        r->expiry_flush_queued = false;
        if (r->holder != 0 || r->epoch != work.epoch) return finished;  // a stream re-attached: keep them
      }
      if (r->windows.empty()) return finished;
      assembler_.Flush(r->windows, &columns);
      for (const auto& [id, w] : r->windows) delta.emplace(id, NStepWindow{});
    } else {
      IncomingBatch& batch = work.batch;
      sequence = batch.sequence;
      if (sequence != 0 && sequence <= r->last_sequence) {
        finished.outcome.duplicate = true;
        return finished;
      }
      if (batch.kind == v1::TransitionBatch::KIND_STEP) {
        if (auto error = assembler_.Add(batch, r->windows, &delta, &columns)) {
          finished.outcome.error = std::move(*error);
          return finished;
        }
        // Part of the batch that Submit admitted (its overshoot, if any).
        opened_bytes = NStepAssembler::Opened(delta, r->windows) * window_bytes;
        queued_bytes_.fetch_add(opened_bytes, std::memory_order_relaxed);
      } else {
        columns = std::move(batch.columns);
      }
      if (columns.n == 0) {  // every step waits in its window: nothing to insert, commit now
        const int64_t gained = NStepAssembler::Commit(&delta, &r->windows);
        if (sequence != 0) r->last_sequence = std::max(r->last_sequence, sequence);
        finished.release_bytes += opened_bytes - gained * window_bytes;
        return finished;
      }
    }
  }
  const int64_t n = columns.n;
  // Commits the sequence and the windows in the insert callback, right after
  // the insert (or drops them when it failed), then runs the record's next
  // work item.
  auto on_inserted = [this, r, flush, sequence, n, delta = std::move(delta), window_bytes,
                      release = finished.release_bytes + opened_bytes,
                      done = std::move(finished.done)](absl::Status status, int64_t replay_size) mutable {
    IngestOutcome outcome;
    std::optional<Work> next;
    if (status.ok()) {
      replay_size_.store(replay_size, std::memory_order_relaxed);
      outcome.accepted = n;
      outcome.replay_size = replay_size;
      if (flush) counters_->Accepted(n, 0);
    } else {
      outcome.status = std::move(status);
      outcome.replay_size = replay_size_.load(std::memory_order_relaxed);
    }
    {
      absl::MutexLock lock(&r->mu);
      if (outcome.status.ok()) {
        release -= NStepAssembler::Commit(&delta, &r->windows) * window_bytes;
        if (sequence != 0) r->last_sequence = std::max(r->last_sequence, sequence);
      }
      if (r->queue.empty()) {
        r->busy = false;
      } else {
        next = std::move(r->queue.front());
        r->queue.pop_front();
      }
    }
    Release(release);
    if (done) done(std::move(outcome));
    if (next) Run(r, std::move(*next));
  };
  learner_->Enqueue(std::move(columns), std::move(on_inserted));
  return std::nullopt;
}

void IngestSessions::MaybeForgetPrivate(const std::shared_ptr<IngestRecord>& r) {
  if (!r->stream_id.empty()) return;
  absl::MutexLock lock(&mu_);
  absl::MutexLock record_lock(&r->mu);
  // Windows that could not be inserted (learner stopped) stay for the
  // final checkpoint, whose restore flushes them.
  if (r->holder == 0 && r->windows.empty() && r->Idle()) private_.erase(r->private_key);
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
      if (!r->windows.empty() && age >= resume && !r->expiry_flush_queued) {
        r->expiry_flush_queued = true;
        expired.emplace_back(r, r->epoch);
      }
      if (age >= ttl && r->windows.empty() && r->Idle()) forget.push_back(id);
    }
    for (const std::string& id : forget) sessions_.erase(id);
    if (static_cast<int64_t>(sessions_.size()) > config_.server().max_sessions()) EvictLocked(&evicted);
  }
  for (auto& [r, epoch] : expired) Post(r, Work::Of(Work::Type::kExpiryFlush, nullptr, epoch));
  for (const auto& r : evicted) Post(r, Work::Of(Work::Type::kFlush));
}

void IngestSessions::Save(v1::IngestState* out) const {
  absl::MutexLock lock(&mu_);
  // Private sessions are saved only while they hold windows (flushed at restore).
  const auto save = [this, out](IngestRecord& r, bool only_with_windows) {
    absl::MutexLock record_lock(&r.mu);
    if (only_with_windows && r.windows.empty()) return;
    v1::IngestSessionState* s = out->add_sessions();
    s->set_stream_id(r.stream_id);
    s->set_last_sequence(r.last_sequence);
    assembler_.Save(r.windows, s->mutable_windows());
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
    auto r = std::make_shared<IngestRecord>(s.stream_id(), 0);
    absl::MutexLock lock(&r->mu);
    r->last_sequence = s.last_sequence();
    r->windows = std::move(windows);
    r->detached_at = now;
    restored.emplace(s.stream_id(), std::move(r));
  }
  // The budget counts the restored windows instead of the replaced ones.
  int64_t windows = 0;
  const auto count = [&windows](const auto& records, int64_t sign) {
    for (const auto& [id, r] : records) {
      absl::MutexLock lock(&r->mu);
      windows += sign * static_cast<int64_t>(r->windows.size());
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
  queued_bytes_.fetch_add(windows * assembler_.window_bytes(), std::memory_order_relaxed);
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

int64_t IngestSessions::pending_transitions() const {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  for (const auto& [id, r] : sessions_) {
    absl::MutexLock record_lock(&r->mu);
    total += NStepAssembler::Pending(r->windows);
  }
  for (const auto& [id, r] : private_) {
    absl::MutexLock record_lock(&r->mu);
    total += NStepAssembler::Pending(r->windows);
  }
  return total;
}

}  // namespace qstream
