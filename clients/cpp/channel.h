// The actor's connection to a qstreamd: the targets a --server value names,
// one gRPC channel per target, plaintext or TLS (optionally with a client
// certificate for mTLS), whose every call carries `authorization: Bearer
// <token>` when a token is configured, and how the daemon's refusal of that
// token reads.
//
// The token travels as call metadata added by a client interceptor rather
// than as gRPC call credentials, because gRPC drops call credentials on
// insecure channels and the daemon accepts plaintext on loopback.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace qstream::actor {

struct ChannelOptions {
  std::string server;  // one target of ParseServerList
  // PEM file of the CA that signed the daemon's certificate. TLS is used when
  // this or a client certificate is set; without it the default roots verify.
  std::string tls_ca_file;
  // PEM client certificate and key (both or neither) for a daemon that
  // requires client certificates (mTLS).
  std::string tls_cert_file;
  std::string tls_key_file;
  // Name the daemon's certificate is checked against instead of the host
  // part of `server` (TLS only).
  std::string tls_server_name;
  // File holding the bearer token; empty: calls carry no token.
  std::string token_file;
};

// The gRPC targets of a --server value, which names one daemon or several
// ranks (data-parallel learners, each with its own replay shard):
// - a gRPC target URI (dns:, ipv4:, ipv6:, unix:, unix-abstract:) is one
//   target, taken as it is: e.g. dns:///qstream-ranks.ns.svc:50051, whose
//   channel spreads new calls over every address the name resolves to;
// - otherwise a comma-separated list of host:port, one target each
//   (IPv6 hosts in brackets).
// InvalidArgument naming --server for an empty entry, an entry without a
// port, a URI beside other entries, or an entry listed twice.
absl::StatusOr<std::vector<std::string>> ParseServerList(absl::string_view value);

// Reads a bearer token: the file's content without trailing whitespace. Fails
// naming the file when it cannot be read, is empty or holds a character that
// is not printable ASCII (the token must fit one HTTP/2 header value).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// Builds the channel of `options`: reads every file it names (errors name the
// file and the flag) and attaches the token to every call. Its load-balancing
// policy is round_robin, so a target that resolves to several addresses
// spreads the calls, and so the streams, over all of them. Connecting
// happens later, on the first call.
absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateChannel(const ChannelOptions& options);

// True when `server` (host:port) names a loopback address, where a token in
// plaintext does not leave the machine.
bool IsLoopbackServer(absl::string_view server);

// True for the codes with which the daemon refuses a call's token: a missing
// or unknown token (UNAUTHENTICATED) or one whose role may not make the call
// (PERMISSION_DENIED). Retrying cannot help.
bool IsTokenRefused(grpc::StatusCode code);

// The status of a call the daemon refused for its token, saying so:
// "<call>: the daemon refused the token (PERMISSION_DENIED: <message>)".
absl::Status TokenRefusedError(absl::string_view call, const grpc::Status& status);

}  // namespace qstream::actor
