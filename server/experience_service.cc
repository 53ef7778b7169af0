#include "server/experience_service.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "server/validate.h"

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
class ExperienceService::StreamReactor final : public Reactor,
                                               public std::enable_shared_from_this<StreamReactor> {
 public:
  StreamReactor(ExperienceService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context) {}

  void Begin() {
    self_ = shared_from_this();
    StartRead(&request_);
  }

  // Called by BeginShutdown with the service's registry locked.
  void Drain() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    if (!busy_ && !finished_) context_->TryCancel();
  }

  void OnCancel() override ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    ReleaseSlot();
  }

  void OnReadDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    bool cancelled;
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;  // superseded while the read was pending
      busy_ = true;
      cancelled = cancelled_ || context_->IsCancelled();
    }
    if (!ok) {
      ReleaseSlot();  // nothing more is read; a flush in flight is budgeted
      OnClosed(cancelled);
      return;
    }
    ack_.Clear();
    ack_.set_throttle(service_->learner_->throttled());
    const DecodedBatch decoded = DecodeBatch(&request_, service_->config_.server(), &batch_);
    request_.Clear();
    if (decoded.result == DecodedBatch::kUnparsable) {
      service_->counters_->Rejected("message");
      End(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, decoded.error.message));
      return;
    }
    ack_.set_sequence(batch_.sequence());
    if (decoded.result == DecodedBatch::kRejected) {
      Reject(decoded.error);
      return;
    }
    IncomingBatch incoming;
    if (auto error = ValidateBatch(batch_, service_->spec_, service_->config_.server(), &incoming)) {
      Reject(*error);
      return;
    }
    batch_.Clear();  // the columns are copied out; the next read parses into it again
    if (session_ == nullptr) {
      stream_id_ = incoming.stream_id;
      session_ = service_->sessions_->Attach(stream_id_, [weak = weak_from_this()] {
        if (auto self = weak.lock()) self->OnSuperseded();
      });
    } else if (incoming.stream_id != stream_id_) {
      Reject(BatchError{v1::Error::INVALID_FIELD, "stream_id",
                        absl::StrCat("stream_id: \"", incoming.stream_id, "\" differs from \"", stream_id_,
                                     "\" that this stream started with")});
      return;
    }
    const int64_t lag = std::max<int64_t>(
        0, service_->policy_version_.load(std::memory_order_relaxed) - incoming.policy_version);
    service_->sessions_->Submit(session_, std::move(incoming),
                                [self = shared_from_this(), lag](IngestOutcome outcome) {
                                  self->OnOutcome(std::move(outcome), lag);
                                });
  }

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    if (!ok) {
      End(grpc::Status(grpc::StatusCode::CANCELLED, "ack could not be written"));
      return;
    }
    grpc::Status end;
    {
      absl::MutexLock lock(&mu_);
      busy_ = false;
      if (finished_) return;
      if (superseded_) {
        end = Superseded();
      } else if (draining_) {
        end = grpc::Status(grpc::StatusCode::UNAVAILABLE, "qstreamd is shutting down");
      } else {
        StartRead(&request_);  // under mu_: a takeover cannot Finish in between
        return;
      }
    }
    End(end);
  }

  void OnDone() override {
    service_->Unregister(this);
    ReleaseSlot();
    std::shared_ptr<StreamReactor> last = std::move(self_);  // may delete this on return
  }

 private:
  // Another stream attached to this stream_id (runs on its thread).
  void OnSuperseded() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      superseded_ = true;
      if (finished_ || busy_) return;  // OnWriteDone ends it after the batch in flight
      finished_ = true;
    }
    ReleaseSlot();
    Finish(Superseded());
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

  // The read side ended: a half-close flushes the session's windows and ends
  // with OK once they are in the replay; a cancelled call keeps them for a
  // reconnect.
  void OnClosed(bool cancelled) {
    if (session_ == nullptr) {
      FinishOnce(cancelled ? grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled")
                           : grpc::Status::OK);
      return;
    }
    if (cancelled) {
      End(grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"));
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
        self->FinishOnce(self->Superseded());
      } else if (!outcome.status.ok()) {
        self->FinishOnce(NotInserted(outcome.status, "n-step windows flushed at half-close"));
      } else {
        self->FinishOnce(grpc::Status::OK);
      }
    });
  }

  // Runs inline in Submit or on a learner callback thread.
  void OnOutcome(IngestOutcome outcome, int64_t lag) ABSL_LOCKS_EXCLUDED(mu_) {
    if (!outcome.status.ok()) {
      End(NotInserted(outcome.status, absl::StrCat("batch ", ack_.sequence())));
      return;
    }
    service_->replay_size_.store(outcome.replay_size, std::memory_order_relaxed);
    if (outcome.error) {
      Reject(*outcome.error);
      return;
    }
    if (!outcome.duplicate && outcome.accepted > 0) service_->counters_->Accepted(outcome.accepted, lag);
    ack_.set_duplicate(outcome.duplicate);
    WriteAck(outcome.accepted);
  }

  void Reject(const BatchError& error) {
    service_->counters_->Rejected(error.field);
    *ack_.mutable_error() = error.ToProto();
    WriteAck(0);
  }

  void WriteAck(int64_t accepted) ABSL_LOCKS_EXCLUDED(mu_) {
    ack_.set_accepted(static_cast<uint32_t>(accepted));
    ack_.set_replay_size(service_->replay_size_.load(std::memory_order_relaxed));
    ack_.set_policy_version(service_->policy_version_.load(std::memory_order_relaxed));
    bool own_buffer;
    response_.Clear();
    if (!grpc::SerializationTraits<v1::Ack>::Serialize(ack_, &response_, &own_buffer).ok()) {
      End(grpc::Status(grpc::StatusCode::INTERNAL, "ack could not be serialized"));
      return;
    }
    absl::MutexLock lock(&mu_);
    if (!finished_) StartWrite(&response_);
  }

  // Ends the stream without a flush: the session stays for a reconnect.
  void End(grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_) {
    bool detach = false;
    {
      absl::MutexLock lock(&mu_);
      detach = session_ != nullptr && !detached_;
      detached_ = true;
    }
    if (detach) service_->sessions_->Detach(session_, /*clean=*/false, [](IngestOutcome) {});
    FinishOnce(std::move(status));
  }

  void FinishOnce(grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
    }
    ReleaseSlot();
    Finish(std::move(status));
  }

  ExperienceService* const service_;
  grpc::CallbackServerContext* const context_;
  std::shared_ptr<StreamReactor> self_;
  std::atomic<bool> slot_released_{false};

  absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // from a read's completion until its ack is written
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool superseded_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool detached_ ABSL_GUARDED_BY(mu_) = false;

  // Touched only by the reaction in progress (one at a time: a read, its
  // outcome, its write), set at the first valid batch.
  std::shared_ptr<IngestSession> session_;
  std::string stream_id_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  v1::TransitionBatch batch_;
  v1::Ack ack_;
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
