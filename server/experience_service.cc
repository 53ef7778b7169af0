#include "server/experience_service.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/batch_columns.h"
#include "server/nstep.h"
#include "server/validate.h"

namespace qstream {

namespace {

// Ends a stream that exceeds server.max_streams before reading anything.
class RejectReactor final : public grpc::ServerBidiReactor<v1::TransitionBatch, v1::Ack> {
 public:
  explicit RejectReactor(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

class ExperienceService::StreamReactor final : public grpc::ServerBidiReactor<v1::TransitionBatch, v1::Ack> {
 public:
  StreamReactor(ExperienceService* service, grpc::CallbackServerContext* context)
      : service_(service),
        context_(context),
        assembler_(service->spec_, service->config_.returns().n_step(), service->config_.returns().gamma(),
                   service->config_.server().max_batch_transitions()) {
    StartRead(&batch_);
  }

  // Called by BeginShutdown with the service's registry locked.
  void Drain() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    if (!busy_) context_->TryCancel();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the actor closed its side (or the call was cancelled)
      Finish(grpc::Status::OK);
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      busy_ = true;
    }
    ack_.Clear();
    ack_.set_sequence(batch_.sequence());
    ack_.set_throttle(service_->learner_->throttled());
    if (auto error = ValidateBatch(batch_, service_->spec_, service_->config_.server())) {
      Reject(*error);
      return;
    }
    if (!IsNew()) {  // a resend of an acknowledged batch: ack again, insert nothing
      WriteAck(0);
      return;
    }
    TransitionColumns columns;
    if (batch_.kind() == v1::TransitionBatch::KIND_STEP) {
      columns = EmptyColumns(service_->spec_);
      if (auto error = assembler_.Add(batch_, &columns)) {
        Reject(*error);
        return;
      }
    } else {
      columns = ColumnsFromNStepBatch(batch_, service_->spec_);
    }
    Commit();
    if (columns.n == 0) {  // every step waits in its n-step window
      WriteAck(0);
      return;
    }
    const int64_t n = columns.n;
    const int64_t lag = std::max<int64_t>(
        0, service_->policy_version_.load(std::memory_order_relaxed) - batch_.policy_version());
    // Nothing below may touch `this`: the callback may finish (and delete)
    // the reactor on the learner thread before Enqueue returns.
    service_->learner_->Enqueue(std::move(columns), [this, n, lag](absl::Status status, int64_t replay_size) {
      OnInserted(status, n, lag, replay_size);
    });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "ack could not be written"));
      return;
    }
    bool draining;
    {
      absl::MutexLock lock(&mu_);
      busy_ = false;
      draining = draining_;
    }
    if (draining) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "qstreamd is shutting down"));
      return;
    }
    StartRead(&batch_);
  }

  void OnDone() override {
    service_->Unregister(this);
    service_->counters_->CloseStream();
    delete this;
  }

 private:
  // Runs on the learner thread (or inside Enqueue when the learner stopped).
  void OnInserted(const absl::Status& status, int64_t n, int64_t lag, int64_t replay_size) {
    if (!status.ok()) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          absl::StrCat("batch ", ack_.sequence(), " not inserted: ", status.message())));
      return;
    }
    service_->replay_size_.store(replay_size, std::memory_order_relaxed);
    service_->counters_->Accepted(n, lag);
    WriteAck(n);
  }

  void Reject(const BatchError& error) {
    service_->counters_->Rejected(error.field);
    *ack_.mutable_error() = error.ToProto();
    WriteAck(0);
  }

  void WriteAck(int64_t accepted) {
    ack_.set_accepted(static_cast<uint32_t>(accepted));
    ack_.set_replay_size(service_->replay_size_.load(std::memory_order_relaxed));
    ack_.set_policy_version(service_->policy_version_.load(std::memory_order_relaxed));
    StartWrite(&ack_);
  }

  bool IsNew() const {
    if (!batch_.stream_id().empty()) return service_->IsNewSequence(batch_.stream_id(), batch_.sequence());
    return !last_sequence_.has_value() || batch_.sequence() > *last_sequence_;
  }

  void Commit() {
    if (!batch_.stream_id().empty()) {
      service_->CommitSequence(batch_.stream_id(), batch_.sequence());
    } else {
      last_sequence_ = batch_.sequence();
    }
  }

  ExperienceService* const service_;
  grpc::CallbackServerContext* const context_;
  absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // from a read's completion until its ack is written
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  NStepAssembler assembler_;
  std::optional<uint64_t> last_sequence_;
  v1::TransitionBatch batch_;
  v1::Ack ack_;
};

ExperienceService::ExperienceService(Learner* learner, NetworkSpec spec, IngestCounters* counters)
    : learner_(learner), spec_(std::move(spec)), config_(learner->config()), counters_(counters) {
  listener_id_ = learner_->AddPolicyListener([this](std::shared_ptr<const PolicySnapshot> snapshot) {
    policy_version_.store(snapshot->version, std::memory_order_relaxed);
  });
  if (auto snapshot = learner_->policy()) policy_version_.store(snapshot->version, std::memory_order_relaxed);
  replay_size_.store(learner_->status().replay_size, std::memory_order_relaxed);
}

ExperienceService::~ExperienceService() { learner_->RemovePolicyListener(listener_id_); }

grpc::ServerBidiReactor<v1::TransitionBatch, v1::Ack>* ExperienceService::Stream(
    grpc::CallbackServerContext* context) {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) {
    return new RejectReactor(grpc::Status(grpc::StatusCode::UNAVAILABLE, "qstreamd is shutting down"));
  }
  if (!counters_->TryOpenStream(config_.server().max_streams())) {
    return new RejectReactor(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                          absl::StrCat("server.max_streams = ", config_.server().max_streams(),
                                                       " actor streams already open")));
  }
  auto* reactor = new StreamReactor(this, context);
  streams_.insert(reactor);
  return reactor;
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

bool ExperienceService::IsNewSequence(const std::string& stream_id, uint64_t sequence) const {
  absl::MutexLock lock(&mu_);
  auto it = last_sequence_.find(stream_id);
  return it == last_sequence_.end() || sequence > it->second;
}

void ExperienceService::CommitSequence(const std::string& stream_id, uint64_t sequence) {
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = last_sequence_.try_emplace(stream_id, sequence);
  if (!inserted) it->second = std::max(it->second, sequence);
}

}  // namespace qstream
