// PolicyService: the latest published snapshot (GetPolicy), a stream of every
// new one (WatchPolicy: one write reactor per watcher, fed by a Learner policy
// listener, no thread per stream), and Q-values for given observations
// (Evaluate).
#pragma once

#include <atomic>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "qstream/v1/config.pb.h"
#include "qstream/v1/policy.grpc.pb.h"
#include "trainer/learner.h"

namespace qstream {

// Fills the wire form of a snapshot (architecture, version, weights).
void SnapshotToProto(const PolicySnapshot& snapshot, v1::Policy* policy);

class PolicyService final : public v1::PolicyService::CallbackService {
 public:
  // `learner` must outlive the service and every watcher.
  explicit PolicyService(Learner* learner);

  grpc::ServerUnaryReactor* GetPolicy(grpc::CallbackServerContext* context, const v1::GetPolicyRequest* request,
                                      v1::Policy* response) override;
  grpc::ServerWriteReactor<v1::Policy>* WatchPolicy(grpc::CallbackServerContext* context,
                                                    const v1::WatchPolicyRequest* request) override;
  grpc::ServerUnaryReactor* Evaluate(grpc::CallbackServerContext* context, const v1::EvaluateRequest* request,
                                     v1::EvaluateResponse* response) override;

  // Cancels every open WatchPolicy stream and refuses new ones.
  void BeginShutdown() ABSL_LOCKS_EXCLUDED(mu_);
  // Every call is refused with UNAVAILABLE until Open(), so nobody is served
  // the initial weights while a checkpoint is being restored.
  void Open() { open_.store(true, std::memory_order_release); }

 private:
  class WatchReactor;
  void Unregister(WatchReactor* watcher) ABSL_LOCKS_EXCLUDED(mu_);

  bool opened() const { return open_.load(std::memory_order_acquire); }

  Learner* const learner_;
  const v1::TrainerConfig config_;
  std::atomic<bool> open_{false};
  absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<WatchReactor*, grpc::CallbackServerContext*> watchers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace qstream
