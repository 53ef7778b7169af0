#include "clients/cpp/channel.h"

#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "grpcpp/support/client_interceptor.h"

namespace qstream::actor {
namespace {

// Spreads new calls over every address the target resolves to (the ranks
// behind a headless Service); a target of one address is unaffected.
constexpr char kRoundRobinServiceConfig[] = R"({"loadBalancingConfig":[{"round_robin":{}}]})";

// Schemes of the gRPC target URIs that --server takes as one target.
constexpr absl::string_view kTargetSchemes[] = {"dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:"};

bool HasTargetScheme(absl::string_view value) {
  return absl::c_any_of(kTargetSchemes, [value](absl::string_view scheme) {
    return absl::StartsWithIgnoreCase(value, scheme);
  });
}

// host:port with a port of 1 to 65535; an IPv6 host in brackets.
bool IsHostPort(absl::string_view entry) {
  const size_t colon = entry.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) {
    return false;
  }
  const absl::string_view host = entry.substr(0, colon);
  const absl::string_view port = entry.substr(colon + 1);
  int number = 0;
  if (!absl::c_all_of(port, absl::ascii_isdigit) || !absl::SimpleAtoi(port, &number) || number < 1 ||
      number > 65535) {
    return false;
  }
  return !absl::StrContains(host, ':') || (absl::StartsWith(host, "[") && absl::EndsWith(host, "]"));
}

// The whole file, or an error naming it and the flag that named it.
absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("--", flag, ": cannot read ", path));
  }
  std::ostringstream content;
  content << in.rdbuf();
  if (in.bad()) {
    return absl::DataLossError(absl::StrCat("--", flag, ": error reading ", path));
  }
  return content.str();
}

absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view flag) {
  auto pem = ReadFile(path, flag);
  if (pem.ok() && !absl::StrContains(*pem, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", path, " holds no PEM block"));
  }
  return pem;
}

// Adds the authorization header to the initial metadata of every call.
class BearerTokenInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerTokenInterceptor(std::string header) : header_(std::move(header)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", header_);
    }
    methods->Proceed();
  }

 private:
  const std::string header_;
};

class BearerTokenInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerTokenInterceptorFactory(const std::string& token) : header_(absl::StrCat("Bearer ", token)) {}

  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new BearerTokenInterceptor(header_);
  }

 private:
  const std::string header_;
};

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseServerList(absl::string_view value) {
  value = absl::StripAsciiWhitespace(value);
  if (value.empty()) {
    return absl::InvalidArgumentError("--server is empty");
  }
  if (HasTargetScheme(value)) {
    // ipv4: and ipv6: URIs list their addresses with commas themselves.
    if (absl::StartsWithIgnoreCase(value, "dns:") && absl::StrContains(value, ',')) {
      return absl::InvalidArgumentError(absl::StrCat("--server: '", value,
                                                     "': a dns: target names one host; list several "
                                                     "daemons as host:port,host:port"));
    }
    return std::vector<std::string>{std::string(value)};
  }
  std::vector<std::string> servers;
  for (absl::string_view entry : absl::StrSplit(value, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--server: entry ", servers.size() + 1, " of '", value, "' is empty"));
    }
    if (HasTargetScheme(entry)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--server: '", entry,
                       "' is a target URI, which must be the whole value (or list host:port entries)"));
    }
    if (!IsHostPort(entry)) {
      return absl::InvalidArgumentError(absl::StrCat("--server: '", entry,
                                                     "' is not host:port (a port of 1 to 65535; "
                                                     "an IPv6 host in brackets: [::1]:50051)"));
    }
    if (absl::c_linear_search(servers, entry)) {
      return absl::InvalidArgumentError(absl::StrCat("--server: '", entry, "' is listed twice"));
    }
    servers.emplace_back(entry);
  }
  return servers;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  auto content = ReadFile(path, "token_file");
  if (!content.ok()) {
    return content.status();
  }
  const std::string token(absl::StripTrailingAsciiWhitespace(*content));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--token_file: ", path, " is empty"));
  }
  for (char c : token) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(
          absl::StrCat("--token_file: ", path, " holds a space, a line break or a non-ASCII character; "
                       "a token is one line of printable ASCII"));
    }
  }
  return token;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateChannel(const ChannelOptions& options) {
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  const bool tls = !options.tls_ca_file.empty() || !options.tls_cert_file.empty();
  if (!tls && !options.tls_server_name.empty()) {
    return absl::InvalidArgumentError("--tls_server_name needs TLS (--tls_ca)");
  }

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetServiceConfigJSON(kRoundRobinServiceConfig);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (tls) {
    grpc::SslCredentialsOptions ssl;
    if (!options.tls_ca_file.empty()) {
      auto ca = ReadPemFile(options.tls_ca_file, "tls_ca");
      if (!ca.ok()) {
        return ca.status();
      }
      ssl.pem_root_certs = *std::move(ca);
    }
    if (!options.tls_cert_file.empty()) {
      auto cert = ReadPemFile(options.tls_cert_file, "tls_cert");
      if (!cert.ok()) {
        return cert.status();
      }
      auto key = ReadPemFile(options.tls_key_file, "tls_key");
      if (!key.ok()) {
        return key.status();
      }
      ssl.pem_cert_chain = *std::move(cert);
      ssl.pem_private_key = *std::move(key);
    }
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
  }

  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!options.token_file.empty()) {
    auto token = ReadTokenFile(options.token_file);
    if (!token.ok()) {
      return token.status();
    }
    interceptors.push_back(std::make_unique<BearerTokenInterceptorFactory>(*token));
  }
  return grpc::experimental::CreateCustomChannelWithInterceptors(options.server, credentials, args,
                                                                 std::move(interceptors));
}

bool IsLoopbackServer(absl::string_view server) {
  if (absl::ConsumePrefix(&server, "unix:") || absl::ConsumePrefix(&server, "unix-abstract:")) {
    return true;
  }
  if (!absl::ConsumePrefix(&server, "dns:///") && !absl::ConsumePrefix(&server, "ipv4:")) {
    absl::ConsumePrefix(&server, "ipv6:");
  }
  absl::string_view host = server;
  if (absl::ConsumePrefix(&host, "[")) {
    host = host.substr(0, host.find(']'));
  } else if (const size_t colon = host.rfind(':'); colon != absl::string_view::npos) {
    host = host.substr(0, colon);
  }
  return absl::EqualsIgnoreCase(host, "localhost") || host == "::1" || absl::StartsWith(host, "127.");
}

bool IsTokenRefused(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAUTHENTICATED || code == grpc::StatusCode::PERMISSION_DENIED;
}

absl::Status TokenRefusedError(absl::string_view call, const grpc::Status& status) {
  const bool unauthenticated = status.error_code() == grpc::StatusCode::UNAUTHENTICATED;
  const std::string message =
      absl::StrCat(call, ": the daemon refused the token (",
                   unauthenticated ? "UNAUTHENTICATED" : "PERMISSION_DENIED", ": ", status.error_message(), ")");
  return unauthenticated ? absl::UnauthenticatedError(message) : absl::PermissionDeniedError(message);
}

}  // namespace qstream::actor
