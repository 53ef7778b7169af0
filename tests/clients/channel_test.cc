// The actor's channel factory: token files, flag combinations, loopback
// detection, and the bearer token on every call (against a small in-process
// PolicyService that records the metadata it sees).
#include "clients/cpp/channel.h"

#include <unistd.h>

#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "qstream/v1/policy.grpc.pb.h"

namespace qstream::actor {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TempFile(const std::string& name, const std::string& text) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp ? tmp : "/tmp", "/qstream_channel_test_", getpid(), "_", name);
  std::ofstream(path) << text;
  return path;
}

TEST(ReadTokenFileTest, StripsTrailingNewline) {
  auto token = ReadTokenFile(TempFile("token", "actor-token-0123456789\n"));
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(*token, "actor-token-0123456789");
}

TEST(ReadTokenFileTest, ErrorsNameTheFile) {
  const std::string empty = TempFile("empty", "\n");
  auto token = ReadTokenFile(empty);
  EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(token.status().message(), HasSubstr(empty + " is empty"));

  token = ReadTokenFile("/nonexistent/qstream.token");
  EXPECT_THAT(token.status().message(), HasSubstr("--token_file: cannot read /nonexistent/qstream.token"));

  token = ReadTokenFile(TempFile("two_lines", "first-part\nsecond-part\n"));
  EXPECT_THAT(token.status().message(), HasSubstr("one line of printable ASCII"));
}

TEST(CreateChannelTest, RefusesFlagCombinationsAndUnreadableFiles) {
  ChannelOptions o;
  o.server = "127.0.0.1:1";
  o.tls_cert_file = TempFile("cert.pem", "-----BEGIN CERTIFICATE-----\n");
  EXPECT_THAT(CreateChannel(o).status().message(), HasSubstr("--tls_cert and --tls_key go together"));

  o = {};
  o.server = "127.0.0.1:1";
  o.tls_server_name = "localhost";
  EXPECT_THAT(CreateChannel(o).status().message(), HasSubstr("--tls_server_name needs TLS"));

  o = {};
  o.server = "127.0.0.1:1";
  o.tls_ca_file = "/nonexistent/ca.pem";
  EXPECT_THAT(CreateChannel(o).status().message(), HasSubstr("--tls_ca: cannot read /nonexistent/ca.pem"));

  o.tls_ca_file = TempFile("not_pem", "hello\n");
  EXPECT_THAT(CreateChannel(o).status().message(), HasSubstr("holds no PEM block"));
}

TEST(ParseServerListTest, OneAddressAListOrATargetUri) {
  using V = std::vector<std::string>;
  EXPECT_EQ(*ParseServerList("127.0.0.1:50051"), V{"127.0.0.1:50051"});
  EXPECT_EQ(*ParseServerList("rank-0:50051, rank-1:50052"), (V{"rank-0:50051", "rank-1:50052"}));
  EXPECT_EQ(*ParseServerList("[::1]:1,localhost:65535"), (V{"[::1]:1", "localhost:65535"}));
  // A target URI is one target, commas of an ipv4: list included.
  EXPECT_EQ(*ParseServerList("dns:///qstream-ranks.ns.svc:50051"), V{"dns:///qstream-ranks.ns.svc:50051"});
  EXPECT_EQ(*ParseServerList("ipv4:10.0.0.1:50051,10.0.0.2:50051"), V{"ipv4:10.0.0.1:50051,10.0.0.2:50051"});
  EXPECT_EQ(*ParseServerList("unix:/run/qstream.sock"), V{"unix:/run/qstream.sock"});
}

TEST(ParseServerListTest, ErrorsNameTheFlagAndTheEntry) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "--server is empty"},
      {"a:1,,b:2", "--server: entry 2 of 'a:1,,b:2' is empty"},
      {"a:1,", "--server: entry 2 of 'a:1,' is empty"},
      {"daemon", "--server: 'daemon' is not host:port"},
      {"a:1,b", "--server: 'b' is not host:port"},
      {"a:0", "'a:0' is not host:port"},
      {"a:65536", "'a:65536' is not host:port"},
      {"a:+1", "'a:+1' is not host:port"},
      {":50051", "':50051' is not host:port"},
      {"::1:50051", "an IPv6 host in brackets"},
      {"a:1,a:1", "--server: 'a:1' is listed twice"},
      {"a:1,dns:///b:2", "--server: 'dns:///b:2' is a target URI, which must be the whole value"},
      {"dns:///a:1,b:2", "a dns: target names one host"},
  };
  for (const auto& [value, message] : cases) {
    auto servers = ParseServerList(value);
    EXPECT_EQ(servers.status().code(), absl::StatusCode::kInvalidArgument) << value;
    EXPECT_THAT(servers.status().message(), HasSubstr(message)) << value;
  }
}

TEST(IsLoopbackServerTest, LoopbackNamesAndAddresses) {
  EXPECT_TRUE(IsLoopbackServer("127.0.0.1:50051"));
  EXPECT_TRUE(IsLoopbackServer("localhost:50051"));
  EXPECT_TRUE(IsLoopbackServer("[::1]:50051"));
  EXPECT_TRUE(IsLoopbackServer("ipv4:127.0.0.2:1"));
  EXPECT_TRUE(IsLoopbackServer("unix:/tmp/qstream.sock"));
  EXPECT_FALSE(IsLoopbackServer("0.0.0.0:50051"));
  EXPECT_FALSE(IsLoopbackServer("daemon.example:50051"));
  EXPECT_FALSE(IsLoopbackServer("[2001:db8::1]:50051"));
}

TEST(TokenRefusedErrorTest, SaysTheTokenWasRefused) {
  const absl::Status s =
      TokenRefusedError("GetPolicy", grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "role observer"));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(), "GetPolicy: the daemon refused the token (PERMISSION_DENIED: role observer)");
  EXPECT_TRUE(IsTokenRefused(grpc::StatusCode::UNAUTHENTICATED));
  EXPECT_FALSE(IsTokenRefused(grpc::StatusCode::UNAVAILABLE));
}

// Answers GetPolicy and WatchPolicy after noting each call's authorization header.
class RecordingPolicyService final : public v1::PolicyService::Service {
 public:
  grpc::Status GetPolicy(grpc::ServerContext* context, const v1::GetPolicyRequest*, v1::Policy*) override {
    Record(*context);
    return grpc::Status::OK;
  }
  grpc::Status WatchPolicy(grpc::ServerContext* context, const v1::WatchPolicyRequest*,
                           grpc::ServerWriter<v1::Policy>*) override {
    Record(*context);
    return grpc::Status::OK;
  }
  std::vector<std::string> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  void Record(const grpc::ServerContext& context) {
    const auto& metadata = context.client_metadata();
    auto it = metadata.find("authorization");
    absl::MutexLock lock(&mu_);
    seen_.push_back(it == metadata.end() ? "<none>" : std::string(it->second.data(), it->second.size()));
  }
  absl::Mutex mu_;
  std::vector<std::string> seen_ ABSL_GUARDED_BY(mu_);
};

TEST(CreateChannelTest, EveryCallCarriesTheBearerToken) {
  RecordingPolicyService service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);

  ChannelOptions o;
  o.server = absl::StrCat("127.0.0.1:", port);
  o.token_file = TempFile("call_token", "actor-token-0123456789\n");
  auto channel = CreateChannel(o);
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto stub = v1::PolicyService::NewStub(*channel);
  {
    grpc::ClientContext ctx;
    v1::Policy policy;
    ASSERT_TRUE(stub->GetPolicy(&ctx, v1::GetPolicyRequest(), &policy).ok());
  }
  {
    grpc::ClientContext ctx;
    auto reader = stub->WatchPolicy(&ctx, v1::WatchPolicyRequest());
    v1::Policy policy;
    while (reader->Read(&policy)) {
    }
    ASSERT_TRUE(reader->Finish().ok());
  }
  o.token_file.clear();
  auto plain = CreateChannel(o);
  ASSERT_TRUE(plain.ok());
  {
    grpc::ClientContext ctx;
    v1::Policy policy;
    ASSERT_TRUE(v1::PolicyService::NewStub(*plain)->GetPolicy(&ctx, v1::GetPolicyRequest(), &policy).ok());
  }
  EXPECT_THAT(service.seen(), ElementsAre("Bearer actor-token-0123456789", "Bearer actor-token-0123456789",
                                          "<none>"));
  server->Shutdown();
}

}  // namespace
}  // namespace qstream::actor
