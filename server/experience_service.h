// ExperienceService: actors stream TransitionBatches, the daemon answers each
// with one Ack. One reactor per stream (callback API, no thread per stream):
// read a batch, validate it, convert it to replay columns (assembling n-step
// items for KIND_STEP), hand it to the Learner, and write the Ack only once
// the Learner reports it inserted. The next read starts only after that Ack
// is written, so a learner that falls behind stops the stream's reads and
// HTTP/2 flow control pushes back on the actor; nothing is dropped. Each
// stream has at most one batch in the learner, so pending memory is bounded
// by server.max_streams x (one batch + the HTTP/2 window).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "qstream/v1/experience.grpc.pb.h"
#include "server/ingest_counters.h"
#include "trainer/learner.h"
#include "trainer/network_spec.h"

namespace qstream {

class ExperienceService final : public v1::ExperienceService::CallbackService {
 public:
  // `learner` and `counters` must outlive the service.
  ExperienceService(Learner* learner, NetworkSpec spec, IngestCounters* counters);
  ~ExperienceService() override;

  grpc::ServerBidiReactor<v1::TransitionBatch, v1::Ack>* Stream(grpc::CallbackServerContext* context) override;

  // Ends every stream as soon as it holds no batch: a stream waiting for its
  // next batch is cancelled now, one whose batch is in the learner gets its
  // ack and then ends with UNAVAILABLE. New streams are refused.
  void BeginShutdown() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class StreamReactor;
  friend class StreamReactor;

  // Resend de-duplication across reconnects for batches that carry a
  // stream_id: the highest sequence admitted per stream_id.
  bool IsNewSequence(const std::string& stream_id, uint64_t sequence) const ABSL_LOCKS_EXCLUDED(mu_);
  void CommitSequence(const std::string& stream_id, uint64_t sequence) ABSL_LOCKS_EXCLUDED(mu_);
  void Unregister(StreamReactor* stream) ABSL_LOCKS_EXCLUDED(mu_);

  Learner* const learner_;
  const NetworkSpec spec_;
  const v1::TrainerConfig config_;
  IngestCounters* const counters_;
  // Kept current by a policy listener so the ack path never calls into the
  // Learner from its insert callback.
  std::atomic<int64_t> policy_version_{0};
  std::atomic<int64_t> replay_size_{0};
  int64_t listener_id_ = 0;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, uint64_t> last_sequence_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<StreamReactor*> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace qstream
