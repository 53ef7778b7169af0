#include "server/experience_service.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "server/validate.h"
#include "trainer/callback_runner.h"

namespace qstream {

namespace {

using Reactor = grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>;

// Ends a stream that exceeds server.max_streams before reading anything.
class RejectReactor final : public Reactor {
 public:
  explicit RejectReactor(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

// The status a stream ends with when its batch (or flush) could not be
// inserted: a stopped learner reads as the daemon going away.
grpc::Status NotInserted(const absl::Status& status, const std::string& what) {
  const auto code = absl::IsCancelled(status) ? grpc::StatusCode::UNAVAILABLE
                                              : static_cast<grpc::StatusCode>(status.code());
  return grpc::Status(code, absl::StrCat(what, " not inserted: ", status.message()));
}

}  // namespace

// Owns itself (self_) from Begin until OnDone; the session's callbacks hold
// it too, so an outcome arriving on a learner callback thread never finds it gone.
//
// Reads run ahead of acks: a message is read, validated and submitted to the
// stream's ingest session, and the next one is read at once while at most
// server.max_in_flight_per_stream batches wait for their outcome. Each read
// batch takes a slot in `slots_`; outcomes fill their slots in any order and
// acks are written from the front, one per batch, in read order (an ack that
// has ready acks behind it is written with a buffer hint, so a run of them
// leaves in one send). Outcomes delivered in one run of callbacks (a pump of
// the stream's session, an insert round's callbacks: CallbackScope) start
// the write at the run's end, so the acks of a stream's batches inserted
// together leave together.
class ExperienceService::StreamReactor final : public Reactor,
                                               public std::enable_shared_from_this<StreamReactor> {
 public:
  StreamReactor(ExperienceService* service, grpc::CallbackServerContext* context)
      : service_(service),
        context_(context),
        window_(static_cast<size_t>(service->config_.server().max_in_flight_per_stream())) {}

  void Begin() {
    self_ = shared_from_this();
    absl::MutexLock lock(&mu_);
    reading_ = true;
    StartRead(&request_);
  }

  // Called by BeginShutdown with the service's registry locked.
  void Drain() ABSL_LOCKS_EXCLUDED(mu_) {
    bool cancel;
    {
      absl::MutexLock lock(&mu_);
      draining_ = true;
      cancel = slots_.empty() && !writing_ && !finished_;
    }
    if (cancel) {
      context_->TryCancel();
    } else {
      EndAfterAcks(grpc::Status(grpc::StatusCode::UNAVAILABLE, "qstreamd is shutting down"));
    }
  }

  // The call is cancelled (client gone, deadline, TryCancel from Drain or the
  // server's shutdown deadline): it ends now. A pending read is not relied on
  // to complete first (gRPC 1.51 may leave it pending until Finish), so
  // waiting for OnReadDone here could hold the server's shutdown forever.
  void OnCancel() override ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    EndNow(grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"));
  }

  void OnReadDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    bool cancelled;
    {
      absl::MutexLock lock(&mu_);
      if (finished_) {  // superseded or ended while the read was pending
        reading_ = false;
        return;
      }
      cancelled = cancelled_ || context_->IsCancelled();
      if (!ok) {
        reading_ = false;
        read_closed_ = true;
      }
    }
    if (!ok) {
      ReleaseSlot();  // nothing more is read; batches in flight are budgeted
      OnClosed(cancelled);
      return;
    }
    // request_ and batch_ belong to this reaction until it starts the next read.
    const DecodedBatch decoded = DecodeBatch(&request_, service_->config_.server(), &batch_);
    request_.Clear();
    if (decoded.result == DecodedBatch::kUnparsable) {
      service_->counters_->Rejected("message");
      EndAfterAcks(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, decoded.error.message));
      ReadNext(/*read_reaction_over=*/true);
      return;
    }
    const uint64_t sequence = batch_.sequence();
    const uint64_t slot = OpenSlot();
    if (decoded.result == DecodedBatch::kRejected) {
      Reject(slot, sequence, decoded.error);
      ReadNext(/*read_reaction_over=*/true);
      return;
    }
    IncomingBatch incoming;
    if (auto error = ValidateBatch(batch_, service_->spec_, service_->config_.server(), &incoming)) {
      Reject(slot, sequence, *error);
      ReadNext(/*read_reaction_over=*/true);
      return;
    }
    batch_.Clear();  // the columns are copied out; the next read parses into it again
    if (session_ == nullptr) {
      stream_id_ = incoming.stream_id;
      auto session = service_->sessions_->Attach(stream_id_, [weak = weak_from_this()] {
        if (auto self = weak.lock()) self->OnSuperseded();
      });
      bool ended;
      {
        absl::MutexLock lock(&mu_);
        session_ = session;
        ended = detached_;
      }
      // Cancelled while this batch was decoded: the session is left for a
      // reconnect at once (the batch below is not acknowledged; its resend is
      // deduplicated by sequence).
      if (ended) service_->sessions_->Detach(session, /*clean=*/false, [](const IngestOutcome&) {});
    } else if (incoming.stream_id != stream_id_) {
      Reject(slot, sequence,
             BatchError{v1::Error::INVALID_FIELD, "stream_id",
                        absl::StrCat("stream_id: \"", incoming.stream_id, "\" differs from \"", stream_id_,
                                     "\" that this stream started with")});
      ReadNext(/*read_reaction_over=*/true);
      return;
    }
    const int64_t lag = std::max<int64_t>(
        0, service_->policy_version_.load(std::memory_order_relaxed) - incoming.policy_version);
    // The batch takes its place in the session's order before the next read
    // starts; that read's message is then decoded and validated on another
    // thread while this one assembles and inserts the session's queue.
    IngestSessions* const sessions = service_->sessions_;
    const std::shared_ptr<IngestSession> session = session_;
    sessions->Queue(session, std::move(incoming),
                    [self = shared_from_this(), slot, sequence, lag](IngestOutcome outcome) {
                      self->OnOutcome(slot, sequence, std::move(outcome), lag);
                    });
    ReadNext(/*read_reaction_over=*/true);
    sessions->Pump(session);
  }

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      slots_.pop_front();  // the ack just written (EndNow keeps it while it is written)
      ++first_slot_;
    }
    if (!ok) {
      EndNow(grpc::Status(grpc::StatusCode::CANCELLED, "ack could not be written"));
      return;
    }
    ReadNext(/*read_reaction_over=*/false);  // a slot came free
    Pump();
  }

  void OnDone() override {
    service_->Unregister(this);
    ReleaseSlot();
    std::shared_ptr<StreamReactor> last = std::move(self_);  // may delete this on return
  }

 private:
  // A read batch awaiting its ack. `ready` with no ack: nothing is written
  // for it (its outcome ended the stream).
  struct Slot {
    bool ready = false;
    std::optional<grpc::ByteBuffer> ack;
  };

  uint64_t OpenSlot() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    slots_.emplace_back();
    return first_slot_ + slots_.size() - 1;
  }

  // Another stream attached to this stream_id (runs on its thread): no more
  // reads; the stream ends with ABORTED once the batches it read are answered.
  void OnSuperseded() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      superseded_ = true;
    }
    EndAfterAcks(Superseded());
  }

  // Gives the stream's server.max_streams slot back as soon as the stream
  // reads nothing more (ended, half-closed or cancelled), not only in OnDone:
  // a batch it left in the learner is bounded by server.max_queued_bytes.
  void ReleaseSlot() {
    if (!slot_released_.exchange(true, std::memory_order_relaxed)) service_->counters_->CloseStream();
  }

  grpc::Status Superseded() const {
    return grpc::Status(grpc::StatusCode::ABORTED,
                        absl::StrCat("stream_id ", stream_id_, " was taken over by a newer stream"));
  }

  // The read side ended: a half-close flushes the session's windows (after
  // the batches in flight, in the session's order) and ends with OK once
  // they are in the replay and every ack is written; a cancelled call keeps
  // them for a reconnect.
  void OnClosed(bool cancelled) {
    if (cancelled) {
      EndNow(grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"));
      return;
    }
    if (session_ == nullptr) {
      EndAfterAcks(grpc::Status::OK);
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      detached_ = true;
    }
    service_->sessions_->Detach(session_, /*clean=*/true, [self = shared_from_this()](IngestOutcome outcome) {
      bool superseded;
      {
        absl::MutexLock lock(&self->mu_);
        superseded = self->superseded_;
      }
      if (superseded) {
        self->EndAfterAcks(self->Superseded());
      } else if (!outcome.status.ok()) {
        self->EndAfterAcks(NotInserted(outcome.status, "n-step windows flushed at half-close"));
      } else {
        self->EndAfterAcks(grpc::Status::OK);
      }
    });
  }

  // Runs inline in Submit or on a learner callback thread, in submission order.
  void OnOutcome(uint64_t slot, uint64_t sequence, IngestOutcome outcome, int64_t lag)
      ABSL_LOCKS_EXCLUDED(mu_) {
    if (!outcome.status.ok()) {
      Fill(slot, std::nullopt);
      EndAfterAcks(NotInserted(outcome.status, absl::StrCat("batch ", sequence)));
      return;
    }
    service_->replay_size_.store(outcome.replay_size, std::memory_order_relaxed);
    if (outcome.error) {
      Reject(slot, sequence, *outcome.error);
      return;
    }
    if (!outcome.duplicate && outcome.accepted > 0) service_->counters_->Accepted(outcome.accepted, lag);
    service_->counters_->Episodes(outcome.episodes);  // set only when the batch committed as new
    v1::Ack ack;
    ack.set_sequence(sequence);
    ack.set_duplicate(outcome.duplicate);
    ack.set_accepted(static_cast<uint32_t>(outcome.accepted));
    ack.set_accepted_before(static_cast<uint32_t>(outcome.accepted_before));
    WriteAck(slot, &ack);
  }

  void Reject(uint64_t slot, uint64_t sequence, const BatchError& error) {
    service_->counters_->Rejected(error.field);
    v1::Ack ack;
    ack.set_sequence(sequence);
    *ack.mutable_error() = error.ToProto();
    WriteAck(slot, &ack);
  }

  // Every ack carries the daemon's state as it is written: replay size,
  // policy version and `throttle` (Ack.throttle: the batches and n-step
  // windows waiting for the replay hold half of server.max_queued_bytes).
  void WriteAck(uint64_t slot, v1::Ack* ack) ABSL_LOCKS_EXCLUDED(mu_) {
    ack->set_throttle(service_->sessions_->pressured());
    ack->set_replay_size(service_->replay_size_.load(std::memory_order_relaxed));
    ack->set_policy_version(service_->policy_version_.load(std::memory_order_relaxed));
    grpc::ByteBuffer bytes;
    bool own_buffer;
    if (!grpc::SerializationTraits<v1::Ack>::Serialize(*ack, &bytes, &own_buffer).ok()) {
      Fill(slot, std::nullopt);
      EndAfterAcks(grpc::Status(grpc::StatusCode::INTERNAL, "ack could not be serialized"));
      return;
    }
    Fill(slot, std::move(bytes));
  }

  void Fill(uint64_t slot, std::optional<grpc::ByteBuffer> ack) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      if (slot < first_slot_ || slot - first_slot_ >= slots_.size()) return;  // dropped by EndNow
      Slot& s = slots_[slot - first_slot_];
      s.ready = true;
      s.ack = std::move(ack);
    }
    // Within a run of callbacks (CallbackScope) the write starts at the run's
    // end, with every ack of this stream it made ready behind a buffer hint.
    CallbackScope::RunAtScopeEnd(this, [self = shared_from_this()] { self->Pump(); });
  }

  // Writes the front ack when it is ready and no write is outstanding; skips
  // slots that get no ack; finishes once everything is written and an end is due.
  void Pump() ABSL_LOCKS_EXCLUDED(mu_) {
    grpc::Status end;
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || writing_) return;
      while (!slots_.empty() && slots_.front().ready && !slots_.front().ack.has_value()) {
        slots_.pop_front();
        ++first_slot_;
      }
      if (!slots_.empty()) {
        if (!slots_.front().ready) return;
        writing_ = true;
        grpc::WriteOptions options;
        // More follow at once: gRPC buffers this one (its write completes at
        // once) and sends the run with the last. Never on the first write: it
        // carries the initial metadata, and gRPC 1.51 completes a buffered
        // write with initial metadata only once it is sent (the stream would
        // wait for an OnWriteDone that never comes).
        if (wrote_ && slots_.size() > 1 && slots_[1].ready && slots_[1].ack.has_value()) {
          options.set_buffer_hint();
        }
        wrote_ = true;
        StartWrite(&*slots_.front().ack, options);
        return;
      }
      if (!end_.has_value()) return;
      finished_ = true;
      end = std::move(*end_);
    }
    FinishOnce(std::move(end));
  }

  // Starts the next read unless one is pending, the window is full or
  // reading has stopped (every end sets read_closed_). `read_reaction_over`:
  // called at the end of OnReadDone's reaction (the read it handled is no
  // longer pending).
  void ReadNext(bool read_reaction_over) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (read_reaction_over) reading_ = false;
    if (read_closed_ || draining_ || reading_ || slots_.size() >= window_) return;
    reading_ = true;
    StartRead(&request_);  // under mu_: a takeover cannot Finish in between
  }

  // Ends the stream once every batch read so far is answered; the session
  // keeps its windows for a reconnect unless a half-close flushed them.
  void EndAfterAcks(grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_) {
    DetachUnclean();
    {
      absl::MutexLock lock(&mu_);
      read_closed_ = true;
      if (finished_ || end_.has_value()) return;
      end_ = std::move(status);  // a pending read completes with ok = false after the Finish
    }
    Pump();
  }

  // Ends the stream now, dropping unwritten acks (the client is gone).
  void EndNow(grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_) {
    DetachUnclean();
    grpc::Status end;
    {
      absl::MutexLock lock(&mu_);
      read_closed_ = true;
      // Drop the unwritten acks; one being written stays until OnWriteDone.
      if (writing_) {
        slots_.erase(slots_.begin() + 1, slots_.end());
      } else {
        first_slot_ += slots_.size();
        slots_.clear();
      }
      if (finished_) return;
      if (!end_.has_value()) end_ = std::move(status);
      if (writing_) return;  // OnWriteDone finishes
      finished_ = true;
      end = std::move(*end_);
    }
    FinishOnce(std::move(end));
  }

  void DetachUnclean() ABSL_LOCKS_EXCLUDED(mu_) {
    bool detach = false;
    {
      absl::MutexLock lock(&mu_);
      detach = session_ != nullptr && !detached_;
      detached_ = true;
    }
    if (detach) service_->sessions_->Detach(session_, /*clean=*/false, [](const IngestOutcome&) {});
  }

  // Called once, by the caller that set finished_, outside mu_ (OnDone may
  // follow at once and drop the last reference).
  void FinishOnce(grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_) {
    ReleaseSlot();
    Finish(std::move(status));
  }

  ExperienceService* const service_;
  grpc::CallbackServerContext* const context_;
  const size_t window_;
  std::shared_ptr<StreamReactor> self_;
  std::atomic<bool> slot_released_{false};

  absl::Mutex mu_;
  std::deque<Slot> slots_ ABSL_GUARDED_BY(mu_);   // read, ack not yet written
  uint64_t first_slot_ ABSL_GUARDED_BY(mu_) = 0;  // the id of slots_.front()
  bool reading_ ABSL_GUARDED_BY(mu_) = false;     // a read is pending or its reaction runs
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool wrote_ ABSL_GUARDED_BY(mu_) = false;  // an ack was written (initial metadata sent)
  bool read_closed_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> end_ ABSL_GUARDED_BY(mu_);  // finish with this once acks are written
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool superseded_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool detached_ ABSL_GUARDED_BY(mu_) = false;

  // Set at the first valid batch by the reaction of the latest read (one at
  // a time), under mu_; that reaction reads it without the lock, every other
  // thread with it.
  std::shared_ptr<IngestSession> session_;
  std::string stream_id_;
  grpc::ByteBuffer request_;
  v1::TransitionBatch batch_;
};

ExperienceService::ExperienceService(Learner* learner, NetworkSpec spec, IngestCounters* counters,
                                     IngestSessions* sessions)
    : learner_(learner),
      spec_(std::move(spec)),
      config_(learner->config()),
      counters_(counters),
      sessions_(sessions) {
  listener_id_ = learner_->AddPolicyListener([this](std::shared_ptr<const PolicySnapshot> snapshot) {
    policy_version_.store(snapshot->version, std::memory_order_relaxed);
  });
  if (auto snapshot = learner_->policy()) policy_version_.store(snapshot->version, std::memory_order_relaxed);
  replay_size_.store(learner_->status().replay_size, std::memory_order_relaxed);
}

ExperienceService::~ExperienceService() { learner_->RemovePolicyListener(listener_id_); }

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ExperienceService::Stream(
    grpc::CallbackServerContext* context) {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) {
    return new RejectReactor(grpc::Status(grpc::StatusCode::UNAVAILABLE, "qstreamd is shutting down"));
  }
  if (!open_) {
    return new RejectReactor(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "qstreamd is starting (restoring a checkpoint); retry"));
  }
  if (!counters_->TryOpenStream(config_.server().max_streams())) {
    return new RejectReactor(
        grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                     absl::StrCat("server.max_streams = ", config_.server().max_streams(),
                                  " actor streams already open")));
  }
  auto reactor = std::make_shared<StreamReactor>(this, context);
  streams_.insert(reactor.get());
  reactor->Begin();
  return reactor.get();
}

void ExperienceService::Open() {
  absl::MutexLock lock(&mu_);
  open_ = true;
}

void ExperienceService::BeginShutdown() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
  for (StreamReactor* stream : streams_) stream->Drain();
}

void ExperienceService::Unregister(StreamReactor* stream) {
  absl::MutexLock lock(&mu_);
  streams_.erase(stream);
}

}  // namespace qstream
