#include "server/admin_service.h"

#include "absl/strings/str_cat.h"
#include "server/grpc_status.h"
#include "server/security.h"
#include "trainer/checkpoint.h"
#include "qstream/version.h"

namespace qstream {

v1::StatusResponse BuildStatus(const LearnerStatus& s, const IngestCounters& counters,
                               const v1::TrainerConfig& config, double step_seconds) {
  v1::StatusResponse r;
  r.set_version(QSTREAM_VERSION);
  r.set_backend(s.backend);
  r.set_device(s.device);
  r.set_learner_steps(s.steps);
  r.set_replay_size(s.replay_size);
  r.set_replay_capacity(s.replay_capacity);
  r.set_transitions_ingested(counters.transitions());
  r.set_batches_ingested(counters.batches());
  r.set_batches_rejected(counters.rejected());
  r.set_actor_streams(counters.actor_streams());
  auto* limiter = r.mutable_rate_limiter();
  limiter->set_inserts(s.rate_limiter_inserts);
  limiter->set_samples(s.rate_limiter_samples);
  limiter->set_samples_per_insert(config.rate_limiter().samples_per_insert());
  limiter->set_sample_blocked(s.sample_blocked);
  limiter->set_insert_blocked(s.insert_blocked);
  auto* step = r.mutable_last_step();
  step->set_loss(s.last_stats.loss);
  step->set_grad_norm(s.last_stats.grad_norm);
  step->set_q_min(s.last_stats.q_min);
  step->set_q_mean(s.last_stats.q_mean);
  step->set_q_max(s.last_stats.q_max);
  step->set_target_clip_fraction(s.last_stats.target_clip_fraction);
  step->set_step_seconds(step_seconds);
  auto* guard = r.mutable_guard();
  guard->set_tripped(s.last_stats.guard != GuardReason::kNone);
  if (s.last_stats.guard != GuardReason::kNone) guard->set_last_reason(GuardReasonName(s.last_stats.guard));
  for (size_t i = 1; i < s.guard_trips.size(); ++i) {
    (*guard->mutable_trips())[GuardReasonName(static_cast<GuardReason>(i))] = s.guard_trips[i];
  }
  r.set_policy_version(s.policy_version);
  r.set_paused(s.paused);
  *r.mutable_config() = config;
  r.set_halted(s.halted);
  r.set_halt_reason(s.halt_reason);
  r.set_guard_rollbacks(s.guard_rollbacks);
  r.set_last_checkpoint_step(s.checkpoints.last_step);
  r.set_world_size(config.distributed().world_size());
  r.set_rank(config.distributed().rank());
  r.set_pause_at_step(s.pause_at_step);
  return r;
}

AdminService::AdminService(Learner* learner, const IngestCounters* counters, const Metrics* metrics,
                           TokenAuthorizer* authorizer)
    : learner_(learner), counters_(counters), metrics_(metrics), authorizer_(authorizer) {}

grpc::ServerUnaryReactor* AdminService::Status(grpc::CallbackServerContext* context,
                                               const v1::StatusRequest* /*request*/, v1::StatusResponse* response) {
  *response = BuildStatus(learner_->status(), *counters_, learner_->config(), metrics_->recent_step_seconds());
  // Access to Status itself was decided by the token check (server/security.h);
  // this only leaves out what an observer may not read.
  if (!CallerIsAdmin(*context, authorizer_)) {
    response->clear_config();
    response->set_config_redacted(true);
  }
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::Checkpoint(grpc::CallbackServerContext* context,
                                                   const v1::CheckpointRequest* request,
                                                   v1::CheckpointResponse* response) {
  auto* reactor = context->DefaultReactor();
  if (!request->name().empty()) {
    if (absl::Status st = ValidateCheckpointName(request->name()); !st.ok()) {
      reactor->Finish(ToGrpcStatus(st));
      return reactor;
    }
  }
  if (!learner_->status().checkpoints_enabled) {
    reactor->Finish(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                 "checkpoints are not enabled: qstreamd runs without --checkpoint_dir"));
    return reactor;
  }
  // Answers once the write is done; the writer thread finishes the call.
  learner_->RequestCheckpoint(request->name(), [reactor, response](const absl::StatusOr<CheckpointWriteResult>& r) {
    if (!r.ok()) {
      // The full error (with host paths) is in the daemon's log only.
      reactor->Finish(grpc::Status(ToGrpcStatus(r.status()).error_code(),
                                   absl::StrCat("checkpoint failed (", absl::StatusCodeToString(r.status().code()),
                                                "); the daemon log has the details")));
      return;
    }
    response->set_name(r->name);
    response->set_learner_steps(r->learner_step);
    response->set_bytes(r->bytes);
    response->set_seconds(r->seconds);
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::Pause(grpc::CallbackServerContext* context,
                                              const v1::PauseRequest* request,
                                              v1::PauseResponse* /*response*/) {
  auto* reactor = context->DefaultReactor();
  const int64_t at_step = request->at_step();
  if (at_step < 0) {
    reactor->Finish({grpc::StatusCode::INVALID_ARGUMENT, "at_step: must be >= 0"});
    return reactor;
  }
  if (at_step == 0 && learner_->config().distributed().world_size() > 1) {
    // Every step all-reduces: a rank stopping at its own count would leave
    // the others waiting inside the collective.
    reactor->Finish({grpc::StatusCode::FAILED_PRECONDITION,
                     "at_step: a rank of a data-parallel group pauses at a step, the same on every rank "
                     "(e.g. a little past the highest learner_steps of the ranks' Status), not at once"});
    return reactor;
  }
  if (at_step > 0) {
    learner_->PauseAtStep(at_step);
  } else {
    learner_->Pause();
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::Resume(grpc::CallbackServerContext* context,
                                               const v1::ResumeRequest* /*request*/,
                                               v1::ResumeResponse* /*response*/) {
  learner_->Resume();
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace qstream
