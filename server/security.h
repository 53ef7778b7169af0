// Transport security and role-based access of qstreamd's gRPC port (README
// "Security").
//
//  * Credentials: TLS with gRPC's FileWatcherCertificateProvider when
//    --tls_cert/--tls_key are given (mTLS, client certificates required and
//    verified, with --tls_client_ca); otherwise gRPC local credentials
//    (plaintext, loopback peers only) on a loopback address, or plaintext for
//    any peer only with --allow_insecure. Certificates are re-read by gRPC's
//    file watcher every tls_reload_interval, without dropping connections;
//    gRPC 1.51 has no API to force that re-read, so SIGHUP does not.
//  * Roles: bearer tokens from a file (--auth_tokens), checked by a
//    grpc::AuthMetadataProcessor for every call before any handler runs:
//    actor (ExperienceService, PolicyService), observer (AdminService.Status
//    without the config, reflection), admin (everything). Health is open.
//    Missing or unknown token: UNAUTHENTICATED; known token, method outside
//    its role: PERMISSION_DENIED. The one handler that redacts by role
//    (Status leaves the config out for observers) asks RoleOf(). gRPC 1.51
//    hands the processor the connection's AuthContext, shared by every call
//    on it, so nothing per call is stored there (it would also grow per call).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"

namespace qstream {

enum class Role { kActor, kObserver, kAdmin };
const char* RoleName(Role role);

using Sha256Digest = std::array<uint8_t, 32>;
Sha256Digest Sha256(absl::string_view data);
// The digest a secrets file means by `secret`: `sha256:<64 hex digits>` is
// the digest itself, anything else is hashed. The error never echoes it.
absl::StatusOr<Sha256Digest> SecretDigest(absl::string_view secret);
// Printable ASCII without spaces (what a secret in a file may hold).
bool SecretChars(absl::string_view secret);

// The token file: one `<role> <token>` or `<role> sha256:<64 hex digits>` a
// line; blank lines and lines starting with '#' are skipped. Plain tokens are
// at least 16 characters of printable ASCII without spaces. Only digests are
// kept in memory.
struct TokenEntry {
  Role role;
  Sha256Digest digest;
};
// InvalidArgument naming `source` and the line on a bad line or a token
// listed twice.
absl::StatusOr<std::vector<TokenEntry>> ParseTokenFile(absl::string_view text, absl::string_view source);

// Auth failure reasons, the `reason` label of qstream_auth_failures_total.
enum class AuthFailure { kMissing, kMalformed, kUnknownToken, kWrongRole, kCount };
const char* AuthFailureName(AuthFailure reason);

// qstream_auth_failures_total{reason}, one counter per reason, registered
// in `registry` (zero when token auth is off).
using AuthFailureCounters = std::array<prometheus::Counter*, static_cast<int>(AuthFailure::kCount)>;
AuthFailureCounters AddAuthFailureMetric(prometheus::Registry* registry);

// The access rule of one method: which roles may call it ("/pkg.Service/Method").
// nullopt-like: `open` methods need no token.
struct MethodAccess {
  bool open = false;
  bool actor = false;
  bool observer = false;
  bool admin = true;
};
MethodAccess AccessFor(absl::string_view method);

// Checks the bearer token of every call against the token table; the table
// is replaced atomically by Reload (SIGHUP) and in-flight calls keep theirs.
class TokenAuthorizer final : public grpc::AuthMetadataProcessor {
 public:
  // Reads `path` (must parse; at least one token).
  static absl::StatusOr<std::shared_ptr<TokenAuthorizer>> Create(const std::string& path);

  // Re-reads the file; on error the previous tokens stay in force.
  absl::Status Reload() ABSL_LOCKS_EXCLUDED(mu_);

  // AuthMetadataProcessor: non-blocking (in-memory table), runs on gRPC's
  // thread for each call.
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata, OutputMetadata* response_metadata) override;

  // The decision for one call, without gRPC types (tests).
  grpc::Status Check(absl::string_view method, const absl::string_view* authorization, Role* role)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The role of a call that passed Process (nullopt: no valid token).
  std::optional<Role> RoleOf(const grpc::ServerContextBase& context) ABSL_LOCKS_EXCLUDED(mu_);

  // Also count refusals in these (exported) counters from now on.
  void ExportFailures(const AuthFailureCounters& counters) ABSL_LOCKS_EXCLUDED(mu_);

  int64_t failures(AuthFailure reason) const {
    return failures_[static_cast<int>(reason)].load(std::memory_order_relaxed);
  }
  std::map<std::string, int64_t> failures_by_reason() const;
  int num_tokens() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit TokenAuthorizer(std::string path) : path_(std::move(path)) {}
  grpc::Status Fail(AuthFailure reason, grpc::StatusCode code, std::string message);
  // The table's role of `token`; every entry compared in constant time.
  std::optional<Role> Lookup(absl::string_view token) ABSL_LOCKS_EXCLUDED(mu_);

  const std::string path_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const std::vector<TokenEntry>> tokens_ ABSL_GUARDED_BY(mu_);
  std::array<std::atomic<int64_t>, static_cast<int>(AuthFailure::kCount)> failures_{};
  // Set once before the server starts (ExportFailures); read without a lock.
  std::atomic<bool> exported_{false};
  AuthFailureCounters exported_counters_{};
};

// The caller may read the full config: admin, or no tokens at all
// (`authorizer` null).
bool CallerIsAdmin(const grpc::ServerContextBase& context, TokenAuthorizer* authorizer);

struct SecurityOptions {
  std::string tls_cert;       // PEM certificate chain; with tls_key enables TLS
  std::string tls_key;        // PEM private key
  std::string tls_client_ca;  // PEM CA bundle; client certificates required
  absl::Duration tls_reload_interval = absl::Seconds(60);
  std::string auth_tokens;    // token file; empty: no token auth
  bool allow_insecure = false;
  bool reflection = false;
};

// Whether `host` (of host:port) names only loopback: 127.x.y.z, ::1,
// localhost. "0.0.0.0", "[::]" and names are not loopback.
bool IsLoopbackHost(absl::string_view host);

// Refuses unsafe combinations (InvalidArgument, the message says why and
// what to add) and checks the TLS files: readable, PEM, key matches the
// certificate, CA parses.
absl::Status CheckSecurityOptions(const SecurityOptions& options, const std::string& listen);

// The server credentials for `listen`, with `authorizer` (may be null)
// installed as the auth metadata processor.
std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const SecurityOptions& options,
                                                               const std::string& listen,
                                                               std::shared_ptr<TokenAuthorizer> authorizer);

// One line for the start-up log: "tls" / "mtls" / "local" / "insecure",
// plus "tokens=N" or "no-auth".
std::string SecuritySummary(const SecurityOptions& options, const TokenAuthorizer* authorizer);

}  // namespace qstream
