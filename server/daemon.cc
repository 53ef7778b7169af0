#include "server/daemon.h"

#include <unistd.h>

#include <cstdio>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"
#include "qstream/version.h"
#include "spdlog/spdlog.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"

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

// Takes gRPC's reflection plugin off a builder: libgrpc++_reflection
// registers it for every server at load time, and reflection is served only
// with --reflection.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments* /*args*/) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    std::erase_if(*plugins, [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
      return dynamic_cast<grpc::reflection::ProtoServerReflectionPlugin*>(p.get()) != nullptr;
    });
  }
};

// Answers every method of the health-only port but health with UNIMPLEMENTED.
// (A server must hold one callback service for gRPC to run the default
// health service without a completion queue of its own.)
class UnimplementedService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    class Reactor final : public grpc::ServerGenericBidiReactor {
     public:
      explicit Reactor(const std::string& method) {
        Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                            absl::StrCat(method, ": this port serves grpc.health.v1.Health only")));
      }
      void OnDone() override { delete this; }
    };
    return new Reactor(context->method());
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  if (auto st = ValidateConfig(options.config); !st.ok()) return st;
  if (auto st = CheckSecurityOptions(options.security, options.listen); !st.ok()) return st;
  std::shared_ptr<TokenAuthorizer> authorizer;
  if (!options.security.auth_tokens.empty()) {
    auto created = TokenAuthorizer::Create(options.security.auth_tokens);
    if (!created.ok()) return created.status();
    authorizer = std::move(*created);
  }
  if (options.restore == "latest" && options.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError("--restore=latest: needs --checkpoint_dir");
  }
  auto spec = NetworkSpec::Create(options.config.network());
  if (!spec.ok()) return spec.status();
  const auto& dist = options.config.distributed();
  std::optional<DistributedGroup> group;
  std::unique_ptr<RendezvousServer> rendezvous;
  if (dist.world_size() > 1) {
    if (options.backend == BackendKind::kCpu) {
      return absl::FailedPreconditionError(
          "distributed.world_size > 1: a data-parallel group needs the CUDA backend (NCCL), not "
          "--backend=cpu");
    }
    auto formed = FormGroup(options, authorizer, &rendezvous);
    if (!formed.ok()) return formed.status();
    group = *std::move(formed);
  }
  auto backend = CreateBackend(options.config, options.backend, group.has_value() ? &*group : nullptr);
  if (!backend.ok()) return backend.status();
  auto learner = Learner::Create(options.config, std::move(*backend));
  if (!learner.ok()) return learner.status();

  std::unique_ptr<Daemon> d(new Daemon(options));
  d->learner_ = std::move(*learner);
  d->rendezvous_ = std::move(rendezvous);
  d->authorizer_ = authorizer;
  if (!options.checkpoint_dir.empty()) {
    Daemon* raw = d.get();
    // The ingest sessions are part of every snapshot (consistent with the replay).
    d->learner_->EnableCheckpoints(options.checkpoint_dir, [raw](v1::CheckpointManifest* manifest) {
      if (raw->sessions_) raw->sessions_->Save(manifest->mutable_ingest());
    });
  }
  MetricsOptions metrics_options = options.metrics;
  if (group.has_value()) metrics_options.const_labels["rank"] = absl::StrCat(dist.rank());
  auto metrics = Metrics::Create(metrics_options, d->learner_.get(), &d->counters_);
  if (!metrics.ok()) return metrics.status();
  d->metrics_ = std::move(*metrics);
  const AuthFailureCounters auth_failures = AddAuthFailureMetric(d->metrics_->registry().get());
  if (authorizer) authorizer->ExportFailures(auth_failures);
  d->sessions_ = std::make_unique<IngestSessions>(d->learner_.get(), *spec, options.config, &d->counters_);
  d->sessions_->Start();
  d->experience_ = std::make_unique<ExperienceService>(d->learner_.get(), *spec, &d->counters_, d->sessions_.get());
  d->policy_ = std::make_unique<PolicyService>(d->learner_.get());
  d->admin_ = std::make_unique<AdminService>(d->learner_.get(), &d->counters_, d->metrics_.get(),
                                             authorizer.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (!options.security.reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  builder.AddListeningPort(options.listen, MakeServerCredentials(options.security, options.listen, authorizer),
                           &d->grpc_port_);
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
  if (!options.health_listen.empty()) {
    // Health alone, plaintext, for probes that cannot speak TLS (kubelet).
    grpc::ServerBuilder health_builder;
    health_builder.SetOption(std::make_unique<WithoutReflection>());
    static UnimplementedService unimplemented;
    health_builder.RegisterCallbackGenericService(&unimplemented);
    health_builder.AddListeningPort(options.health_listen, grpc::InsecureServerCredentials(), &d->health_port_);
    d->health_server_ = health_builder.BuildAndStart();
    if (d->health_server_ == nullptr || d->health_port_ == 0) {
      d->Shutdown(absl::ZeroDuration());
      return absl::UnavailableError(absl::StrCat("--health_listen=", options.health_listen, ": cannot bind"));
    }
  }
  d->SetServing(/*serving=*/false, /*live=*/true);
  if (!options.restore.empty()) {
    if (absl::Status st = d->Restore(); !st.ok()) {
      d->write_final_checkpoint_ = false;  // never write over what could not be read
      d->Shutdown(absl::ZeroDuration());
      return st;
    }
  }
  if (group.has_value()) {
    // Rank 0's network (restored or fresh) becomes every rank's.
    if (absl::Status st = d->learner_->SyncGroup(); !st.ok()) {
      d->Shutdown(absl::ZeroDuration());
      return st;
    }
    spdlog::info("distributed: rank {} of {} in step with rank 0 at learner step {}", dist.rank(),
                 dist.world_size(), d->learner_->status().steps);
  }
  Daemon* raw = d.get();
  d->health_ = std::make_unique<HealthMonitor>(
      d->learner_.get(), options.config.server().liveness_timeout_seconds(), options.health_check_period,
      [raw](bool serving, bool live) { raw->SetServing(serving, live); });
  d->metrics_->SetServingSource([raw] { return raw->health_->serving(); });
  d->learner_->SetHaltListener([raw](bool halted) { raw->health_->SetHalted(halted); });
  if (options.start_paused) d->learner_->Pause();
  d->learner_->Start();
  d->metrics_->Start(absl::StrCat(Hostname(), ":", d->grpc_port_));
  d->experience_->Open();
  d->policy_->Open();
  d->health_->Start();
  return d;
}

Daemon::~Daemon() { Shutdown(absl::ZeroDuration()); }

void Daemon::SetServing(bool serving, bool live) {
  for (grpc::Server* s : {server_.get(), health_server_.get()}) {
    if (s == nullptr) continue;
    s->GetHealthCheckService()->SetServingStatus(serving);
    s->GetHealthCheckService()->SetServingStatus(kLivenessService, live);
  }
}

absl::Status Daemon::Reload() {
  absl::Status tokens = authorizer_ ? authorizer_->Reload() : absl::OkStatus();
  absl::Status metrics_auth = metrics_->ReloadAuth();
  if (tokens.ok()) return metrics_auth;
  if (!metrics_auth.ok()) return absl::Status(tokens.code(), absl::StrCat(tokens.message(), "; ", metrics_auth.message()));
  return tokens;
}

void Daemon::Shutdown(absl::Duration deadline) {
  if (shut_down_) return;
  shut_down_ = true;
  if (server_ == nullptr) {  // Start() failed after creating the learner
    if (metrics_) metrics_->Stop();
    if (learner_) learner_->Stop();
    return;
  }
  if (health_) health_->Stop();
  server_->GetHealthCheckService()->Shutdown();
  if (health_server_) {
    health_server_->GetHealthCheckService()->Shutdown();
    health_server_->Shutdown(absl::ToChronoTime(absl::Now()));
  }
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
  sessions_->Stop();
  if (absl::Status st = write_final_checkpoint_ ? learner_->WriteFinalCheckpoint() : absl::OkStatus(); !st.ok()) {
    spdlog::error("final checkpoint failed: {}", st.ToString());
  }
  shutdown_thread.join();
  server_->Wait();
  metrics_->Stop();
}

absl::StatusOr<DistributedGroup> Daemon::FormGroup(const DaemonOptions& options,
                                                   std::shared_ptr<TokenAuthorizer> authorizer,
                                                   std::unique_ptr<RendezvousServer>* rendezvous) {
  const auto& dist = options.config.distributed();
  const absl::Duration timeout = absl::Seconds(dist.rendezvous_timeout_seconds());
  DistributedGroup group;
  group.world_size = dist.world_size();
  group.rank = dist.rank();
  if (dist.rank() == 0) {
    std::string listen = dist.rendezvous_listen();
    if (listen.empty()) {
      const size_t colon = dist.rendezvous_address().rfind(':');
      listen = absl::StrCat("0.0.0.0:",
                            colon == std::string::npos ? "" : dist.rendezvous_address().substr(colon + 1));
    }
    if (absl::Status st = CheckSecurityOptions(options.security, listen); !st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat("distributed.rendezvous_listen=", listen, ": ", st.message()));
    }
    auto id = NewGroupId();
    if (!id.ok()) return id.status();
    RendezvousServer::Options ro;
    ro.listen = listen;
    ro.config = options.config;
    ro.unique_id = *id;
    ro.security = options.security;
    ro.authorizer = std::move(authorizer);
    auto server = RendezvousServer::Start(ro);
    if (!server.ok()) return server.status();
    spdlog::info("distributed: rank 0 of {}, rendezvous on port {}; waiting for the other ranks",
                 dist.world_size(), (*server)->port());
    if (absl::Status st = (*server)->AwaitGroup(timeout, options.cancelled); !st.ok()) return st;
    group.nccl_unique_id = *id;
    *rendezvous = *std::move(server);
  } else {
    JoinOptions jo;
    jo.address = dist.rendezvous_address();
    jo.config = options.config;
    jo.tls_ca_file = options.rendezvous_tls_ca;
    jo.tls_cert_file = options.security.tls_cert;
    jo.tls_key_file = options.security.tls_key;
    jo.token_file = options.rendezvous_token_file;
    jo.timeout = timeout;
    jo.cancelled = options.cancelled;
    auto id = JoinGroup(jo);
    if (!id.ok()) return id.status();
    group.nccl_unique_id = *id;
  }
  spdlog::info("distributed: group of {} formed; rank {} creates its NCCL communicator", group.world_size,
               group.rank);
  return group;
}

absl::Status Daemon::Restore() {
  const auto start = absl::Now();
  absl::StatusOr<CheckpointData> data;
  std::string dir;
  if (options_.restore == "latest") {
    std::vector<std::string> refused;
    data = ReadLatestCheckpoint(options_.checkpoint_dir, options_.config, &refused, &dir);
    for (const std::string& r : refused) spdlog::warn("restore: refused {}", r);
    if (absl::IsNotFound(data.status()) && refused.empty()) {
      spdlog::info("restore: no checkpoint under {}, starting fresh", options_.checkpoint_dir);
      return absl::OkStatus();
    }
    if (!data.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("--restore=latest: no usable checkpoint under ",
                                                        options_.checkpoint_dir, " (", refused.size(),
                                                        " refused): ", data.status().message()));
    }
  } else {
    dir = options_.restore;
    data = ReadCheckpoint(dir);
    if (!data.ok()) return absl::Status(data.status().code(), absl::StrCat("--restore=", dir, ": ", data.status().message()));
  }
  if (absl::Status st = learner_->Restore(*data); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("restore ", dir, ": ", st.message()));
  }
  if (sessions_) {
    if (absl::Status st = sessions_->Restore(data->manifest.ingest()); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("restore ", dir, ": ingest sessions: ", st.message()));
    }
  }
  restored_from_ = dir;
  const LearnerStatus s = learner_->status();
  spdlog::info(
      "restored {}: learner step {}, policy v{}, replay {} transitions, {} ingest sessions, in {:.2f} s", dir,
      s.steps, s.policy_version, s.replay_size, data->manifest.ingest().sessions_size(),
      absl::ToDoubleSeconds(absl::Now() - start));
  return absl::OkStatus();
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
                      " metrics=", metrics_address().empty() ? "off" : metrics_address(),
                      " security=", SecuritySummary(options_.security, authorizer_.get()),
                      health_server_ ? absl::StrCat(" health=", AddressHost(options_.health_listen), ":", health_port_)
                                     : "");
}

}  // namespace qstream
