// ExperienceStream: one ExperienceService.Stream call. Send() numbers each
// batch and writes it; a reader thread owned by the stream collects the acks.
// At most `max_in_flight` batches are unacknowledged at a time: Send() blocks
// until the daemon catches up, so a slow learner slows the actor down
// instead of piling up data in memory.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "qstream/v1/experience.grpc.pb.h"

namespace qstream::actor {

struct StreamTotals {
  int64_t sent_batches = 0;
  int64_t acked_batches = 0;
  int64_t sent_transitions = 0;
  int64_t accepted_transitions = 0;  // sum of Ack.accepted
  int64_t replay_size = 0;           // from the last ack
  int64_t daemon_policy_version = 0;
  bool throttle = false;
};

class ExperienceStream {
 public:
  struct Options {
    int max_in_flight = 8;
    // Sent with every batch; identifies the stream for resend de-duplication.
    std::string stream_id;
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
  ExperienceStream(std::unique_ptr<v1::ExperienceService::Stub> stub, const Options& options);
  void ReadLoop();

  const Options options_;
  std::unique_ptr<v1::ExperienceService::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::TransitionBatch, v1::Ack>> call_;
  std::thread reader_;
  bool closed_ = false;  // touched by the writing thread only

  mutable absl::Mutex mu_;
  StreamTotals totals_ ABSL_GUARDED_BY(mu_);
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  bool reader_done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace qstream::actor
