// Security end to end (README "Security"): qstreamd child processes with
// TLS, mTLS and role tokens, real gRPC clients on loopback. Certificates are
// generated at test time by tests/tls/make_test_certs.sh.
#include <signal.h>
#include <sys/stat.h>

#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "proto/tensor.h"
#include "qstream/v1/admin.grpc.pb.h"
#include "qstream/v1/experience.grpc.pb.h"
#include "qstream/v1/policy.grpc.pb.h"
#include "server/security.h"
#include "tests/server/e2e_support.h"

namespace qstream {
namespace {

using ::qstream::testing::ChildProcess;
using ::qstream::testing::HttpGet;
using ::qstream::testing::ParseMetrics;
using ::qstream::testing::WriteTempFile;
using ::testing::HasSubstr;

constexpr char kConfig[] = R"(
network { obs_dim: 4 trunk_hidden: 16 head_hidden: 16 num_atoms: 11 branch_actions: 2 }
replay { capacity: 100000 batch_size: 16 }
rate_limiter { min_size_to_sample: 64 samples_per_insert: 0 }
server { publish_every: 5 }
)";

const char kActorToken[] = "actor-token-0123456789abcdef";
const char kObserverToken[] = "observer-token-0123456789abcdef";
const char kAdminToken[] = "admin-token-0123456789abcdef";
// Listed in the file by its digest only.
const char kHashedAdminToken[] = "hashed-admin-token-0123456789abcdef";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string TempDir() {
  const char* t = std::getenv("TEST_TMPDIR");
  std::string base = t ? t : ::testing::TempDir();
  static int n = 0;
  std::string dir = absl::StrCat(base, "/security_e2e_", getpid(), "_", n++);
  ::mkdir(dir.c_str(), 0700);
  return dir;
}

// Fresh CA, server and client certificates in a new directory.
std::string MakeCerts() {
  const std::string dir = TempDir() + "/certs";
  const std::string script = std::string(QSTREAM_TEST_SOURCE_DIR) + "/tests/tls/make_test_certs.sh";
  const std::string cmd = absl::StrCat("'", script, "' '", dir, "'");
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return dir;
}

std::string TokenFile(const std::string& extra = "") {
  const std::string hashed = absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(Sha256(kHashedAdminToken).data()), 32));
  const std::string path = WriteTempFile(
      "tokens.txt", absl::StrCat("# role token\n", "actor ", kActorToken, "\n", "observer ", kObserverToken,
                                 "\n", "admin ", kAdminToken, "\n", "admin sha256:", hashed, "\n", extra));
  ::chmod(path.c_str(), 0600);
  return path;
}

testing::Daemon StartOrDie(const std::vector<std::string>& extra) {
  return testing::StartCpuDaemonOrDie(kConfig, extra);
}

std::shared_ptr<grpc::Channel> Plain(const testing::Daemon& d) {
  return grpc::CreateChannel(d.grpc_address, grpc::InsecureChannelCredentials());
}

std::shared_ptr<grpc::Channel> Tls(const testing::Daemon& d, const std::string& ca,
                                   const std::string& cert = "", const std::string& key = "") {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = ReadFile(ca);
  if (!cert.empty()) {
    o.pem_cert_chain = ReadFile(cert);
    o.pem_private_key = ReadFile(key);
  }
  grpc::ChannelArguments args;
  // A new connection per channel, so each one runs its own handshake.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(d.grpc_address, grpc::SslCredentials(o), args);
}

void Authorize(grpc::ClientContext* c, const std::string& token, absl::Duration timeout = absl::Seconds(10)) {
  if (!token.empty()) c->AddMetadata("authorization", "Bearer " + token);
  c->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

// One KIND_NSTEP batch on a new stream; the stream's final status (OK after
// its ack and a half-close).
grpc::Status SendBatch(const std::shared_ptr<grpc::Channel>& ch, const std::string& token,
                       v1::Ack* ack = nullptr) {
  auto stub = v1::ExperienceService::NewStub(ch);
  grpc::ClientContext c;
  Authorize(&c, token);
  auto stream = stub->Stream(&c);
  v1::TransitionBatch b;
  b.set_kind(v1::TransitionBatch::KIND_NSTEP);
  b.set_count(2);
  b.set_sequence(1);
  std::vector<float> obs, next_obs;
  for (int i = 0; i < 8; ++i) {
    obs.push_back(0.1f * i);
    next_obs.push_back(0.2f * i);
  }
  wire::SetTensor(b.mutable_obs(), obs, {2, 4});
  wire::SetTensor(b.mutable_next_obs(), next_obs, {2, 4});
  wire::SetTensor(b.mutable_actions(), std::vector<int32_t>{0, 1}, {2, 1});
  wire::SetTensor(b.mutable_rewards(), std::vector<float>{1.0f, 1.0f}, {2});
  wire::SetTensor(b.mutable_discounts(), std::vector<float>{0.9f, 0.9f}, {2});
  v1::Ack got;
  if (stream->Write(b) && stream->Read(&got) && ack != nullptr) *ack = got;
  stream->WritesDone();
  return stream->Finish();
}

grpc::Status GetStatus(const std::shared_ptr<grpc::Channel>& ch, const std::string& token,
                       v1::StatusResponse* out = nullptr) {
  grpc::ClientContext c;
  Authorize(&c, token);
  v1::StatusResponse r;
  grpc::Status st = v1::AdminService::NewStub(ch)->Status(&c, v1::StatusRequest(), &r);
  if (out) *out = r;
  return st;
}

grpc::Status Health(const std::shared_ptr<grpc::Channel>& ch) {
  grpc::GenericStub stub(ch);
  grpc::ClientContext c;
  Authorize(&c, "");
  // HealthCheckRequest{service: ""} is the empty message.
  grpc::ByteBuffer request, response;
  grpc::Slice empty("");
  request = grpc::ByteBuffer(&empty, 1);
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(&c, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   status = s;
                   done = true;
                   cv.notify_all();
                 });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  return status;
}

// Every RPC of the daemon, called with `token`: method -> status code.
std::map<std::string, grpc::StatusCode> CallEverything(const std::shared_ptr<grpc::Channel>& ch,
                                                       const std::string& token) {
  std::map<std::string, grpc::StatusCode> codes;
  codes["Experience.Stream"] = SendBatch(ch, token).error_code();
  {
    grpc::ClientContext c;
    Authorize(&c, token);
    v1::Policy p;
    codes["Policy.GetPolicy"] =
        v1::PolicyService::NewStub(ch)->GetPolicy(&c, v1::GetPolicyRequest(), &p).error_code();
  }
  {
    grpc::ClientContext c;
    Authorize(&c, token, absl::Seconds(2));
    v1::WatchPolicyRequest r;
    r.set_after_version(-1);  // the current policy (version 0) comes at once
    auto reader = v1::PolicyService::NewStub(ch)->WatchPolicy(&c, r);
    v1::Policy p;
    const bool got = reader->Read(&p);
    if (got) c.TryCancel();
    const grpc::Status st = reader->Finish();
    codes["Policy.WatchPolicy"] = got ? grpc::StatusCode::OK : st.error_code();
  }
  {
    grpc::ClientContext c;
    Authorize(&c, token);
    v1::EvaluateRequest r;
    r.set_count(1);
    for (int i = 0; i < 4; ++i) r.add_obs(0.5f);
    v1::EvaluateResponse out;
    codes["Policy.Evaluate"] = v1::PolicyService::NewStub(ch)->Evaluate(&c, r, &out).error_code();
  }
  codes["Admin.Status"] = GetStatus(ch, token).error_code();
  {
    grpc::ClientContext c;
    Authorize(&c, token);
    v1::PauseResponse out;
    codes["Admin.Pause"] = v1::AdminService::NewStub(ch)->Pause(&c, v1::PauseRequest(), &out).error_code();
  }
  {
    grpc::ClientContext c;
    Authorize(&c, token);
    v1::ResumeResponse out;
    codes["Admin.Resume"] = v1::AdminService::NewStub(ch)->Resume(&c, v1::ResumeRequest(), &out).error_code();
  }
  {
    grpc::ClientContext c;
    Authorize(&c, token);
    v1::CheckpointRequest r;
    r.set_name("by-test");
    v1::CheckpointResponse out;
    codes["Admin.Checkpoint"] = v1::AdminService::NewStub(ch)->Checkpoint(&c, r, &out).error_code();
  }
  codes["Health.Check"] = Health(ch).error_code();
  return codes;
}

std::map<std::string, grpc::StatusCode> Expect(grpc::StatusCode experience, grpc::StatusCode policy,
                                               grpc::StatusCode status, grpc::StatusCode admin) {
  return {{"Experience.Stream", experience},
          {"Policy.GetPolicy", policy},
          {"Policy.WatchPolicy", policy},
          {"Policy.Evaluate", policy},
          {"Admin.Status", status},
          {"Admin.Pause", admin},
          {"Admin.Resume", admin},
          {"Admin.Checkpoint", admin},
          {"Health.Check", grpc::StatusCode::OK}};
}

using Code = grpc::StatusCode;

// Each role against each RPC, on plaintext loopback and on TLS.
void CheckRoleMatrix(const std::shared_ptr<grpc::Channel>& ch, const testing::Daemon& d) {
  EXPECT_EQ(CallEverything(ch, ""), Expect(Code::UNAUTHENTICATED, Code::UNAUTHENTICATED,
                                           Code::UNAUTHENTICATED, Code::UNAUTHENTICATED));
  EXPECT_EQ(
      CallEverything(ch, "not-a-known-token-0123456789"),
      Expect(Code::UNAUTHENTICATED, Code::UNAUTHENTICATED, Code::UNAUTHENTICATED, Code::UNAUTHENTICATED));
  EXPECT_EQ(CallEverything(ch, kActorToken),
            Expect(Code::OK, Code::OK, Code::PERMISSION_DENIED, Code::PERMISSION_DENIED));
  EXPECT_EQ(CallEverything(ch, kObserverToken),
            Expect(Code::PERMISSION_DENIED, Code::PERMISSION_DENIED, Code::OK, Code::PERMISSION_DENIED));
  // Checkpoint needs --checkpoint_dir (the daemons here have one).
  EXPECT_EQ(CallEverything(ch, kAdminToken), Expect(Code::OK, Code::OK, Code::OK, Code::OK));
  EXPECT_EQ(CallEverything(ch, kHashedAdminToken), Expect(Code::OK, Code::OK, Code::OK, Code::OK));

  // A malformed header is refused as such.
  {
    grpc::ClientContext c;
    c.AddMetadata("authorization", std::string("Basic ") + kAdminToken);
    v1::StatusResponse r;
    const grpc::Status st = v1::AdminService::NewStub(ch)->Status(&c, v1::StatusRequest(), &r);
    EXPECT_EQ(st.error_code(), Code::UNAUTHENTICATED);
    EXPECT_THAT(st.error_message(), HasSubstr("Bearer"));
  }
  // Observers get Status without the config; admins with it.
  v1::StatusResponse observed, full;
  ASSERT_TRUE(GetStatus(ch, kObserverToken, &observed).ok());
  EXPECT_FALSE(observed.has_config());
  EXPECT_TRUE(observed.config_redacted());
  EXPECT_GT(observed.replay_capacity(), 0);
  ASSERT_TRUE(GetStatus(ch, kAdminToken, &full).ok());
  EXPECT_TRUE(full.has_config());
  EXPECT_FALSE(full.config_redacted());
  EXPECT_EQ(full.config().network().obs_dim(), 4);

  // No error message or log line carries a token.
  for (const char* token : {kActorToken, kObserverToken, kAdminToken, kHashedAdminToken}) {
    EXPECT_THAT(d.process->output(), ::testing::Not(HasSubstr(token)));
  }
}

std::vector<std::string> SecureFlags(const std::string& certs, bool mtls) {
  std::vector<std::string> f = {"--tls_cert=" + certs + "/server.pem", "--tls_key=" + certs + "/server.key"};
  if (mtls) f.push_back("--tls_client_ca=" + certs + "/ca.pem");
  return f;
}

TEST(SecurityE2E, RolesOnPlaintextLoopbackAndFailuresCounted) {
  const std::string ckpt = TempDir() + "/ckpt";
  auto d = StartOrDie({"--auth_tokens=" + TokenFile(), "--checkpoint_dir=" + ckpt});
  EXPECT_THAT(d.process->output(), HasSubstr("security=plaintext tokens=4"));
  auto ch = Plain(d);
  CheckRoleMatrix(ch, d);

  // Counted by reason, on /metrics (the poll runs every 500 ms).
  std::map<std::string, double> m;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  do {
    absl::SleepFor(absl::Milliseconds(200));
    m = ParseMetrics(HttpGet(d.metrics_port, "/metrics"));
  } while (m["qstream_auth_failures_total{reason=\"wrong_role\"}"] < 11 && absl::Now() < deadline);
  // 8 calls without a token, 8 with an unknown one (health is open), one
  // malformed; actor: 4 denied, observer: 7 denied.
  EXPECT_EQ(m["qstream_auth_failures_total{reason=\"missing_token\"}"], 8);
  EXPECT_EQ(m["qstream_auth_failures_total{reason=\"unknown_token\"}"], 8);
  EXPECT_EQ(m["qstream_auth_failures_total{reason=\"malformed_token\"}"], 1);
  EXPECT_EQ(m["qstream_auth_failures_total{reason=\"wrong_role\"}"], 11);
}

TEST(SecurityE2E, ReflectionOnlyWhenAsked) {
  auto check = [](const testing::Daemon& d, const std::string& token) {
    grpc::GenericStub stub(Plain(d));
    grpc::ClientContext c;
    Authorize(&c, token);
    grpc::CompletionQueue cq;
    auto call = stub.PrepareCall(&c, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
    void* tag;
    bool ok;
    call->StartCall(reinterpret_cast<void*>(1));
    cq.Next(&tag, &ok);
    call->WritesDone(reinterpret_cast<void*>(2));
    cq.Next(&tag, &ok);
    grpc::Status status;
    call->Finish(&status, reinterpret_cast<void*>(3));
    while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(3)) {
    }
    return status.error_code();
  };
  {
    auto d = StartOrDie({});
    EXPECT_EQ(check(d, ""), Code::UNIMPLEMENTED);
  }
  {
    auto d = StartOrDie({"--reflection", "--auth_tokens=" + TokenFile()});
    EXPECT_EQ(check(d, ""), Code::UNAUTHENTICATED);
    EXPECT_EQ(check(d, kObserverToken), Code::OK);
  }
}

TEST(SecurityE2E, TlsServesTheRoleMatrixAndRefusesPlaintextAndUnknownCas) {
  const std::string certs = MakeCerts();
  const std::string ckpt = TempDir() + "/ckpt";
  auto flags = SecureFlags(certs, /*mtls=*/false);
  flags.push_back("--auth_tokens=" + TokenFile());
  flags.push_back("--checkpoint_dir=" + ckpt);
  flags.push_back("--health_listen=127.0.0.1:0");
  auto d = StartOrDie(flags);
  EXPECT_THAT(d.process->output(), HasSubstr("security=tls tokens=4"));

  // The plaintext health port (for kubelet probes) answers health and nothing else.
  std::smatch m;
  const std::string out = d.process->output();
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(health=(127\.0\.0\.1:\d+))"))) << out;
  auto health = grpc::CreateChannel(m[1].str(), grpc::InsecureChannelCredentials());
  EXPECT_EQ(testing::HealthStatus(health), 1);
  EXPECT_EQ(GetStatus(health, kAdminToken).error_code(), Code::UNIMPLEMENTED);
  EXPECT_EQ(SendBatch(health, kActorToken).error_code(), Code::UNIMPLEMENTED);
  CheckRoleMatrix(Tls(d, certs + "/ca.pem"), d);

  // A plaintext client gets no connection; nor does one that trusts another CA.
  EXPECT_EQ(GetStatus(Plain(d), kAdminToken).error_code(), Code::UNAVAILABLE);
  EXPECT_EQ(GetStatus(Tls(d, certs + "/other-ca.pem"), kAdminToken).error_code(), Code::UNAVAILABLE);
}

TEST(SecurityE2E, MutualTlsRefusesMissingAndWrongClientCertificates) {
  const std::string certs = MakeCerts();
  // mTLS alone authenticates clients: no tokens, every verified client is admin.
  auto d = StartOrDie(SecureFlags(certs, /*mtls=*/true));
  EXPECT_THAT(d.process->output(), HasSubstr("security=mtls no-tokens"));
  v1::Ack ack;
  EXPECT_TRUE(
      SendBatch(Tls(d, certs + "/ca.pem", certs + "/client.pem", certs + "/client.key"), "", &ack).ok());
  EXPECT_EQ(ack.accepted(), 2u);
  v1::StatusResponse s;
  EXPECT_TRUE(
      GetStatus(Tls(d, certs + "/ca.pem", certs + "/client.pem", certs + "/client.key"), "", &s).ok());
  EXPECT_TRUE(s.has_config());

  EXPECT_EQ(SendBatch(Tls(d, certs + "/ca.pem"), "").error_code(), Code::UNAVAILABLE);
  EXPECT_EQ(SendBatch(Tls(d, certs + "/ca.pem", certs + "/other-client.pem", certs + "/other-client.key"), "")
                .error_code(),
            Code::UNAVAILABLE);
}

int ScrapeStatus(const testing::Daemon& d, const std::string& user_password) {
  auto r = testing::HttpExchange(
      d.metrics_port, testing::HttpGetRequest("/metrics", "Basic " + absl::Base64Escape(user_password)),
      absl::Seconds(10));
  return r ? r->status : -1;
}

TEST(SecurityE2E, SighupReloadsTokensAndKeepsThemOnABadFile) {
  const std::string path = TokenFile();
  const std::string metrics_auth = WriteTempFile("metrics-auth.txt", "prometheus first-password\n");
  auto d = StartOrDie({"--auth_tokens=" + path, "--metrics_auth_file=" + metrics_auth});
  auto ch = Plain(d);
  ASSERT_TRUE(SendBatch(ch, kActorToken).ok());
  EXPECT_EQ(ScrapeStatus(d, "prometheus:first-password"), 200);
  { std::ofstream(metrics_auth, std::ios::trunc) << "prometheus second-password\n"; }

  const std::string rotated =
      "actor rotated-actor-token-0123456789\nadmin " + std::string(kAdminToken) + "\n";
  { std::ofstream(path, std::ios::trunc) << rotated; }
  d.process->Signal(SIGHUP);
  ASSERT_TRUE(d.process->WaitForLine("SIGHUP: token and metrics auth files re-read", absl::Seconds(10)))
      << d.process->output();
  EXPECT_EQ(SendBatch(ch, kActorToken).error_code(), Code::UNAUTHENTICATED);
  EXPECT_TRUE(SendBatch(ch, "rotated-actor-token-0123456789").ok());
  EXPECT_EQ(ScrapeStatus(d, "prometheus:first-password"), 401);
  EXPECT_EQ(ScrapeStatus(d, "prometheus:second-password"), 200);

  { std::ofstream(path, std::ios::trunc) << "actor short\n"; }
  d.process->Signal(SIGHUP);
  auto line = d.process->WaitForLine("SIGHUP: --auth_tokens", absl::Seconds(10));
  ASSERT_TRUE(line) << d.process->output();
  EXPECT_THAT(*line, HasSubstr(":1: token of 5 characters"));
  EXPECT_THAT(*line, ::testing::Not(HasSubstr("short")));
  EXPECT_TRUE(SendBatch(ch, "rotated-actor-token-0123456789").ok());  // the previous table stays
}

TEST(SecurityE2E, CertificateRotationKeepsOpenStreams) {
  const std::string certs = MakeCerts();
  const std::string live = TempDir();
  for (const char* f : {"server.pem", "server.key"}) {
    std::ofstream(live + "/" + f) << ReadFile(certs + "/" + f);
  }
  ::chmod((live + "/server.key").c_str(), 0600);
  auto d = StartOrDie({"--tls_cert=" + live + "/server.pem", "--tls_key=" + live + "/server.key",
                       "--tls_reload_interval=1s", "--auth_tokens=" + TokenFile()});
  // A stream opened with the first certificate.
  auto stub = v1::ExperienceService::NewStub(Tls(d, certs + "/ca.pem"));
  grpc::ClientContext c;
  Authorize(&c, kActorToken, absl::Seconds(60));
  auto stream = stub->Stream(&c);
  auto batch = [](int64_t seq) {
    v1::TransitionBatch b;
    b.set_kind(v1::TransitionBatch::KIND_NSTEP);
    b.set_stream_id("rotation");
    b.set_count(1);
    b.set_sequence(seq);
    wire::SetTensor(b.mutable_obs(), std::vector<float>(4, 0.1f), {1, 4});
    wire::SetTensor(b.mutable_next_obs(), std::vector<float>(4, 0.2f), {1, 4});
    wire::SetTensor(b.mutable_actions(), std::vector<int32_t>{0}, {1, 1});
    wire::SetTensor(b.mutable_rewards(), std::vector<float>{1.0f}, {1});
    wire::SetTensor(b.mutable_discounts(), std::vector<float>{0.9f}, {1});
    return b;
  };
  v1::Ack ack;
  ASSERT_TRUE(stream->Write(batch(1)) && stream->Read(&ack));

  // New server certificate from a new CA, written in place.
  const std::string next = MakeCerts();
  for (const char* f : {"server.key", "server.pem"}) {
    std::ofstream(live + "/" + f + ".tmp") << ReadFile(next + "/" + f);
    ASSERT_EQ(::rename((live + "/" + f + ".tmp").c_str(), (live + "/" + f).c_str()), 0);
  }
  // New connections get the new certificate once the watcher has read it.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!GetStatus(Tls(d, next + "/ca.pem"), kAdminToken).ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_TRUE(GetStatus(Tls(d, next + "/ca.pem"), kAdminToken).ok());
  EXPECT_EQ(GetStatus(Tls(d, certs + "/ca.pem"), kAdminToken).error_code(), Code::UNAVAILABLE);
  // The stream opened before the rotation carries on.
  ASSERT_TRUE(stream->Write(batch(2)) && stream->Read(&ack));
  EXPECT_EQ(ack.sequence(), 2);
  EXPECT_EQ(ack.accepted(), 1u);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// Refusals at start-up: exit code 2 and a message saying why.
struct Refusal {
  std::vector<std::string> flags;
  std::string says;
};

TEST(SecurityE2E, UnsafeListenAddressesAreRefusedAtStartUp) {
  const std::string certs = MakeCerts();
  const std::string tokens = TokenFile();
  const std::vector<Refusal> cases = {
      {{"--listen=0.0.0.0:0"}, "is not a loopback address and TLS is off"},
      {{"--listen=0.0.0.0:0", "--allow_insecure", "--auth_tokens=" + tokens},
       "would cross the network in clear"},
      {{"--listen=0.0.0.0:0", "--tls_cert=" + certs + "/server.pem", "--tls_key=" + certs + "/server.key"},
       "no client is authenticated"},
      {{"--tls_cert=" + certs + "/server.pem"}, "give both"},
      {{"--tls_cert=" + certs + "/server.pem", "--tls_key=" + certs + "/client.key"}, "does not match"},
      {{"--tls_cert=" + certs + "/server.key", "--tls_key=" + certs + "/server.key"}, "no PEM certificate"},
      {{"--auth_tokens=" + WriteTempFile("bad-tokens.txt", "operator abcdefghijklmnopqrstu\n")},
       ":1: role \"operator\" is not one of actor, observer, admin"},
      {{"--auth_tokens=/nonexistent/tokens"}, "cannot be read"},
  };
  for (const Refusal& r : cases) {
    std::vector<std::string> argv = {testing::BuildDir() + "/qstreamd", "--backend=cpu",
                                     "--listen=127.0.0.1:0", "--metrics_listen="};
    argv.insert(argv.end(), r.flags.begin(), r.flags.end());
    auto p = ChildProcess::Spawn(argv);
    EXPECT_EQ(p->Wait(absl::Seconds(30)), 2) << absl::StrJoin(r.flags, " ") << "\n" << p->output();
    EXPECT_THAT(p->output(), HasSubstr(r.says)) << absl::StrJoin(r.flags, " ");
  }
  // Accepted on purpose: the daemon starts.
  std::string error;
  auto d = testing::StartDaemon({"--backend=cpu", "--listen=0.0.0.0:0", "--allow_insecure"}, &error);
  ASSERT_TRUE(d) << error;
  EXPECT_THAT(d->process->output(), HasSubstr("security=plaintext no-tokens"));
}

}  // namespace
}  // namespace qstream
