// PolicyService: the latest published snapshot (GetPolicy), a stream of every
// new one (WatchPolicy: one write reactor per watcher, fed by a Learner policy
// listener, no thread per stream), and Q-values for given observations
// (Evaluate).
#pragma once

#include <memory>

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

 private:
  class WatchReactor;
  Learner* const learner_;
  const v1::TrainerConfig config_;
};

}  // namespace qstream
