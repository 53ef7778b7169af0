#include "server/policy_service.h"

#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/grpc_status.h"
#include "server/validate.h"

namespace qstream {

void SnapshotToProto(const PolicySnapshot& snapshot, v1::Policy* policy) {
  policy->set_version(snapshot.version);
  policy->set_learner_steps(snapshot.learner_steps);
  *policy->mutable_architecture() = snapshot.spec.ToArchitecture();
  policy->mutable_weights()->Assign(snapshot.params.begin(), snapshot.params.end());
}

// Writes each snapshot newer than the last one queued, at most one write in
// flight; a burst of versions during a slow write collapses to the newest.
class PolicyService::WatchReactor final : public grpc::ServerWriteReactor<v1::Policy> {
 public:
  WatchReactor(PolicyService* service, int64_t after_version)
      : service_(service), learner_(service->learner_), link_(std::make_shared<Link>()),
        last_queued_(after_version) {
    link_->reactor = this;
    // The listener holds the link, never the reactor: after OnDone detaches
    // it, a snapshot published concurrently finds no reactor to write to.
    listener_id_ = learner_->AddPolicyListener(
        [link = link_](std::shared_ptr<const PolicySnapshot> snapshot) { link->Deliver(std::move(snapshot)); });
    Offer(learner_->policy());
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "watcher gone"));
      return;
    }
    std::shared_ptr<const PolicySnapshot> next;
    {
      absl::MutexLock lock(&mu_);
      if (!finished_) next = std::move(next_);
      next_ = nullptr;
      writing_ = next != nullptr;
    }
    if (next) Write(*next);
  }

  void OnCancel() override { FinishOnce(grpc::Status::CANCELLED); }

  void OnDone() override {
    service_->Unregister(this);
    link_->Detach();
    learner_->RemovePolicyListener(listener_id_);
    delete this;
  }

 private:
  struct Link {
    absl::Mutex mu;
    WatchReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;
    void Deliver(std::shared_ptr<const PolicySnapshot> snapshot) {
      absl::MutexLock lock(&mu);
      if (reactor != nullptr) reactor->Offer(std::move(snapshot));
    }
    void Detach() {
      absl::MutexLock lock(&mu);
      reactor = nullptr;
    }
  };

  void Offer(std::shared_ptr<const PolicySnapshot> snapshot) {
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || snapshot == nullptr || snapshot->version <= last_queued_) return;
      last_queued_ = snapshot->version;
      if (writing_) {
        next_ = std::move(snapshot);
        return;
      }
      writing_ = true;
    }
    Write(*snapshot);
  }

  void Write(const PolicySnapshot& snapshot) {
    message_.Clear();
    SnapshotToProto(snapshot, &message_);
    StartWrite(&message_);
  }

  void FinishOnce(grpc::Status status) {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
    }
    Finish(std::move(status));
  }

  PolicyService* const service_;
  Learner* const learner_;
  const std::shared_ptr<Link> link_;
  int64_t listener_id_ = 0;
  absl::Mutex mu_;
  int64_t last_queued_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const PolicySnapshot> next_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  v1::Policy message_;  // the write in flight
};

namespace {
constexpr char kStarting[] = "qstreamd is starting (restoring a checkpoint); retry";
}  // namespace

PolicyService::PolicyService(Learner* learner) : learner_(learner), config_(learner->config()) {}

grpc::ServerUnaryReactor* PolicyService::GetPolicy(grpc::CallbackServerContext* context,
                                                   const v1::GetPolicyRequest* /*request*/, v1::Policy* response) {
  auto* reactor = context->DefaultReactor();
  if (!opened()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, kStarting));
    return reactor;
  }
  auto snapshot = learner_->policy();
  if (snapshot == nullptr) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "no policy published yet"));
    return reactor;
  }
  SnapshotToProto(*snapshot, response);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

namespace {

class RefuseWatch final : public grpc::ServerWriteReactor<v1::Policy> {
 public:
  explicit RefuseWatch(const char* why) { Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, why)); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerWriteReactor<v1::Policy>* PolicyService::WatchPolicy(grpc::CallbackServerContext* context,
                                                                 const v1::WatchPolicyRequest* request) {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return new RefuseWatch("qstreamd is shutting down");
  if (!opened()) return new RefuseWatch(kStarting);
  auto* watcher = new WatchReactor(this, request->after_version());
  watchers_.emplace(watcher, context);
  return watcher;
}

void PolicyService::BeginShutdown() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
  for (const auto& [watcher, context] : watchers_) context->TryCancel();
}

void PolicyService::Unregister(WatchReactor* watcher) {
  absl::MutexLock lock(&mu_);
  watchers_.erase(watcher);
}

grpc::ServerUnaryReactor* PolicyService::Evaluate(grpc::CallbackServerContext* context,
                                                  const v1::EvaluateRequest* request,
                                                  v1::EvaluateResponse* response) {
  auto* reactor = context->DefaultReactor();
  if (!opened()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, kStarting));
    return reactor;
  }
  const int64_t n = request->count();
  const int obs_dim = config_.network().obs_dim();
  const int64_t max_n = config_.server().max_evaluate_observations();
  grpc::Status status;
  int64_t bad = -1;
  if (n == 0 || n > max_n) {
    status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("count: ", n, " not in [1, server.max_evaluate_observations = ", max_n, "]"));
  } else if (request->obs_size() != n * obs_dim) {
    status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("obs: ", request->obs_size(), " values, expected count x obs_dim = ", n,
                                       " x ", obs_dim, " = ", n * obs_dim));
  } else if ((bad = FirstNonFinite(request->obs().data(), request->obs_size())) >= 0) {
    status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("obs[", bad, "]: ", request->obs(static_cast<int>(bad)), " is not finite"));
  } else {
    const auto snapshot = learner_->policy();
    std::vector<float> q;
    status = ToGrpcStatus(learner_->ComputeQ(request->obs().data(), n, &q));
    if (status.ok()) {
      response->set_version(snapshot ? snapshot->version : 0);
      response->mutable_q()->Assign(q.begin(), q.end());
    }
  }
  reactor->Finish(status);
  return reactor;
}

}  // namespace qstream
