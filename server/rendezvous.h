// Forming a data-parallel group (config distributed; README "Scale-out").
//
// Rank 0 makes the group's NCCL unique id and serves it with
// qstream.v1.RendezvousService on distributed.rendezvous_listen (default
// 0.0.0.0:<port of rendezvous_address>), behind the gRPC port's TLS and
// tokens (Join needs role admin). Every other rank calls Join once, before it
// creates its NCCL communicator. Join is a barrier: it answers when all
// world_size - 1 ranks have joined, so every rank then creates its
// communicator at about the same time, and a missing rank becomes a clear
// DEADLINE_EXCEEDED naming it on every rank instead of a hang inside NCCL.
// A join with another world size, a rank out of range or a learner config
// that differs from rank 0's (the field is named) is refused. Once the group
// has formed, later joins (a restarted rank) get FAILED_PRECONDITION: an
// NCCL group cannot take a rank back, the whole group restarts.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "qstream/v1/config.pb.h"
#include "server/security.h"

namespace qstream {

class RendezvousServer {
 public:
  struct Options {
    std::string listen;        // host:port (port 0: any free port)
    v1::TrainerConfig config;  // rank 0's: world size and the learner config joins must share
    std::string unique_id;     // what Join hands out
    SecurityOptions security;
    std::shared_ptr<TokenAuthorizer> authorizer;  // may be null
  };
  static absl::StatusOr<std::unique_ptr<RendezvousServer>> Start(const Options& options);
  ~RendezvousServer();  // answers pending joins UNAVAILABLE, then shuts down

  int port() const { return port_; }
  // Waits until ranks 1..world_size-1 have joined (OK), or `timeout`:
  // DEADLINE_EXCEEDED naming the ranks still missing, or `cancelled()` (checked
  // a few times a second; may be empty): CANCELLED. Joins then stop waiting
  // with the same error.
  absl::Status AwaitGroup(absl::Duration timeout, const std::function<bool()>& cancelled = {});

  class Service;

 private:
  RendezvousServer() = default;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

struct JoinOptions {
  std::string address;       // rank 0's rendezvous, host:port
  v1::TrainerConfig config;  // this rank's (world size, rank, learner config)
  // TLS to rank 0 when set: the CA that signed its certificate; the client
  // certificate (mTLS) is tls_cert/tls_key when given.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string token_file;  // admin token when rank 0 has --auth_tokens
  absl::Duration timeout = absl::Minutes(5);
  // Between attempts while rank 0 cannot be reached.
  absl::Duration retry_interval = absl::Milliseconds(500);
  // Checked between attempts (may be empty): true gives up with CANCELLED
  // (qstreamd: SIGTERM or SIGINT arrived while waiting).
  std::function<bool()> cancelled;
};

// Rank > 0: joins rank 0's group, retrying while rank 0 is unreachable, and
// returns the group's NCCL unique id. Errors: rank 0's refusal (its
// message), or DEADLINE_EXCEEDED after `timeout` saying what was tried.
absl::StatusOr<std::string> JoinGroup(const JoinOptions& options);

}  // namespace qstream
