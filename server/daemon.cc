#include "server/daemon.h"

#include <unistd.h>

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "trainer/config.h"
#include "qstream/version.h"

namespace qstream {

std::string AddressHost(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

namespace {

std::string Hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  if (auto st = ValidateConfig(options.config); !st.ok()) return st;
  auto spec = NetworkSpec::Create(options.config.network());
  if (!spec.ok()) return spec.status();
  auto backend = CreateBackend(options.config, options.backend);
  if (!backend.ok()) return backend.status();
  auto learner = Learner::Create(options.config, std::move(*backend));
  if (!learner.ok()) return learner.status();

  std::unique_ptr<Daemon> d(new Daemon(options));
  d->learner_ = std::move(*learner);
  auto metrics = Metrics::Create(options.metrics, d->learner_.get(), &d->counters_);
  if (!metrics.ok()) return metrics.status();
  d->metrics_ = std::move(*metrics);
  d->experience_ = std::make_unique<ExperienceService>(d->learner_.get(), *spec, &d->counters_);
  d->policy_ = std::make_unique<PolicyService>(d->learner_.get());
  d->admin_ = std::make_unique<AdminService>(d->learner_.get(), &d->counters_, d->metrics_.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &d->grpc_port_);
  builder.SetMaxReceiveMessageSize(options.config.server().max_message_bytes());
  builder.RegisterService(d->experience_.get());
  builder.RegisterService(d->policy_.get());
  builder.RegisterService(d->admin_.get());
  d->server_ = builder.BuildAndStart();
  if (d->server_ == nullptr || d->grpc_port_ == 0) {
    if (d->server_) d->server_->Shutdown();
    d->server_.reset();
    return absl::UnavailableError(absl::StrCat("--listen=", options.listen, ": cannot bind"));
  }
  auto* health = d->server_->GetHealthCheckService();
  health->SetServingStatus(false);
  d->learner_->Start();
  d->metrics_->Start(absl::StrCat(Hostname(), ":", d->grpc_port_));
  health->SetServingStatus(true);
  return d;
}

Daemon::~Daemon() { Shutdown(absl::ZeroDuration()); }

void Daemon::Shutdown(absl::Duration deadline) {
  if (shut_down_) return;
  shut_down_ = true;
  if (server_ == nullptr) {  // Start() failed after creating the learner
    if (metrics_) metrics_->Stop();
    if (learner_) learner_->Stop();
    return;
  }
  server_->GetHealthCheckService()->Shutdown();
  experience_->BeginShutdown();
  policy_->BeginShutdown();
  // Streams drain while the learner still runs and acks their batches. If a
  // stream's batch is held back (learner paused or throttled), Stop() below
  // inserts it, which lets the server's shutdown complete.
  absl::Notification server_down;
  std::thread shutdown_thread([this, deadline, &server_down] {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
    server_down.Notify();
  });
  server_down.WaitForNotificationWithTimeout(deadline + absl::Seconds(1));
  learner_->Stop();
  shutdown_thread.join();
  server_->Wait();
  metrics_->Stop();
}

std::string Daemon::grpc_address() const { return absl::StrCat(AddressHost(options_.listen), ":", grpc_port_); }

std::string Daemon::metrics_address() const {
  if (!metrics_ || metrics_->port() == 0) return "";
  return absl::StrCat(AddressHost(options_.metrics.listen), ":", metrics_->port());
}

std::string Daemon::StartupLine() const {
  const LearnerStatus s = learner_->status();
  return absl::StrCat("qstreamd ", QSTREAM_VERSION, " (", QSTREAM_GIT_COMMIT, ") backend=", s.backend, " device=\"",
                      s.device, "\" config: ", ConfigSummary(options_.config), " | listening grpc=", grpc_address(),
                      " metrics=", metrics_address().empty() ? "off" : metrics_address());
}

}  // namespace qstream
