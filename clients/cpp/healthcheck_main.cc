// qstream-healthcheck: one grpc.health.v1.Health/Check against a qstreamd, for
// Docker's HEALTHCHECK and scripts (Kubernetes uses its built-in gRPC probe).
//   qstream-healthcheck [--timeout=3s] [--service=] [--tls_ca=FILE ...] host:port
// Exit codes: 0 SERVING, 1 any other status or no answer, 2 bad usage.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "clients/cpp/channel.h"
#include "clients/cpp/health_check.h"

ABSL_FLAG(absl::Duration, timeout, absl::Seconds(3), "Deadline of the Check call");
ABSL_FLAG(std::string, service, "", "Service name to check; empty: the whole server");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA of the server's certificate (TLS); empty: plaintext");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mTLS), with --tls_key");
ABSL_FLAG(std::string, tls_key, "", "PEM key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "", "Name the server's certificate is checked against");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("qstream-healthcheck [flags] host:port  (exit 0: SERVING)");
  const std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "qstream-healthcheck: one host:port argument expected (see --help)\n");
    return 2;
  }
  qstream::actor::ChannelOptions options;
  options.server = args[1];
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  auto channel = qstream::actor::CreateChannel(options);
  if (!channel.ok()) {
    std::fprintf(stderr, "qstream-healthcheck: %s\n", std::string(channel.status().message()).c_str());
    return 2;
  }
  auto status =
      qstream::actor::CheckHealth(*channel, absl::GetFlag(FLAGS_service), absl::GetFlag(FLAGS_timeout));
  if (!status.ok()) {
    std::fprintf(stderr, "qstream-healthcheck: %s: %s\n", options.server.c_str(),
                 status.status().ToString().c_str());
    return 1;
  }
  std::printf("%s\n", qstream::actor::ServingStatusName(*status));
  return *status == qstream::actor::ServingStatus::kServing ? 0 : 1;
}
