// qstreamd: trains a C51 DQN from experience streamed by actors over gRPC.
// SIGHUP re-reads the token and metrics auth files. Exit codes: 0 after a
// clean shutdown on SIGINT/SIGTERM, 1 when a port or the backend cannot be
// set up, 2 for bad flags, config or security options.
#include <malloc.h>
#include <signal.h>

#include <cstdio>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "server/daemon.h"
#include "spdlog/spdlog.h"
#include "trainer/config.h"

ABSL_FLAG(std::string, config, "", "Text-format TrainerConfig file; empty: built-in default");
ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "gRPC listen address host:port (port 0: any free port)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "Prometheus /metrics address host:port (port 0: any free port); empty disables");
ABSL_FLAG(std::string, metrics_auth_file, "",
          "File of one `user password` or `user sha256:<hex>` line: /metrics then needs that basic auth. "
          "Empty: no auth");
ABSL_FLAG(int, metrics_threads, qstream::MetricsOptions().threads,
          "/metrics worker threads: connections served at once (a slow client holds one)");
ABSL_FLAG(absl::Duration, metrics_request_timeout, qstream::MetricsOptions().request_timeout,
          "A /metrics connection that has not sent its request, or taken its response, in this time "
          "is closed");
ABSL_FLAG(std::string, backend, "auto", "auto|cpu|cuda");
ABSL_FLAG(std::string, pushgateway, "", "Pushgateway host:port; empty disables pushing");
ABSL_FLAG(absl::Duration, push_interval, absl::Seconds(10), "Pushgateway push period");
ABSL_FLAG(std::string, instance, "", "instance label of pushed metrics; default hostname:grpc_port");
ABSL_FLAG(std::string, push_job, qstream::MetricsOptions().push_job,
          "job label of pushed metrics (keep it apart from the scrape job's, e.g. qstream)");
ABSL_FLAG(
    std::string, log_format, "text",
    "text: `<UTC time> <I|W|E> qstreamd: <message>` lines; json: one {\"time\",\"level\",\"msg\"} object "
    "per line. On stderr");
ABSL_FLAG(std::string, log_level, "info", "trace|debug|info|warning|error|critical|off");
ABSL_FLAG(absl::Duration, shutdown_deadline, absl::Seconds(5),
          "On SIGINT/SIGTERM, how long open streams may drain before they are cancelled");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Directory for checkpoints (created 0700); empty: no checkpoints. See README \"Checkpoints\"");
ABSL_FLAG(std::string, restore, "",
          "latest: continue from the newest good checkpoint under --checkpoint_dir (fresh when none); "
          "DIR: from that checkpoint directory; empty: start fresh");
// Security (README "Security"). Secrets are read from files, never taken on
// the command line.
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain of the gRPC port; with --tls_key turns TLS on");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; clients must present a certificate it verifies (mTLS)");
ABSL_FLAG(absl::Duration, tls_reload_interval, absl::Seconds(60),
          "How often gRPC re-reads the TLS files (new connections use the new ones; open streams stay)");
ABSL_FLAG(std::string, auth_tokens, "",
          "Token file: `<role> <token>` or `<role> sha256:<hex>` a line, roles actor|observer|admin; "
          "re-read on SIGHUP. Empty: no tokens");
ABSL_FLAG(bool, allow_insecure, false,
          "Allow a non-loopback --listen without TLS, or without any client authentication");
ABSL_FLAG(
    std::string, health_listen, "",
    "host:port of a plaintext port serving only grpc.health.v1.Health (for probes that cannot speak TLS); "
    "empty: none");
ABSL_FLAG(
    bool, start_paused, false,
    "start with the learner paused: actors stream into the replay, no training step until Admin.Resume");
ABSL_FLAG(bool, reflection, false,
          "Serve gRPC server reflection (needs a token of any role with --auth_tokens)");
// Overrides of common config fields (applied on top of --config).
ABSL_FLAG(std::optional<int>, batch_size, std::nullopt, "replay.batch_size");
ABSL_FLAG(std::optional<double>, lr, std::nullopt, "optimizer.lr");
ABSL_FLAG(std::optional<int64_t>, replay_capacity, std::nullopt, "replay.capacity");
ABSL_FLAG(std::optional<int64_t>, min_size_to_sample, std::nullopt, "rate_limiter.min_size_to_sample");
ABSL_FLAG(std::optional<double>, samples_per_insert, std::nullopt, "rate_limiter.samples_per_insert");
ABSL_FLAG(std::optional<int>, n_step, std::nullopt, "returns.n_step");
ABSL_FLAG(std::optional<double>, gamma, std::nullopt, "returns.gamma");
ABSL_FLAG(std::optional<int>, publish_every, std::nullopt, "server.publish_every");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt, "seed");
ABSL_FLAG(std::optional<int>, world_size, std::nullopt,
          "distributed.world_size: data-parallel ranks (one daemon per GPU; README \"Scale-out\")");
ABSL_FLAG(std::optional<int>, rank, std::nullopt, "distributed.rank: this daemon's rank in [0, world_size)");
ABSL_FLAG(std::optional<std::string>, rendezvous_address, std::nullopt,
          "distributed.rendezvous_address: host:port of rank 0's rendezvous");
ABSL_FLAG(
    std::string, rendezvous_tls_ca, "",
    "ranks > 0: PEM CA of rank 0's certificate; TLS to its rendezvous (client certificate: --tls_cert)");
ABSL_FLAG(std::string, rendezvous_token_file, "",
          "ranks > 0: file with an admin token of rank 0 (when it has --auth_tokens)");

namespace qstream {
namespace {

constexpr int kExitSetup = 1;
constexpr int kExitUsage = 2;

// absl's parser exits with 1 on a bad flag; qstreamd promises 2 for usage
// errors, so every --name[=value] is checked (and set) here first.
bool CheckFlags(int argc, char** argv, std::string* error) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") break;
    if (!absl::StartsWith(arg, "-")) continue;
    arg = arg.substr(absl::StartsWith(arg, "--") ? 2 : 1);
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    // absl's usage flags (--help, --helpfull, --version, ...) are handled by ParseCommandLine.
    if (name == "help" || name == "helpfull" || name == "helpshort" || name == "helppackage" ||
        name == "version" || name == "helpon" || name == "helpmatch") {
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && absl::StartsWith(name, "no")) {
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>() && eq == std::string::npos) continue;
    }
    if (flag == nullptr) {
      *error = absl::StrCat("unknown flag --", name);
      return false;
    }
    std::string value;
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
    } else if (flag->IsOfType<bool>()) {
      value = "true";
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      *error = absl::StrCat("--", name, ": missing value");
      return false;
    }
    std::string why;
    if (!flag->ParseFrom(value, &why)) {
      *error = absl::StrCat("--", name, "=", value, ": ", why);
      return false;
    }
  }
  return true;
}

absl::StatusOr<v1::TrainerConfig> EffectiveConfig() {
  v1::TrainerConfig config = DefaultConfig();
  if (const std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    auto loaded = LoadConfigFile(path);
    if (!loaded.ok()) return loaded.status();
    config = *loaded;
  }
  if (auto v = absl::GetFlag(FLAGS_batch_size)) config.mutable_replay()->set_batch_size(*v);
  if (auto v = absl::GetFlag(FLAGS_lr)) config.mutable_optimizer()->set_lr(static_cast<float>(*v));
  if (auto v = absl::GetFlag(FLAGS_replay_capacity)) config.mutable_replay()->set_capacity(*v);
  if (auto v = absl::GetFlag(FLAGS_min_size_to_sample))
    config.mutable_rate_limiter()->set_min_size_to_sample(*v);
  if (auto v = absl::GetFlag(FLAGS_samples_per_insert)) {
    config.mutable_rate_limiter()->set_samples_per_insert(static_cast<float>(*v));
  }
  if (auto v = absl::GetFlag(FLAGS_n_step)) config.mutable_returns()->set_n_step(*v);
  if (auto v = absl::GetFlag(FLAGS_gamma)) config.mutable_returns()->set_gamma(static_cast<float>(*v));
  if (auto v = absl::GetFlag(FLAGS_publish_every)) config.mutable_server()->set_publish_every(*v);
  if (auto v = absl::GetFlag(FLAGS_seed)) config.set_seed(*v);
  if (auto v = absl::GetFlag(FLAGS_world_size)) config.mutable_distributed()->set_world_size(*v);
  if (auto v = absl::GetFlag(FLAGS_rank)) config.mutable_distributed()->set_rank(*v);
  if (auto v = absl::GetFlag(FLAGS_rendezvous_address))
    config.mutable_distributed()->set_rendezvous_address(*v);
  if (auto st = ValidateConfig(config); !st.ok()) return st;
  return config;
}

int Main(int argc, char** argv) {
  // Signals are taken synchronously by this thread (sigwait below); blocking
  // them before any thread exists keeps them off gRPC's and the learner's.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::SetProgramUsageMessage("qstreamd: C51 DQN learner fed by gRPC actor streams");
  std::string error;
  if (!CheckFlags(argc, argv, &error)) {
    std::fprintf(stderr, "qstreamd: %s\n", error.c_str());
    return kExitUsage;
  }
  absl::ParseCommandLine(argc, argv);
  if (absl::Status st = InitLogging(absl::GetFlag(FLAGS_log_format), absl::GetFlag(FLAGS_log_level));
      !st.ok()) {
    std::fprintf(stderr, "qstreamd: %s\n", std::string(st.message()).c_str());
    return kExitUsage;
  }
  // Debian's Abseil checks every Mutex acquisition for lock-order cycles
  // (its deadlock detector, ~2 % of the daemon's CPU on the ingest path);
  // the tests keep it on, the daemon does not need it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Batch columns of a few hundred KiB are allocated and freed per message;
  // above glibc's mmap threshold each would be a fresh mmap, page faults and
  // munmap. Keep them on the heap (the bytes held are bounded by
  // server.max_queued_bytes anyway).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);

  auto config = EffectiveConfig();
  if (!config.ok()) {
    spdlog::critical("{}", std::string(config.status().message()));
    return kExitUsage;
  }
  auto backend = ParseBackendKind(absl::GetFlag(FLAGS_backend));
  if (!backend.ok()) {
    spdlog::critical("{}", std::string(backend.status().message()));
    return kExitUsage;
  }
  if (absl::GetFlag(FLAGS_push_interval) <= absl::ZeroDuration()) {
    spdlog::critical("--push_interval: must be > 0");
    return kExitUsage;
  }

  DaemonOptions options;
  options.config = *config;
  options.backend = *backend;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.security.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.security.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.security.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  options.security.tls_reload_interval = absl::GetFlag(FLAGS_tls_reload_interval);
  options.security.auth_tokens = absl::GetFlag(FLAGS_auth_tokens);
  options.security.allow_insecure = absl::GetFlag(FLAGS_allow_insecure);
  options.security.reflection = absl::GetFlag(FLAGS_reflection);
  options.health_listen = absl::GetFlag(FLAGS_health_listen);
  options.metrics.listen = absl::GetFlag(FLAGS_metrics_listen);
  options.metrics.auth_file = absl::GetFlag(FLAGS_metrics_auth_file);
  options.metrics.threads = absl::GetFlag(FLAGS_metrics_threads);
  options.metrics.request_timeout = absl::GetFlag(FLAGS_metrics_request_timeout);
  options.metrics.pushgateway = absl::GetFlag(FLAGS_pushgateway);
  options.metrics.push_interval = absl::GetFlag(FLAGS_push_interval);
  options.metrics.instance = absl::GetFlag(FLAGS_instance);
  options.metrics.push_job = absl::GetFlag(FLAGS_push_job);
  options.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  options.restore = absl::GetFlag(FLAGS_restore);
  options.start_paused = absl::GetFlag(FLAGS_start_paused);
  options.rendezvous_tls_ca = absl::GetFlag(FLAGS_rendezvous_tls_ca);
  options.rendezvous_token_file = absl::GetFlag(FLAGS_rendezvous_token_file);
  // The signals stay blocked until sigwait below; a long start (forming a
  // group) still stops on one.
  options.cancelled = [] {
    sigset_t pending;
    sigpending(&pending);
    return sigismember(&pending, SIGTERM) == 1 || sigismember(&pending, SIGINT) == 1;
  };
  auto daemon = Daemon::Start(options);
  if (!daemon.ok()) {
    spdlog::critical("{}", std::string(daemon.status().message()));
    if (daemon.status().code() == absl::StatusCode::kCancelled) return 0;
    return daemon.status().code() == absl::StatusCode::kInvalidArgument ? kExitUsage : kExitSetup;
  }
  spdlog::info("{}", (*daemon)->StartupLine());

  int signal_number = 0;
  for (;;) {
    sigwait(&signals, &signal_number);
    if (signal_number != SIGHUP) break;
    // Secrets are re-read; a bad file keeps the previous ones in force.
    const absl::Status st = (*daemon)->Reload();
    if (st.ok()) {
      spdlog::info("SIGHUP: token and metrics auth files re-read (TLS files are re-read by gRPC's watcher)");
    } else {
      spdlog::error("SIGHUP: {} (the previous files stay in force)", std::string(st.message()));
    }
  }
  spdlog::info("{}, draining streams", signal_number == SIGINT ? "SIGINT" : "SIGTERM");
  (*daemon)->Shutdown(absl::GetFlag(FLAGS_shutdown_deadline));
  const LearnerStatus s = (*daemon)->learner()->status();
  spdlog::info("stopped after {} steps, {} transitions in the replay", s.steps, s.replay_size);
  return 0;
}

}  // namespace
}  // namespace qstream

int main(int argc, char** argv) { return qstream::Main(argc, argv); }
