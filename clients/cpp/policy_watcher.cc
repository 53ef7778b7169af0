#include "clients/cpp/policy_watcher.h"

#include <algorithm>
#include <chrono>
#include <iostream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "clients/cpp/channel.h"

namespace qstream::actor {
namespace {

constexpr absl::Duration kInitialBackoff = absl::Milliseconds(100);
constexpr absl::Duration kMaxBackoff = absl::Seconds(2);

}  // namespace

absl::StatusOr<std::shared_ptr<const PolicySnapshot>> SnapshotFromProto(const v1::Policy& policy) {
  absl::StatusOr<PolicySnapshot> snap = PolicySnapshot::FromProto(policy);
  if (!snap.ok()) {
    return snap.status();
  }
  return std::make_shared<const PolicySnapshot>(*std::move(snap));
}

absl::StatusOr<std::unique_ptr<PolicyWatcher>> PolicyWatcher::Create(std::shared_ptr<grpc::Channel> channel,
                                                                     absl::Duration connect_timeout) {
  auto stub = v1::PolicyService::NewStub(channel);
  const absl::Time deadline = absl::Now() + connect_timeout;
  absl::Duration backoff = kInitialBackoff;
  while (true) {
    // Not wait_for_ready: a failed connection attempt fails the call with
    // gRPC's reason (refused, TLS handshake), which the last error keeps.
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(std::max(deadline, absl::Now() + kInitialBackoff)));
    v1::Policy policy;
    grpc::Status s = stub->GetPolicy(&ctx, v1::GetPolicyRequest(), &policy);
    if (s.ok()) {
      auto snap = SnapshotFromProto(policy);
      if (!snap.ok()) {
        return snap.status();
      }
      return std::unique_ptr<PolicyWatcher>(new PolicyWatcher(std::move(channel), *std::move(snap)));
    }
    if (IsTokenRefused(s.error_code())) {
      return TokenRefusedError("GetPolicy", s);
    }
    if (absl::Now() + backoff >= deadline) {
      return absl::UnavailableError(absl::StrCat(
          "GetPolicy failed for ", absl::FormatDuration(connect_timeout), ": ", s.error_message()));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

PolicyWatcher::PolicyWatcher(std::shared_ptr<grpc::Channel> channel,
                             std::shared_ptr<const PolicySnapshot> first)
    : stub_(v1::PolicyService::NewStub(std::move(channel))), latest_(std::move(first)) {
  thread_ = std::thread([this] { WatchLoop(); });
}

PolicyWatcher::~PolicyWatcher() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (watch_context_ != nullptr) {
      watch_context_->TryCancel();
    }
  }
  thread_.join();
}

std::shared_ptr<const PolicySnapshot> PolicyWatcher::Latest() const {
  absl::MutexLock lock(&mu_);
  return latest_;
}

void PolicyWatcher::Store(std::shared_ptr<const PolicySnapshot> snapshot) {
  absl::MutexLock lock(&mu_);
  if (snapshot->version > latest_->version) {
    latest_ = std::move(snapshot);
  }
}

void PolicyWatcher::WatchLoop() {
  absl::Duration backoff = kInitialBackoff;
  while (true) {
    grpc::ClientContext ctx;
    v1::WatchPolicyRequest request;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) {
        return;
      }
      watch_context_ = &ctx;
      request.set_after_version(latest_->version);
    }
    auto reader = stub_->WatchPolicy(&ctx, request);
    v1::Policy policy;
    while (reader->Read(&policy)) {
      auto snap = SnapshotFromProto(policy);
      if (!snap.ok()) {
        std::cerr << "qstream-actor: ignoring policy: " << snap.status().message() << "\n";
        continue;
      }
      Store(*std::move(snap));
      backoff = kInitialBackoff;
    }
    grpc::Status status = reader->Finish();
    absl::MutexLock lock(&mu_);
    watch_context_ = nullptr;
    if (stopping_) {
      return;
    }
    if (IsTokenRefused(status.error_code())) {
      // The experience stream sees the same refusal and ends the actor.
      std::cerr << "qstream-actor: " << TokenRefusedError("WatchPolicy", status).message()
                << "; no more policy updates\n";
      return;
    }
    // The daemon may be restarting: wait, but wake at once on shutdown.
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), backoff);
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

}  // namespace qstream::actor
