// qstream-actor: built-in environments acting on a qstreamd policy and
// streaming their experience to it, or to several ranks of a data-parallel
// learner: --server=host1:port1,host2:port2 opens one channel and one stream
// per address and splits the environments over them in contiguous blocks
// (RunActor); the policy comes from the first address, since every rank holds
// the same weights. --server=dns:///name:port is one channel whose
// round_robin policy puts the stream on one of the name's addresses.
//
// Exit status: 0 when the run ended normally (return target reached, step cap
// reached without a target, or SIGINT/SIGTERM); 3 when a --stop_at_return
// target was set and --steps ran out first; 1 on any error (unreadable TLS
// or token files and a token the daemon refused among them).
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdint>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "clients/cpp/actor.h"
#include "clients/cpp/channel.h"
#include "clients/cpp/experience_stream.h"
#include "clients/cpp/policy_watcher.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(
    std::string, server, "127.0.0.1:50051",
    "qstreamd gRPC address host:port; several ranks: host1:port1,host2:port2 (the envs split over them, "
    "the policy from the first) or a target URI such as dns:///name:port (round_robin over its addresses)");
ABSL_FLAG(std::string, env, "CartPole",
          "built-in environment: CartPole | MountainCar; also the env label of the episodes it reports");
ABSL_FLAG(int, num_envs, 4, "environments stepped by this process");
ABSL_FLAG(int64_t, steps, 0, "stop after this many environment steps (all envs); 0: no cap");
ABSL_FLAG(double, epsilon_start, 1.0, "exploration rate at the first step");
ABSL_FLAG(double, epsilon_end, 0.01, "exploration rate after the decay");
ABSL_FLAG(int64_t, epsilon_decay_steps, 10000, "environment steps of the linear epsilon decay");
ABSL_FLAG(uint64_t, seed, 1, "seed of episode starts and exploration");
ABSL_FLAG(double, stop_at_return, std::numeric_limits<double>::quiet_NaN(),
          "exit 0 once the mean return of the last --return_window episodes reaches this");
ABSL_FLAG(int, return_window, 20, "episodes in the moving mean of returns");
ABSL_FLAG(int, batch_transitions, 64, "transitions per TransitionBatch");
ABSL_FLAG(int, max_in_flight, 32, "unacknowledged batches before sending blocks");
ABSL_FLAG(double, report_every_s, 5, "seconds between progress lines");
ABSL_FLAG(double, connect_timeout_s, 30, "how long to wait for the daemon's first policy");
ABSL_FLAG(double, reconnect_timeout_s, 60, "give up when the daemon cannot be reached for this long");
ABSL_FLAG(std::string, stream_id, "",
          "stream identity for resend de-duplication (default: host-pid); with several --server addresses "
          "the stream to address k is <stream_id>/k");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA certificate the daemon's certificate is verified against; enables TLS");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate, for a daemon that requires them (mTLS); with --tls_key");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "name the daemon's certificate is checked against instead of the --server host");
ABSL_FLAG(std::string, token_file, "",
          "file holding the bearer token sent with every call (role actor); never pass a token itself");

namespace {

std::atomic<bool> g_stop{false};

void OnSignal(int) { g_stop.store(true); }

std::string DefaultStreamId() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat(host, "-", getpid());
}

constexpr char kTlsHint[] =
    "; check --tls_ca (the CA of the daemon's certificate), --tls_server_name, and --tls_cert/--tls_key "
    "for a daemon that requires client certificates";

// What to do about a refused token.
std::string TokenHint(const absl::Status& status) {
  if (absl::IsUnauthenticated(status)) {
    return absl::GetFlag(FLAGS_token_file).empty() ? "; the daemon wants a token: pass --token_file"
                                                   : absl::StrCat("; check the token in ", absl::GetFlag(FLAGS_token_file));
  }
  if (absl::IsPermissionDenied(status)) {
    return absl::StrCat("; the token in ", absl::GetFlag(FLAGS_token_file), " needs the actor role");
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("qstream-actor --server=HOST:PORT[,HOST:PORT...] --env=CartPole --num_envs=N");
  // --help lists every flag of this binary (absl's default matches the file name to the program name).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) { return absl::StrContains(file, "clients/cpp"); };
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);

  using qstream::actor::ActorOptions;
  ActorOptions options;
  options.env = absl::GetFlag(FLAGS_env);
  options.num_envs = absl::GetFlag(FLAGS_num_envs);
  options.max_steps = absl::GetFlag(FLAGS_steps);
  options.epsilon.start = absl::GetFlag(FLAGS_epsilon_start);
  options.epsilon.end = absl::GetFlag(FLAGS_epsilon_end);
  options.epsilon.decay_steps = absl::GetFlag(FLAGS_epsilon_decay_steps);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.stop_at_return = absl::GetFlag(FLAGS_stop_at_return);
  options.return_window = absl::GetFlag(FLAGS_return_window);
  options.batch_transitions = absl::GetFlag(FLAGS_batch_transitions);
  options.report_every = absl::Seconds(absl::GetFlag(FLAGS_report_every_s));

  auto servers = qstream::actor::ParseServerList(absl::GetFlag(FLAGS_server));
  if (!servers.ok()) {
    std::cerr << "qstream-actor: " << servers.status().message() << "\n";
    return 1;
  }
  if (static_cast<int>(servers->size()) > options.num_envs) {
    std::cerr << "qstream-actor: --num_envs=" << options.num_envs << " is less than the " << servers->size()
              << " --server addresses; each env streams to one\n";
    return 1;
  }
  qstream::actor::ChannelOptions channel_options;
  channel_options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  channel_options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  channel_options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  channel_options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  channel_options.token_file = absl::GetFlag(FLAGS_token_file);
  const bool tls = !channel_options.tls_ca_file.empty() || !channel_options.tls_cert_file.empty();
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (const std::string& server : *servers) {
    channel_options.server = server;
    auto channel = qstream::actor::CreateChannel(channel_options);
    if (!channel.ok()) {
      std::cerr << "qstream-actor: " << channel.status().message() << "\n";
      return 1;
    }
    if (!tls && !channel_options.token_file.empty() && !qstream::actor::IsLoopbackServer(server)) {
      std::cerr << "qstream-actor: warning: the token goes to " << server << " in plaintext; use --tls_ca\n";
    }
    channels.push_back(*std::move(channel));
  }

  auto policy = qstream::actor::PolicyWatcher::Create(channels[0],
                                                      absl::Seconds(absl::GetFlag(FLAGS_connect_timeout_s)));
  if (!policy.ok()) {
    std::cerr << "qstream-actor: " << policy.status().message() << TokenHint(policy.status())
              << (tls && absl::IsUnavailable(policy.status()) ? kTlsHint : "") << "\n";
    return 1;
  }
  qstream::actor::ExperienceStream::Options stream_options;
  stream_options.max_in_flight = absl::GetFlag(FLAGS_max_in_flight);
  stream_options.stream_id = absl::GetFlag(FLAGS_stream_id);
  stream_options.reconnect_timeout = absl::Seconds(absl::GetFlag(FLAGS_reconnect_timeout_s));
  if (stream_options.stream_id.empty()) {
    stream_options.stream_id = DefaultStreamId();
  }
  std::vector<std::unique_ptr<qstream::actor::ExperienceStream>> streams;
  std::vector<qstream::actor::ExperienceStream*> stream_ptrs;
  for (size_t k = 0; k < channels.size(); ++k) {
    qstream::actor::ExperienceStream::Options options_k = stream_options;
    // Stream k of a list is "<stream_id>/k": two entries that reach the same
    // daemon must not take each other's ingest session over.
    if (channels.size() > 1) {
      options_k.stream_id = absl::StrCat(stream_options.stream_id, "/", k);
    }
    auto stream = qstream::actor::ExperienceStream::Open(channels[k], options_k);
    if (!stream.ok()) {
      std::cerr << "qstream-actor: " << stream.status().message() << "\n";
      return 1;
    }
    stream_ptrs.push_back(stream->get());
    streams.push_back(*std::move(stream));
  }
  std::cout << "qstream-actor env=" << options.env << " num_envs=" << options.num_envs
            << " server=" << absl::GetFlag(FLAGS_server) << " stream_id=" << stream_options.stream_id
            << " policy_version=" << (*policy)->Latest()->version << std::endl;

  auto result = qstream::actor::RunActor(options, stream_ptrs, **policy, g_stop, std::cout);
  absl::Status closed;
  for (const auto& stream : streams) {
    closed.Update(stream->Close());
  }
  if (!result.ok()) {
    std::cerr << "qstream-actor: " << result.status().message() << TokenHint(result.status()) << "\n";
    return 1;
  }
  if (!closed.ok()) {
    std::cerr << "qstream-actor: " << closed.message() << TokenHint(closed) << "\n";
    return 1;
  }
  std::cout << "qstream-actor finished env_steps=" << result->env_steps << " episodes=" << result->episodes
            << " mean_return=" << result->mean_return << " sent=" << result->stream.sent_transitions
            << " accepted=" << result->stream.accepted_transitions
            << " reconnects=" << result->stream.reconnects
            << " reached_target=" << (result->reached_target ? "yes" : "no") << std::endl;
  const bool target_set = !std::isnan(options.stop_at_return);
  if (target_set && !result->reached_target && !g_stop.load()) {
    return 3;
  }
  return 0;
}
