// PolicyWatcher: holds the latest policy snapshot of a daemon. Create()
// fetches one with GetPolicy; a background thread owned by the watcher then
// follows WatchPolicy (reconnecting with backoff) and swaps in every newer
// version; a refused token ends the watch. The destructor cancels the watch
// and joins the thread.
#pragma once

#include <cstdint>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "clients/policy/network.h"
#include "grpcpp/grpcpp.h"
#include "qstream/v1/policy.grpc.pb.h"

namespace qstream::actor {

// Version, network and weights of one published policy.
using PolicySnapshot = policy::Policy;

// Checks the architecture and the weight count of a wire policy.
absl::StatusOr<std::shared_ptr<const PolicySnapshot>> SnapshotFromProto(const v1::Policy& policy);

class PolicyWatcher {
 public:
  // Retries GetPolicy until it succeeds or `connect_timeout` passes; fails at
  // once when the daemon refuses the channel's token (UNAUTHENTICATED,
  // PERMISSION_DENIED).
  static absl::StatusOr<std::unique_ptr<PolicyWatcher>> Create(std::shared_ptr<grpc::Channel> channel,
                                                               absl::Duration connect_timeout);
  ~PolicyWatcher();
  PolicyWatcher(const PolicyWatcher&) = delete;
  PolicyWatcher& operator=(const PolicyWatcher&) = delete;

  std::shared_ptr<const PolicySnapshot> Latest() const;

 private:
  PolicyWatcher(std::shared_ptr<grpc::Channel> channel, std::shared_ptr<const PolicySnapshot> first);
  void WatchLoop();
  void Store(std::shared_ptr<const PolicySnapshot> snapshot);

  std::unique_ptr<v1::PolicyService::Stub> stub_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const PolicySnapshot> latest_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The context of the open WatchPolicy call, so the destructor can cancel it.
  grpc::ClientContext* watch_context_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::thread thread_;
};

}  // namespace qstream::actor
