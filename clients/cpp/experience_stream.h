// ExperienceStream: one logical ExperienceService.Stream. Send() numbers each
// batch and writes it; a reader thread owned by the stream collects the acks.
// At most `max_in_flight` batches are unacknowledged at a time: Send() blocks
// until the daemon catches up, so a slow learner slows the actor down
// instead of piling up data in memory.
//
// When the call breaks (daemon restart, network), the reader thread opens a
// new call with exponential backoff and resends every unacknowledged batch
// with the same stream_id and sequence; the daemon acknowledges already
// inserted ones again (Ack.duplicate) without inserting them twice; such an
// ack counts as acknowledged, with the count of its first insert
// (Ack.accepted_before) while the daemon still knows it. Sequences start at 1. An error ack or a
// protocol error from the daemon is final, and so is ABORTED: another stream
// with the same stream_id took the session over, and this one gives way
// instead of taking it back. A refused token (UNAUTHENTICATED,
// PERMISSION_DENIED) is final too, with an error saying so. A batch sent
// without a kind gets KIND_STEP when it has a `done` column, else KIND_NSTEP.
// Batches are kept (for resends) without a copy: Send takes its argument by
// value, so a caller that moves it in pays no copy of the columns.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "clients/cpp/in_flight_window.h"
#include "grpcpp/grpcpp.h"
#include "qstream/v1/experience.grpc.pb.h"

namespace qstream::actor {

struct StreamTotals {
  int64_t sent_batches = 0;
  int64_t acked_batches = 0;
  int64_t sent_transitions = 0;
  int64_t accepted_transitions = 0;  // sum of Ack.accepted + Ack.accepted_before
  int64_t replay_size = 0;           // from the last ack
  int64_t daemon_policy_version = 0;
  bool throttle = false;
  int64_t throttled_acks = 0;  // acks with Ack.throttle set
  // In-flight window now: max_in_flight, halved on a throttled ack at most
  // once per window of acks, +1 per unthrottled ack (Ack.throttle).
  int window = 0;
  int64_t reconnects = 0;

  // Adds the totals of another stream (to another rank): counts, windows and
  // replay sizes add up (the replay over the shards), the policy version is
  // the newer, throttle is set when either is.
  void Add(const StreamTotals& other);
};

class ExperienceStream {
 public:
  struct Options {
    int max_in_flight = 32;
    // Sent with every batch; identifies the stream for resend de-duplication.
    std::string stream_id;
    // Give up when no call could be (re)established for this long.
    absl::Duration reconnect_timeout = absl::Seconds(60);
    absl::Duration max_backoff = absl::Seconds(2);
  };

  static absl::StatusOr<std::unique_ptr<ExperienceStream>> Open(const std::shared_ptr<grpc::Channel>& channel,
                                                                const Options& options);
  // Cancels the call if Close() was not called, then joins the reader.
  ~ExperienceStream();
  ExperienceStream(const ExperienceStream&) = delete;
  ExperienceStream& operator=(const ExperienceStream&) = delete;

  // Sets sequence and stream_id, waits for room, writes. Fails with the
  // first error the stream saw (an error ack names the rejected field).
  absl::Status Send(v1::TransitionBatch batch);
  // Waits until every sent batch is acknowledged.
  absl::Status Flush();
  // Flush, half-close, and the call's final status.
  absl::Status Close();

  StreamTotals totals() const;

 private:
  using Call = grpc::ClientReaderWriter<v1::TransitionBatch, v1::Ack>;
  // One attempt of the call; replaced on reconnect.
  struct Attempt {
    grpc::ClientContext context;
    std::unique_ptr<Call> call;
  };

  ExperienceStream(std::unique_ptr<v1::ExperienceService::Stub> stub, const Options& options);
  void ReadLoop();
  // Starts a new attempt and writes every unacknowledged batch to it.
  void Reconnect() ABSL_LOCKS_EXCLUDED(mu_, write_mu_);
  void Fail(absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  std::unique_ptr<v1::ExperienceService::Stub> stub_;
  std::thread reader_;

  // Serializes writes (and WritesDone) on the current attempt; taken before mu_.
  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  std::shared_ptr<Attempt> attempt_ ABSL_GUARDED_BY(mu_);
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  InFlightWindow window_ ABSL_GUARDED_BY(mu_);
  // Shared with a Write in progress, so an ack that pops it cannot free it under the writer.
  std::deque<std::shared_ptr<const v1::TransitionBatch>> unacked_ ABSL_GUARDED_BY(mu_);
  StreamTotals totals_ ABSL_GUARDED_BY(mu_);
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;    // Close(): half-closed, draining
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // destructor: stop at once
  bool reader_done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace qstream::actor
