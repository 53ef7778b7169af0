#include "clients/cpp/experience_stream.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "clients/cpp/channel.h"

namespace qstream::actor {
namespace {

constexpr absl::Duration kInitialBackoff = absl::Milliseconds(100);

// Codes after which resending cannot help: the daemon refused the stream.
// ABORTED: another stream with this stream_id took the session over (a
// second actor with the same identity); fighting it back would only make
// the two take turns, so this one stops.
bool IsFinal(grpc::StatusCode code) {
  return code == grpc::StatusCode::INVALID_ARGUMENT || code == grpc::StatusCode::ABORTED ||
         IsTokenRefused(code) || code == grpc::StatusCode::UNIMPLEMENTED ||
         code == grpc::StatusCode::FAILED_PRECONDITION;
}

}  // namespace

void StreamTotals::Add(const StreamTotals& other) {
  sent_batches += other.sent_batches;
  acked_batches += other.acked_batches;
  sent_transitions += other.sent_transitions;
  accepted_transitions += other.accepted_transitions;
  replay_size += other.replay_size;
  daemon_policy_version = std::max(daemon_policy_version, other.daemon_policy_version);
  throttle = throttle || other.throttle;
  throttled_acks += other.throttled_acks;
  window += other.window;
  reconnects += other.reconnects;
}

absl::StatusOr<std::unique_ptr<ExperienceStream>> ExperienceStream::Open(
    const std::shared_ptr<grpc::Channel>& channel, const Options& options) {
  if (options.max_in_flight < 1) {
    return absl::InvalidArgumentError("max_in_flight must be >= 1");
  }
  std::unique_ptr<ExperienceStream> s(new ExperienceStream(v1::ExperienceService::NewStub(channel), options));
  auto attempt = std::make_shared<Attempt>();
  attempt->call = s->stub_->Stream(&attempt->context);
  if (attempt->call == nullptr) {
    return absl::UnavailableError("could not start ExperienceService.Stream");
  }
  {
    absl::MutexLock lock(&s->mu_);
    s->attempt_ = std::move(attempt);
  }
  s->reader_ = std::thread([p = s.get()] { p->ReadLoop(); });
  return s;
}

ExperienceStream::ExperienceStream(std::unique_ptr<v1::ExperienceService::Stub> stub, const Options& options)
    : options_(options), stub_(std::move(stub)), window_(options.max_in_flight) {
  absl::MutexLock lock(&mu_);
  totals_.window = window_.size();
}

ExperienceStream::~ExperienceStream() {
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (attempt_ != nullptr) {
      attempt_->context.TryCancel();
    }
  }
  if (reader_.joinable()) {
    reader_.join();
  }
}

void ExperienceStream::Fail(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (error_.ok()) {
    error_ = std::move(status);
  }
}

void ExperienceStream::Reconnect() {
  auto attempt = std::make_shared<Attempt>();
  attempt->call = stub_->Stream(&attempt->context);
  absl::MutexLock write_lock(&write_mu_);
  std::vector<std::shared_ptr<const v1::TransitionBatch>> resend;
  {
    absl::MutexLock lock(&mu_);
    attempt_ = attempt;
    ++generation_;
    ++totals_.reconnects;
    resend.assign(unacked_.begin(), unacked_.end());
    if (cancelled_) {
      attempt->context.TryCancel();
    }
  }
  // A failed write shows up as a failed Read in ReadLoop, which reconnects again.
  for (const std::shared_ptr<const v1::TransitionBatch>& b : resend) {
    if (!attempt->call->Write(*b)) {
      break;
    }
  }
  absl::MutexLock lock(&mu_);
  // Close() half-closed the previous attempt; this one ends the same way.
  if (closing_) {
    attempt->call->WritesDone();
  }
}

void ExperienceStream::ReadLoop() {
  absl::Duration backoff = kInitialBackoff;
  absl::Time failing_since = absl::InfiniteFuture();
  while (true) {
    std::shared_ptr<Attempt> attempt;
    {
      absl::MutexLock lock(&mu_);
      attempt = attempt_;
    }
    v1::Ack ack;
    while (attempt->call->Read(&ack)) {
      absl::MutexLock lock(&mu_);
      backoff = kInitialBackoff;
      failing_since = absl::InfiniteFuture();
      totals_.replay_size = ack.replay_size();
      totals_.daemon_policy_version = ack.policy_version();
      totals_.throttle = ack.throttle();
      if (ack.throttle()) ++totals_.throttled_acks;
      window_.OnAck(ack.throttle());
      totals_.window = window_.size();
      // Acks come in order; one for an older sequence re-acknowledges a resend.
      // A duplicate ack (already inserted earlier) acknowledges the batch too.
      if (unacked_.empty() || ack.sequence() != unacked_.front()->sequence()) {
        continue;
      }
      unacked_.pop_front();
      ++totals_.acked_batches;
      if (ack.has_error()) {
        if (error_.ok()) {
          error_ =
              absl::InvalidArgumentError(absl::StrCat("batch ", ack.sequence(), " rejected, field '",
                                                      ack.error().field(), "': ", ack.error().message()));
        }
      } else {
        // A duplicate's count is its first insert's (Ack.accepted_before).
        totals_.accepted_transitions += ack.accepted() + ack.accepted_before();
      }
    }
    grpc::Status status;
    {
      // Read failed, so the call is over and a concurrent Write returns at
      // once; waiting for it keeps Finish from racing a Write.
      absl::MutexLock write_lock(&write_mu_);
      status = attempt->call->Finish();
    }
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_ || (closing_ && unacked_.empty())) {
        break;
      }
    }
    if (IsTokenRefused(status.error_code())) {
      Fail(TokenRefusedError("experience stream", status));
      break;
    }
    if (IsFinal(status.error_code())) {
      Fail(absl::UnavailableError(
          absl::StrCat("experience stream ended by the daemon: ", status.error_message())));
      break;
    }
    const absl::Time now = absl::Now();
    failing_since = std::min(failing_since, now);
    if (now - failing_since > options_.reconnect_timeout) {
      Fail(absl::UnavailableError(absl::StrCat("experience stream: no connection for ",
                                               absl::FormatDuration(options_.reconnect_timeout), ": ",
                                               status.error_message())));
      break;
    }
    {
      absl::MutexLock lock(&mu_);
      // Sleeps out the backoff, but wakes at once when the stream is torn down.
      mu_.AwaitWithTimeout(absl::Condition(&cancelled_), backoff);
      if (cancelled_) {
        break;
      }
    }
    backoff = std::min(backoff * 2, options_.max_backoff);
    Reconnect();
  }
  absl::MutexLock lock(&mu_);
  reader_done_ = true;
  if (error_.ok() && !unacked_.empty()) {
    error_ = absl::UnavailableError("experience stream ended with unacknowledged batches");
  }
}

absl::Status ExperienceStream::Send(v1::TransitionBatch batch) {
  std::shared_ptr<Attempt> attempt;
  std::shared_ptr<const v1::TransitionBatch> sent;
  int64_t generation = 0;
  {
    absl::MutexLock lock(&mu_);
    auto has_room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !error_.ok() || reader_done_ || static_cast<int>(unacked_.size()) < window_.size();
    };
    mu_.Await(absl::Condition(&has_room));
    if (!error_.ok()) {
      return error_;
    }
    if (reader_done_ || closing_) {
      return absl::FailedPreconditionError("experience stream is closed");
    }
    batch.set_sequence(next_sequence_++);
    batch.set_stream_id(options_.stream_id);
    if (batch.kind() == v1::TransitionBatch::KIND_UNSPECIFIED) {  // the daemon requires a kind
      batch.set_kind(batch.has_done() ? v1::TransitionBatch::KIND_STEP : v1::TransitionBatch::KIND_NSTEP);
    }
    ++totals_.sent_batches;
    totals_.sent_transitions += batch.count();
    sent = std::make_shared<const v1::TransitionBatch>(std::move(batch));
    unacked_.push_back(sent);
    attempt = attempt_;
    generation = generation_;
  }
  absl::MutexLock write_lock(&write_mu_);
  {
    absl::MutexLock lock(&mu_);
    // A reconnect since then already resent this batch on the new attempt.
    if (generation != generation_) {
      return absl::OkStatus();
    }
  }
  // A failed write means the call broke: the reader reconnects and resends.
  attempt->call->Write(*sent);
  return absl::OkStatus();
}

absl::Status ExperienceStream::Flush() {
  absl::MutexLock lock(&mu_);
  auto all_acked = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !error_.ok() || reader_done_ || unacked_.empty();
  };
  mu_.Await(absl::Condition(&all_acked));
  return error_;
}

absl::Status ExperienceStream::Close() {
  absl::Status flushed = Flush();
  {
    absl::MutexLock write_lock(&write_mu_);
    absl::MutexLock lock(&mu_);
    closing_ = true;
    if (!reader_done_) {
      attempt_->call->WritesDone();
    }
  }
  if (reader_.joinable()) {
    reader_.join();
  }
  if (!flushed.ok()) {
    return flushed;
  }
  absl::MutexLock lock(&mu_);
  return error_;
}

StreamTotals ExperienceStream::totals() const {
  absl::MutexLock lock(&mu_);
  return totals_;
}

}  // namespace qstream::actor
