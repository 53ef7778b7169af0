// AdminService: Status (learner + ingest counters + effective config, the
// config for admin callers only when roles are on),
// Checkpoint, Pause, Resume. Each RPC translates to one Learner call.
#pragma once

#include "qstream/v1/admin.grpc.pb.h"
#include "server/ingest_counters.h"
#include "server/metrics.h"
#include "server/security.h"
#include "trainer/learner.h"

namespace qstream {

// StatusResponse from the learner's status and the ingest counters.
// `step_seconds`: recent mean step time (from the metrics poll).
v1::StatusResponse BuildStatus(const LearnerStatus& learner, const IngestCounters& counters,
                               const v1::TrainerConfig& config, double step_seconds);

class AdminService final : public v1::AdminService::CallbackService {
 public:
  // Arguments must outlive the service. `authorizer` (null without
  // --auth_tokens): Status then includes the config for admin only.
  AdminService(Learner* learner, const IngestCounters* counters, const Metrics* metrics, TokenAuthorizer* authorizer = nullptr);

  grpc::ServerUnaryReactor* Status(grpc::CallbackServerContext* context, const v1::StatusRequest* request,
                                   v1::StatusResponse* response) override;
  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* context, const v1::CheckpointRequest* request,
                                       v1::CheckpointResponse* response) override;
  grpc::ServerUnaryReactor* Pause(grpc::CallbackServerContext* context, const v1::PauseRequest* request,
                                  v1::PauseResponse* response) override;
  grpc::ServerUnaryReactor* Resume(grpc::CallbackServerContext* context, const v1::ResumeRequest* request,
                                   v1::ResumeResponse* response) override;

 private:
  Learner* const learner_;
  const IngestCounters* const counters_;
  const Metrics* const metrics_;
  TokenAuthorizer* const authorizer_;
};

}  // namespace qstream
