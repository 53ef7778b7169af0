#include "clients/cpp/experience_stream.h"

#include "absl/strings/str_cat.h"

namespace qstream::actor {

absl::StatusOr<std::unique_ptr<ExperienceStream>> ExperienceStream::Open(
    const std::shared_ptr<grpc::Channel>& channel, const Options& options) {
  if (options.max_in_flight < 1) return absl::InvalidArgumentError("max_in_flight must be >= 1");
  std::unique_ptr<ExperienceStream> s(new ExperienceStream(v1::ExperienceService::NewStub(channel), options));
  s->call_ = s->stub_->Stream(&s->context_);
  if (s->call_ == nullptr) return absl::UnavailableError("could not start ExperienceService.Stream");
  s->reader_ = std::thread([p = s.get()] { p->ReadLoop(); });
  return s;
}

ExperienceStream::ExperienceStream(std::unique_ptr<v1::ExperienceService::Stub> stub, const Options& options)
    : options_(options), stub_(std::move(stub)) {}

ExperienceStream::~ExperienceStream() {
  if (!closed_) context_.TryCancel();
  if (reader_.joinable()) reader_.join();
  if (!closed_ && call_ != nullptr) call_->Finish().ok();
}

void ExperienceStream::ReadLoop() {
  v1::Ack ack;
  while (call_->Read(&ack)) {
    absl::MutexLock lock(&mu_);
    ++totals_.acked_batches;
    totals_.accepted_transitions += ack.accepted();
    totals_.replay_size = ack.replay_size();
    totals_.daemon_policy_version = ack.policy_version();
    totals_.throttle = ack.throttle();
    if (ack.has_error() && error_.ok()) {
      error_ = absl::InvalidArgumentError(absl::StrCat("batch ", ack.sequence(), " rejected, field '",
                                                       ack.error().field(), "': ", ack.error().message()));
    }
  }
  absl::MutexLock lock(&mu_);
  reader_done_ = true;
  if (error_.ok() && totals_.acked_batches < totals_.sent_batches) {
    error_ = absl::UnavailableError("experience stream ended with unacknowledged batches");
  }
}

absl::Status ExperienceStream::Send(v1::TransitionBatch batch) {
  {
    absl::MutexLock lock(&mu_);
    auto has_room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !error_.ok() || reader_done_ || totals_.sent_batches - totals_.acked_batches < options_.max_in_flight;
    };
    mu_.Await(absl::Condition(&has_room));
    if (!error_.ok()) return error_;
    if (reader_done_) return absl::UnavailableError("experience stream closed by the daemon");
    batch.set_sequence(next_sequence_++);
    batch.set_stream_id(options_.stream_id);
    ++totals_.sent_batches;
    totals_.sent_transitions += batch.count();
  }
  if (!call_->Write(batch)) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&reader_done_));
    return error_.ok() ? absl::UnavailableError("experience stream broken") : error_;
  }
  return absl::OkStatus();
}

absl::Status ExperienceStream::Flush() {
  absl::MutexLock lock(&mu_);
  auto all_acked = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !error_.ok() || reader_done_ || totals_.acked_batches == totals_.sent_batches;
  };
  mu_.Await(absl::Condition(&all_acked));
  return error_;
}

absl::Status ExperienceStream::Close() {
  absl::Status flushed = Flush();
  closed_ = true;
  call_->WritesDone();
  reader_.join();
  grpc::Status s = call_->Finish();
  if (!flushed.ok()) return flushed;
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("experience stream: ", s.error_message()));
  return absl::OkStatus();
}

StreamTotals ExperienceStream::totals() const {
  absl::MutexLock lock(&mu_);
  return totals_;
}

}  // namespace qstream::actor
