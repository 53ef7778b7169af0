// ExperienceService: actors stream TransitionBatches, the daemon answers each
// with one Ack. One reactor per stream (callback API, no thread per stream)
// that only translates: it decodes the wire bytes (DecodeBatch: the
// stream_id is checked before protobuf parses; a message that does not
// parse ends the stream with INVALID_ARGUMENT), validates the batch, hands it
// to the stream's ingest session (IngestSessions: de-duplication, n-step
// windows, the queued-bytes budget, the insert and its commit) and writes
// the Ack from the session's outcome. Reads run ahead of acks up to
// server.max_in_flight_per_stream unanswered batches (acks go out one per
// batch, in read order); beyond that, or when a learner that falls behind
// holds the acks back, the stream's reads stop and HTTP/2 flow control
// pushes back on the actor; nothing is dropped. Memory held for streams: at
// most server.max_streams messages being received (each <=
// max_message_bytes) plus server.max_queued_bytes of accepted batches. A
// stream gives its max_streams slot back as soon as it reads nothing more
// (half-close, cancel, end), even while its last batches still wait for the
// replay.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/byte_buffer.h"
#include "qstream/v1/experience.grpc.pb.h"
#include "server/ingest_counters.h"
#include "server/ingest_sessions.h"
#include "trainer/learner.h"
#include "trainer/network_spec.h"

namespace qstream {

class ExperienceService final
    : public v1::ExperienceService::WithRawCallbackMethod_Stream<v1::ExperienceService::Service> {
 public:
  // `learner`, `counters` and `sessions` must outlive the service.
  ExperienceService(Learner* learner, NetworkSpec spec, IngestCounters* counters, IngestSessions* sessions);
  ~ExperienceService() override;

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(grpc::CallbackServerContext* context) override;

  // Ends every stream as soon as it holds no batch: a stream waiting for its
  // next batch is cancelled now, one whose batch is in the learner gets its
  // ack and then ends with UNAVAILABLE. Their sessions stay for a reconnect.
  // New streams are refused.
  void BeginShutdown() ABSL_LOCKS_EXCLUDED(mu_);
  // Streams are refused with UNAVAILABLE until Open() (while a checkpoint is
  // restored, the sessions must not change under the restore).
  void Open() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class StreamReactor;
  friend class StreamReactor;

  void Unregister(StreamReactor* stream) ABSL_LOCKS_EXCLUDED(mu_);

  Learner* const learner_;
  const NetworkSpec spec_;
  const v1::TrainerConfig config_;
  IngestCounters* const counters_;
  IngestSessions* const sessions_;
  // Kept current by a policy listener so the ack path never calls into the
  // Learner from its insert callback.
  std::atomic<int64_t> policy_version_{0};
  // Latest replay size an outcome reported (for acks of rejected batches).
  std::atomic<int64_t> replay_size_{0};
  int64_t listener_id_ = 0;

  mutable absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<StreamReactor*> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace qstream
