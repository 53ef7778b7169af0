// Daemon: the whole qstreamd service in one object (learner, gRPC server with
// ExperienceService, PolicyService, AdminService, health and optional
// reflection behind the security of server/security.h, and the metrics export), started and shut down in the right order. Used by
// qstreamd's main and by the in-process ingest benchmark.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "qstream/v1/config.pb.h"
#include "server/admin_service.h"
#include "server/experience_service.h"
#include "server/health_monitor.h"
#include "server/ingest_counters.h"
#include "server/ingest_sessions.h"
#include "server/metrics.h"
#include "server/policy_service.h"
#include "server/rendezvous.h"
#include "server/security.h"
#include "trainer/backends/backend_factory.h"
#include "trainer/learner.h"

namespace qstream {

struct DaemonOptions {
  v1::TrainerConfig config;
  BackendKind backend = BackendKind::kAuto;
  // gRPC address, host:port; port 0 picks a free port.
  std::string listen = "127.0.0.1:50051";
  // TLS, tokens, reflection (server/security.h). The default serves
  // plaintext to loopback peers only, without tokens.
  SecurityOptions security;
  // host:port of a plaintext port serving only grpc.health.v1.Health (the
  // same status), for probes that cannot speak TLS; empty: none.
  std::string health_listen;
  MetricsOptions metrics;
  // Checkpoint root (README "Checkpoints"); empty: no checkpoints.
  std::string checkpoint_dir;
  // "" starts fresh; "latest" restores the newest good checkpoint under
  // checkpoint_dir (fresh when it holds none); anything else is a checkpoint
  // directory to restore.
  std::string restore;
  // The learner starts paused (ingest runs; Admin.Resume starts training).
  bool start_paused = false;
  // How often the health monitor checks the learner's liveness
  // (server.liveness_timeout_seconds).
  absl::Duration health_check_period = absl::Seconds(1);
  // Data-parallel group (config distributed, ranks > 0): TLS to rank 0's
  // rendezvous when set (the CA of its certificate; security.tls_cert/key
  // are the client certificate), and the admin token it wants.
  std::string rendezvous_tls_ca;
  std::string rendezvous_token_file;
  // Checked while Start waits to form the group (may be empty): true stops
  // the wait with CANCELLED (qstreamd: a SIGTERM/SIGINT is pending).
  std::function<bool()> cancelled;
};

class Daemon {
 public:
  // Creates the backend and learner, binds the ports (health NOT_SERVING),
  // restores a checkpoint when asked, starts the learner and the metrics
  // thread, then reports SERVING on grpc.health.v1.Health.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);
  ~Daemon();  // Shutdown(0) when not shut down yet

  // NOT_SERVING; every actor stream ends once its batch in flight is acked
  // (idle ones and policy watchers at once); calls still open after
  // `deadline` are cancelled; then the learner stops (pending batches are
  // inserted), a final checkpoint is written (with --checkpoint_dir) and the
  // metrics stop after a last poll and push. Idempotent.
  void Shutdown(absl::Duration deadline);

  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }
  // "host:port" with the bound gRPC port.
  std::string grpc_address() const;
  std::string metrics_address() const;
  // The one start-up log line: version, backend, device, config, ports.
  std::string StartupLine() const;
  // SIGHUP: re-reads the token file and the /metrics auth file (the previous
  // ones stay on error).
  // Certificates are re-read by gRPC's file watcher on its own period.
  absl::Status Reload();
  // Null without --auth_tokens.
  const TokenAuthorizer* authorizer() const { return authorizer_.get(); }

  // "" or the checkpoint directory the daemon restored from.
  const std::string& restored_from() const { return restored_from_; }

  Learner* learner() { return learner_.get(); }
  const Metrics& metrics() const { return *metrics_; }
  const IngestCounters& counters() const { return counters_; }
  // Null before Start returns.
  const HealthMonitor* health() const { return health_.get(); }

 private:
  explicit Daemon(const DaemonOptions& options) : options_(options) {}
  // Health status ("" and "liveness") on the gRPC port and the --health_listen port.
  void SetServing(bool serving, bool live);
  // Loads options_.restore into the learner and the ingest sessions.
  absl::Status Restore();
  // Data-parallel group: rank 0 serves the rendezvous (kept in rendezvous_
  // to refuse late joins) and waits for every rank; the others join it.
  static absl::StatusOr<DistributedGroup> FormGroup(const DaemonOptions& options,
                                                    std::shared_ptr<TokenAuthorizer> authorizer,
                                                    std::unique_ptr<RendezvousServer>* rendezvous);

  const DaemonOptions options_;
  IngestCounters counters_;
  std::unique_ptr<Learner> learner_;
  std::unique_ptr<Metrics> metrics_;
  std::shared_ptr<TokenAuthorizer> authorizer_;
  std::unique_ptr<IngestSessions> sessions_;
  std::unique_ptr<ExperienceService> experience_;
  std::unique_ptr<PolicyService> policy_;
  std::unique_ptr<AdminService> admin_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;  // --health_listen
  std::unique_ptr<RendezvousServer> rendezvous_;  // rank 0 of a group
  std::unique_ptr<HealthMonitor> health_;
  int grpc_port_ = 0;
  int health_port_ = 0;
  bool shut_down_ = false;
  std::string restored_from_;
  bool write_final_checkpoint_ = true;
};

// The host part of a host:port address ("[::1]:5" -> "[::1]").
std::string AddressHost(const std::string& address);

}  // namespace qstream
