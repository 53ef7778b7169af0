#include "server/security.h"

#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "server/daemon.h"
#include "spdlog/spdlog.h"

namespace qstream {

const char* RoleName(Role role) {
  switch (role) {
    case Role::kActor: return "actor";
    case Role::kObserver: return "observer";
    case Role::kAdmin: return "admin";
  }
  return "?";
}

const char* AuthFailureName(AuthFailure reason) {
  switch (reason) {
    case AuthFailure::kMissing: return "missing_token";
    case AuthFailure::kMalformed: return "malformed_token";
    case AuthFailure::kUnknownToken: return "unknown_token";
    case AuthFailure::kWrongRole: return "wrong_role";
    case AuthFailure::kCount: break;
  }
  return "?";
}

Sha256Digest Sha256(absl::string_view data) {
  Sha256Digest out{};
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), out.data(), &len, EVP_sha256(), nullptr);
  return out;
}

absl::StatusOr<Sha256Digest> SecretDigest(absl::string_view secret) {
  if (!absl::ConsumePrefix(&secret, "sha256:")) return Sha256(secret);
  if (secret.size() != 64 ||
      !std::all_of(secret.begin(), secret.end(), [](char c) { return absl::ascii_isxdigit(c); })) {
    return absl::InvalidArgumentError(
        absl::StrCat("sha256: needs 64 hex digits, got ", secret.size(), " characters"));
  }
  const std::string bytes = absl::HexStringToBytes(secret);
  Sha256Digest d{};
  std::copy(bytes.begin(), bytes.end(), d.begin());
  return d;
}

bool SecretChars(absl::string_view secret) {
  return std::all_of(secret.begin(), secret.end(), [](char c) { return c > ' ' && c <= '~'; });
}

namespace {

constexpr size_t kMinTokenChars = 16;
constexpr size_t kMaxTokenChars = 4096;

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, const char* what, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(what, "=", path, ": cannot be read"));
  std::ostringstream text;
  text << in.rdbuf();
  std::string s = text.str();
  if (s.size() > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, "=", path, ": larger than ", max_bytes, " bytes"));
  }
  return s;
}

}  // namespace

absl::StatusOr<std::vector<TokenEntry>> ParseTokenFile(absl::string_view text, absl::string_view source) {
  std::vector<TokenEntry> entries;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const auto where = [&] { return absl::StrCat(source, ":", line_number, ": "); };
    std::vector<absl::string_view> parts = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (parts.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "expected `<role> <token>` or `<role> sha256:<hex>`, got ", parts.size(), " words"));
    }
    TokenEntry e;
    if (parts[0] == "actor") {
      e.role = Role::kActor;
    } else if (parts[0] == "observer") {
      e.role = Role::kObserver;
    } else if (parts[0] == "admin") {
      e.role = Role::kAdmin;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "role \"", absl::CHexEscape(parts[0]), "\" is not one of actor, observer, admin"));
    }
    const absl::string_view token = parts[1];
    // The token itself is never echoed in a message.
    if (!absl::StartsWith(token, "sha256:") &&
        (token.size() < kMinTokenChars || token.size() > kMaxTokenChars || !SecretChars(token))) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "token of ", token.size(), " characters: needs ",
                                                     kMinTokenChars, " to ", kMaxTokenChars,
                                                     " printable non-space ASCII characters"));
    }
    auto digest = SecretDigest(token);
    if (!digest.ok()) return absl::InvalidArgumentError(absl::StrCat(where(), digest.status().message()));
    e.digest = *digest;
    for (const TokenEntry& other : entries) {
      if (other.digest == e.digest) {
        return absl::InvalidArgumentError(absl::StrCat(where(), "the same token is listed twice"));
      }
    }
    entries.push_back(e);
  }
  if (entries.empty()) return absl::InvalidArgumentError(absl::StrCat(source, ": no tokens"));
  return entries;
}

MethodAccess AccessFor(absl::string_view method) {
  MethodAccess a;
  if (absl::StartsWith(method, "/grpc.health.v1.Health/")) {
    a.open = true;
  } else if (absl::StartsWith(method, "/qstream.v1.ExperienceService/") ||
             absl::StartsWith(method, "/qstream.v1.PolicyService/")) {
    a.actor = true;
  } else if (method == "/qstream.v1.AdminService/Status" ||
             absl::StartsWith(method, "/grpc.reflection.v1alpha.ServerReflection/")) {
    a.observer = true;
    a.actor = absl::StartsWith(method, "/grpc.reflection.");
  }
  return a;  // anything else: admin only
}

absl::StatusOr<std::shared_ptr<TokenAuthorizer>> TokenAuthorizer::Create(const std::string& path) {
  std::shared_ptr<TokenAuthorizer> a(new TokenAuthorizer(path));
  if (absl::Status st = a->Reload(); !st.ok()) return st;
  return a;
}

absl::Status TokenAuthorizer::Reload() {
  auto text = ReadSmallFile(path_, "--auth_tokens", 1 << 20);
  if (!text.ok()) return text.status();
  auto entries = ParseTokenFile(*text, absl::StrCat("--auth_tokens=", path_));
  if (!entries.ok()) return entries.status();
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0 && (st.st_mode & 007) != 0) {
    spdlog::warn(
        "--auth_tokens={} is readable by others (mode {:04o}); 0600, or 0440 with a group of its own, "
        "keeps the tokens to this service",
        path_, static_cast<unsigned>(st.st_mode & 0777));
  }
  auto table = std::make_shared<const std::vector<TokenEntry>>(std::move(*entries));
  absl::MutexLock lock(&mu_);
  tokens_ = std::move(table);
  return absl::OkStatus();
}

int TokenAuthorizer::num_tokens() const {
  absl::MutexLock lock(&mu_);
  return tokens_ ? static_cast<int>(tokens_->size()) : 0;
}

std::map<std::string, int64_t> TokenAuthorizer::failures_by_reason() const {
  std::map<std::string, int64_t> out;
  for (int i = 0; i < static_cast<int>(AuthFailure::kCount); ++i) {
    out[AuthFailureName(static_cast<AuthFailure>(i))] = failures_[i].load(std::memory_order_relaxed);
  }
  return out;
}

AuthFailureCounters AddAuthFailureMetric(prometheus::Registry* registry) {
  auto& family = prometheus::BuildCounter()
                     .Name("qstream_auth_failures_total")
                     .Help("gRPC calls refused by the token check, by reason")
                     .Register(*registry);
  AuthFailureCounters counters{};
  for (int i = 0; i < static_cast<int>(AuthFailure::kCount); ++i) {
    counters[i] = &family.Add({{"reason", AuthFailureName(static_cast<AuthFailure>(i))}});
  }
  return counters;
}

void TokenAuthorizer::ExportFailures(const AuthFailureCounters& counters) {
  exported_counters_ = counters;
  exported_.store(true, std::memory_order_release);
}

grpc::Status TokenAuthorizer::Fail(AuthFailure reason, grpc::StatusCode code, std::string message) {
  failures_[static_cast<int>(reason)].fetch_add(1, std::memory_order_relaxed);
  if (exported_.load(std::memory_order_acquire)) exported_counters_[static_cast<int>(reason)]->Increment();
  return grpc::Status(code, std::move(message));
}

std::optional<Role> TokenAuthorizer::Lookup(absl::string_view token) {
  std::shared_ptr<const std::vector<TokenEntry>> tokens;
  {
    absl::MutexLock lock(&mu_);
    tokens = tokens_;
  }
  // Every entry is compared, in constant time each, whatever matches: the
  // time taken does not tell which entry (or how much of one) matched.
  const Sha256Digest digest = Sha256(token);
  int found = 0;
  int found_role = 0;
  for (const TokenEntry& e : *tokens) {
    const int eq = CRYPTO_memcmp(e.digest.data(), digest.data(), digest.size()) == 0;
    found |= eq;
    found_role |= eq * (static_cast<int>(e.role) + 1);
  }
  if (!found) return std::nullopt;
  return static_cast<Role>(found_role - 1);
}

namespace {

// The token of an `authorization: Bearer <token>` value; nullopt when malformed.
std::optional<absl::string_view> BearerToken(absl::string_view value) {
  if (value.size() < 7 || !absl::EqualsIgnoreCase(value.substr(0, 7), "Bearer ")) return std::nullopt;
  const absl::string_view token = absl::StripAsciiWhitespace(value.substr(7));
  if (token.empty() || token.size() > kMaxTokenChars) return std::nullopt;
  return token;
}

}  // namespace

std::optional<Role> TokenAuthorizer::RoleOf(const grpc::ServerContextBase& context) {
  const auto& md = context.client_metadata();
  const auto it = md.find("authorization");
  if (it == md.end()) return std::nullopt;
  const auto token = BearerToken(absl::string_view(it->second.data(), it->second.size()));
  if (!token) return std::nullopt;
  return Lookup(*token);
}

grpc::Status TokenAuthorizer::Check(absl::string_view method, const absl::string_view* authorization, Role* role) {
  const MethodAccess access = AccessFor(method);
  if (access.open) return grpc::Status::OK;
  if (authorization == nullptr) {
    return Fail(AuthFailure::kMissing, grpc::StatusCode::UNAUTHENTICATED,
                "missing call metadata `authorization: Bearer <token>` (qstreamd runs with --auth_tokens)");
  }
  const std::optional<absl::string_view> token = BearerToken(*authorization);
  if (!token) {
    return Fail(AuthFailure::kMalformed, grpc::StatusCode::UNAUTHENTICATED,
                "authorization: expected `Bearer <token>` (1 to 4096 characters)");
  }
  const std::optional<Role> found = Lookup(*token);
  if (!found) {
    return Fail(AuthFailure::kUnknownToken, grpc::StatusCode::UNAUTHENTICATED, "authorization: unknown token");
  }
  *role = *found;
  const bool allowed = *role == Role::kAdmin || (*role == Role::kActor && access.actor) ||
                       (*role == Role::kObserver && access.observer);
  if (!allowed) {
    return Fail(AuthFailure::kWrongRole, grpc::StatusCode::PERMISSION_DENIED,
                absl::StrCat("role ", RoleName(*role), " may not call ", method));
  }
  return grpc::Status::OK;
}

grpc::Status TokenAuthorizer::Process(const InputMetadata& auth_metadata, grpc::AuthContext* /*context*/,
                                      OutputMetadata* /*consumed_auth_metadata*/,
                                      OutputMetadata* /*response_metadata*/) {
  absl::string_view method;
  if (auto it = auth_metadata.find(":path"); it != auth_metadata.end()) {
    method = absl::string_view(it->second.data(), it->second.size());
  }
  const auto range = auth_metadata.equal_range("authorization");
  absl::string_view authorization;
  const absl::string_view* present = nullptr;
  int count = 0;
  for (auto it = range.first; it != range.second; ++it, ++count) {
    authorization = absl::string_view(it->second.data(), it->second.size());
    present = &authorization;
  }
  if (count > 1) {
    return Fail(AuthFailure::kMalformed, grpc::StatusCode::UNAUTHENTICATED,
                "authorization: given more than once");
  }
  // The header stays in the call's metadata (not consumed) for RoleOf.
  Role role = Role::kObserver;
  return Check(method, present, &role);
}

bool CallerIsAdmin(const grpc::ServerContextBase& context, TokenAuthorizer* authorizer) {
  if (authorizer == nullptr) return true;
  return authorizer->RoleOf(context) == Role::kAdmin;
}

bool IsLoopbackHost(absl::string_view host) {
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) host = host.substr(1, host.size() - 2);
  if (host == "localhost" || host == "::1") return true;
  std::vector<absl::string_view> octets = absl::StrSplit(host, '.');
  int first = 0;
  return octets.size() == 4 && absl::SimpleAtoi(octets[0], &first) && first == 127;
}

namespace {

using BioPtr = std::unique_ptr<BIO, decltype(&BIO_free)>;

BioPtr MemBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
}

absl::Status CheckTlsFiles(const SecurityOptions& o) {
  auto cert_pem = ReadSmallFile(o.tls_cert, "--tls_cert", 1 << 20);
  if (!cert_pem.ok()) return cert_pem.status();
  auto key_pem = ReadSmallFile(o.tls_key, "--tls_key", 1 << 20);
  if (!key_pem.ok()) return key_pem.status();
  BioPtr cert_bio = MemBio(*cert_pem);
  std::unique_ptr<X509, decltype(&X509_free)> cert(PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr),
                                                   &X509_free);
  if (cert == nullptr) return absl::InvalidArgumentError(absl::StrCat("--tls_cert=", o.tls_cert, ": no PEM certificate"));
  BioPtr key_bio = MemBio(*key_pem);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr), &EVP_PKEY_free);
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key=", o.tls_key, ": no unencrypted PEM private key"));
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key=", o.tls_key, ": does not match the certificate in --tls_cert=", o.tls_cert));
  }
  struct stat st {};
  if (::stat(o.tls_key.c_str(), &st) == 0 && (st.st_mode & 007) != 0) {
    spdlog::warn("--tls_key={} is readable by others (mode {:04o})", o.tls_key,
                 static_cast<unsigned>(st.st_mode & 0777));
  }
  if (!o.tls_client_ca.empty()) {
    auto ca_pem = ReadSmallFile(o.tls_client_ca, "--tls_client_ca", 4 << 20);
    if (!ca_pem.ok()) return ca_pem.status();
    BioPtr ca_bio = MemBio(*ca_pem);
    std::unique_ptr<X509, decltype(&X509_free)> ca(PEM_read_bio_X509(ca_bio.get(), nullptr, nullptr, nullptr),
                                                   &X509_free);
    if (ca == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("--tls_client_ca=", o.tls_client_ca, ": no PEM certificate"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckSecurityOptions(const SecurityOptions& o, const std::string& listen) {
  const bool tls = !o.tls_cert.empty() || !o.tls_key.empty();
  if (tls && (o.tls_cert.empty() || o.tls_key.empty())) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key: give both (PEM certificate chain and its key)");
  }
  if (!o.tls_client_ca.empty() && !tls) {
    return absl::InvalidArgumentError("--tls_client_ca: needs --tls_cert and --tls_key (mTLS is TLS first)");
  }
  if (o.tls_reload_interval < absl::Seconds(1)) {
    return absl::InvalidArgumentError("--tls_reload_interval: must be at least 1s");
  }
  const std::string host = AddressHost(listen);
  const bool loopback = IsLoopbackHost(host);
  if (!loopback && !tls) {
    if (!o.allow_insecure) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen=", listen, " is not a loopback address and TLS is off: anyone who can reach the port could "
          "stream experience, read the config and pause the learner, in clear text. Give --tls_cert/--tls_key "
          "(with --auth_tokens and/or --tls_client_ca), or --allow_insecure to accept that"));
    }
    if (!o.auth_tokens.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--auth_tokens with --allow_insecure on the non-loopback --listen=", listen,
          ": bearer tokens would cross the network in clear (and gRPC's insecure credentials cannot check them); "
          "give --tls_cert/--tls_key"));
    }
  }
  if (!loopback && tls && o.auth_tokens.empty() && o.tls_client_ca.empty() && !o.allow_insecure) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen=", listen, " is not a loopback address and no client is authenticated: every client could "
        "act as admin. Give --auth_tokens and/or --tls_client_ca, or --allow_insecure to accept that"));
  }
  if (tls) return CheckTlsFiles(o);
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const SecurityOptions& o, const std::string& listen,
                                                               std::shared_ptr<TokenAuthorizer> authorizer) {
  std::shared_ptr<grpc::ServerCredentials> creds;
  const unsigned reload = static_cast<unsigned>(absl::ToInt64Seconds(o.tls_reload_interval));
  if (!o.tls_cert.empty()) {
    std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider;
    if (o.tls_client_ca.empty()) {
      provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(o.tls_key, o.tls_cert, reload);
    } else {
      provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(o.tls_key, o.tls_cert,
                                                                                      o.tls_client_ca, reload);
    }
    grpc::experimental::TlsServerCredentialsOptions options(provider);
    options.watch_identity_key_cert_pairs();
    if (o.tls_client_ca.empty()) {
      options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    } else {
      options.watch_root_certs();
      options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    }
    creds = grpc::experimental::TlsServerCredentials(options);
  } else if (IsLoopbackHost(AddressHost(listen))) {
    // Plaintext, and gRPC refuses peers that are not on this host.
    creds = grpc::experimental::LocalServerCredentials(LOCAL_TCP);
  } else {
    return grpc::InsecureServerCredentials();  // --allow_insecure; no authorizer (CheckSecurityOptions)
  }
  if (authorizer != nullptr) creds->SetAuthMetadataProcessor(std::move(authorizer));
  return creds;
}

std::string SecuritySummary(const SecurityOptions& o, const TokenAuthorizer* authorizer) {
  std::string s = !o.tls_client_ca.empty() ? "mtls" : !o.tls_cert.empty() ? "tls" : "plaintext";
  absl::StrAppend(&s, authorizer ? absl::StrCat(" tokens=", authorizer->num_tokens()) : " no-tokens");
  if (o.reflection) absl::StrAppend(&s, " reflection");
  return s;
}

}  // namespace qstream
