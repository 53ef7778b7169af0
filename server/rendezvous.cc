#include "server/rendezvous.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "clients/cpp/channel.h"
#include "grpcpp/server_builder.h"
#include "qstream/v1/rendezvous.grpc.pb.h"
#include "server/grpc_status.h"
#include "spdlog/spdlog.h"
#include "trainer/distributed.h"

namespace qstream {
namespace {
// Trailing metadata on every Join answer rank 0 gives.
constexpr char kAnsweredByRankZero[] = "qstream-rendezvous-answer";
}  // namespace

class RendezvousServer::Service final : public v1::RendezvousService::Service {
 public:
  Service(v1::TrainerConfig config, std::string unique_id)
      : config_(std::move(config)),
        world_size_(config_.distributed().world_size()),
        id_(std::move(unique_id)) {}

  grpc::Status Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                    v1::JoinResponse* response) override ABSL_LOCKS_EXCLUDED(mu_) {
    // Marks every answer as rank 0's own, so a joiner can tell a group failure
    // (even DEADLINE_EXCEEDED) from its own call's deadline.
    context->AddTrailingMetadata(kAnsweredByRankZero, "1");
    if (request->world_size() != world_size_) {
      return {grpc::StatusCode::FAILED_PRECONDITION,
              absl::StrCat("world_size: ", request->world_size(),
                           ", rank 0 has distributed.world_size = ", world_size_)};
    }
    if (request->rank() < 1 || request->rank() >= world_size_) {
      return {grpc::StatusCode::INVALID_ARGUMENT,
              absl::StrCat("rank: ", request->rank(), " is not in [1, ", world_size_, ")")};
    }
    if (absl::Status st = CheckGroupConfig(config_, request->learner_config(), request->rank()); !st.ok()) {
      spdlog::error("rendezvous: {}", std::string(st.message()));
      return ToGrpcStatus(st);
    }
    absl::MutexLock lock(&mu_);
    if (formed_) {
      return {grpc::StatusCode::FAILED_PRECONDITION,
              absl::StrCat("rank ", request->rank(),
                           ": the group has formed already; an NCCL group cannot take a rank back, restart "
                           "every rank")};
    }
    if (joined_.insert(request->rank()).second) {
      spdlog::info("rendezvous: rank {} joined ({} of {} ranks)", request->rank(), joined_.size() + 1,
                   world_size_);
    }
    // The barrier: answer once every rank is in (or the group failed).
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return formed_ || !failure_.ok() || static_cast<int>(joined_.size()) == world_size_ - 1;
    };
    while (!done()) {
      if (context->IsCancelled()) {
        return {grpc::StatusCode::CANCELLED, "join cancelled while waiting for the other ranks"};
      }
      mu_.AwaitWithTimeout(absl::Condition(&done), absl::Milliseconds(200));
    }
    if (!failure_.ok()) return ToGrpcStatus(failure_);
    response->set_nccl_unique_id(id_);
    response->set_world_size(world_size_);
    return grpc::Status::OK;
  }

  absl::Status AwaitGroup(absl::Duration timeout, const std::function<bool()>& cancelled)
      ABSL_LOCKS_EXCLUDED(mu_) {
    const absl::Time deadline = absl::Now() + timeout;
    absl::MutexLock lock(&mu_);
    auto all = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return static_cast<int>(joined_.size()) == world_size_ - 1 || !failure_.ok();
    };
    while (!all() && absl::Now() < deadline) {
      if (cancelled && cancelled()) {
        failure_ = absl::CancelledError("distributed: stopped while waiting for the other ranks to join");
        break;
      }
      mu_.AwaitWithDeadline(absl::Condition(&all), std::min(deadline, absl::Now() + absl::Milliseconds(200)));
    }
    if (!failure_.ok()) return failure_;
    if (static_cast<int>(joined_.size()) == world_size_ - 1) {
      formed_ = true;
      return absl::OkStatus();
    }
    std::vector<int> missing;
    for (int r = 1; r < world_size_; ++r) {
      if (!joined_.contains(r)) missing.push_back(r);
    }
    failure_ = absl::DeadlineExceededError(
        absl::StrCat("distributed: rank(s) ", absl::StrJoin(missing, ", "), " of ", world_size_,
                     " did not join rank 0's rendezvous within ", absl::FormatDuration(timeout),
                     " (distributed.rendezvous_timeout_seconds)"));
    return failure_;
  }

  void Fail(absl::Status why) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (failure_.ok() && !formed_) failure_ = std::move(why);
  }

 private:
  const v1::TrainerConfig config_;
  const int world_size_;
  const std::string id_;
  absl::Mutex mu_;
  std::set<int> joined_ ABSL_GUARDED_BY(mu_);
  bool formed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::unique_ptr<RendezvousServer>> RendezvousServer::Start(const Options& options) {
  std::unique_ptr<RendezvousServer> r(new RendezvousServer);
  r->service_ = std::make_unique<Service>(options.config, options.unique_id);
  grpc::ServerBuilder builder;
  // Two rank 0s on one address would split the joins, each with its own id.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(
      options.listen, MakeServerCredentials(options.security, options.listen, options.authorizer), &r->port_);
  builder.RegisterService(r->service_.get());
  r->server_ = builder.BuildAndStart();
  if (r->server_ == nullptr || r->port_ == 0) {
    if (r->server_) r->server_->Shutdown();
    return absl::UnavailableError(
        absl::StrCat("distributed.rendezvous_listen=", options.listen, ": cannot bind"));
  }
  return r;
}

RendezvousServer::~RendezvousServer() {
  if (service_) service_->Fail(absl::UnavailableError("rank 0 is shutting down"));
  if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
}

absl::Status RendezvousServer::AwaitGroup(absl::Duration timeout, const std::function<bool()>& cancelled) {
  return service_->AwaitGroup(timeout, cancelled);
}

absl::StatusOr<std::string> JoinGroup(const JoinOptions& options) {
  actor::ChannelOptions channel_options;
  channel_options.server = options.address;
  channel_options.tls_ca_file = options.tls_ca_file;
  if (!options.tls_ca_file.empty()) {
    channel_options.tls_cert_file = options.tls_cert_file;
    channel_options.tls_key_file = options.tls_key_file;
  }
  channel_options.token_file = options.token_file;
  auto channel = actor::CreateChannel(channel_options);
  if (!channel.ok()) return channel.status();
  auto stub = v1::RendezvousService::NewStub(*channel);
  v1::JoinRequest request;
  request.set_world_size(options.config.distributed().world_size());
  request.set_rank(options.config.distributed().rank());
  *request.mutable_learner_config() = GroupLearnerConfig(options.config);
  const absl::Time deadline = absl::Now() + options.timeout;
  std::string last;
  int attempts = 0;
  while (absl::Now() < deadline) {
    if (options.cancelled && options.cancelled()) {
      return absl::CancelledError("distributed: stopped while waiting for rank 0's rendezvous");
    }
    grpc::ClientContext context;
    // Short calls, so a stop request is seen while rank 0 waits for the others.
    const absl::Time attempt_deadline = std::min(deadline, absl::Now() + absl::Seconds(1));
    context.set_deadline(absl::ToChronoTime(attempt_deadline));
    v1::JoinResponse response;
    const grpc::Status status = stub->Join(&context, request, &response);
    ++attempts;
    if (status.ok()) {
      if (response.world_size() != request.world_size()) {
        return absl::FailedPreconditionError(absl::StrCat("distributed: rank 0 answered world_size ",
                                                          response.world_size(), ", this rank has ",
                                                          request.world_size()));
      }
      return response.nccl_unique_id();
    }
    last = absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())), ": ",
                        status.error_message());
    // Rank 0 not up yet, or still waiting for other ranks: ask again.
    // (Only this call's own deadline: a DEADLINE_EXCEEDED that rank 0
    // answers is the group's failure.)
    // gRPC's timer and absl::Now() need not agree to the microsecond, so the
    // marker rank 0 puts on every answer decides, not the clock.
    const bool attempt_timed_out = status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
                                   !context.GetServerTrailingMetadata().contains(kAnsweredByRankZero);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE && !attempt_timed_out) {
      // CANCELLED from rank 0 (it was stopped) must not read as this rank's own stop.
      const auto code = status.error_code() == grpc::StatusCode::CANCELLED
                            ? absl::StatusCode::kAborted
                            : static_cast<absl::StatusCode>(status.error_code());
      return absl::Status(code, absl::StrCat("distributed: rank 0's rendezvous at ", options.address,
                                             " refused the join: ", status.error_message()));
    }
    if (attempts == 1 || attempts % 20 == 0) {
      spdlog::info("distributed: waiting for rank 0's rendezvous at {} ({})", options.address, last);
    }
    if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
      absl::SleepFor(std::min(options.retry_interval, deadline - absl::Now()));
    }
  }
  return absl::DeadlineExceededError(
      absl::StrCat("distributed: no group from rank 0's rendezvous at ", options.address, " within ",
                   absl::FormatDuration(options.timeout), " (", attempts, " attempts; last: ", last, ")"));
}

}  // namespace qstream
