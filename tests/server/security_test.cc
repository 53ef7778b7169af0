// Token file parsing, the role table per method, the token check and the
// listen-address rules (server/security.h). End to end: security_e2e_test.
#include "server/security.h"

#include <fstream>
#include <random>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace qstream {
namespace {

using ::testing::HasSubstr;

std::string RandomToken(std::mt19937_64& rng) {
  static const char kChars[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.";
  std::string t(24 + rng() % 40, ' ');
  for (char& c : t) c = kChars[rng() % (sizeof(kChars) - 1)];
  return t;
}

std::string Hex(const Sha256Digest& d) {
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(d.data()), d.size()));
}

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(Hex(Sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Hex(Sha256("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(ParseTokenFile, PlainAndHashedTokensWithCommentsAndBlankLines) {
  const std::string text = absl::StrCat("# qstream tokens\n\n", "actor   aaaaaaaaaaaaaaaaaaaa\n",
                                        "\tobserver bbbbbbbbbbbbbbbbbbbb  \n", "admin sha256:", Hex(Sha256("cccc")),
                                        "\n");
  auto entries = ParseTokenFile(text, "tokens");
  ASSERT_TRUE(entries.ok()) << entries.status();
  ASSERT_EQ(entries->size(), 3u);
  EXPECT_EQ((*entries)[0].role, Role::kActor);
  EXPECT_EQ((*entries)[0].digest, Sha256("aaaaaaaaaaaaaaaaaaaa"));
  EXPECT_EQ((*entries)[1].role, Role::kObserver);
  EXPECT_EQ((*entries)[2].role, Role::kAdmin);
  EXPECT_EQ((*entries)[2].digest, Sha256("cccc"));
}

TEST(ParseTokenFile, BadLinesAreNamedAndTokensNeverEchoed) {
  const std::string secret = "zzzzzzzzzzzzzzzzzzzzzzzz";
  struct Case {
    std::string text;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"actor\n", "tokens:1: expected `<role> <token>`"},
      {"actor a b\n", "got 3 words"},
      {"# c\nroot " + secret + "\n", "tokens:2: role \"root\" is not one of"},
      {"actor short\n", "token of 5 characters: needs 16 to 4096"},
      {"admin sha256:abcd\n", "sha256: needs 64 hex digits, got 4"},
      {"admin sha256:" + std::string(64, 'g') + "\n", "needs 64 hex digits"},
      {"actor " + secret + "\nadmin " + secret + "\n", "tokens:2: the same token is listed twice"},
      {"actor " + secret + "\x01" + "\n", "printable"},
      {"# nothing\n\n", "tokens: no tokens"},
  };
  for (const Case& c : cases) {
    auto entries = ParseTokenFile(c.text, "tokens");
    ASSERT_FALSE(entries.ok()) << c.text;
    EXPECT_EQ(entries.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(entries.status().message()), HasSubstr(c.says)) << c.text;
    EXPECT_THAT(std::string(entries.status().message()), ::testing::Not(HasSubstr(secret)));
  }
}

TEST(AccessFor, EveryServiceHasItsRoles) {
  const MethodAccess health = AccessFor("/grpc.health.v1.Health/Check");
  EXPECT_TRUE(health.open);
  for (const char* m : {"/qstream.v1.ExperienceService/Stream", "/qstream.v1.PolicyService/GetPolicy",
                        "/qstream.v1.PolicyService/WatchPolicy", "/qstream.v1.PolicyService/Evaluate"}) {
    const MethodAccess a = AccessFor(m);
    EXPECT_FALSE(a.open) << m;
    EXPECT_TRUE(a.actor) << m;
    EXPECT_FALSE(a.observer) << m;
  }
  const MethodAccess status = AccessFor("/qstream.v1.AdminService/Status");
  EXPECT_TRUE(status.observer);
  EXPECT_FALSE(status.actor);
  for (const char* m : {"/qstream.v1.AdminService/Pause", "/qstream.v1.AdminService/Resume",
                        "/qstream.v1.AdminService/Checkpoint", "/qstream.v1.AdminService/Unknown", "/x.Y/Z", ""}) {
    const MethodAccess a = AccessFor(m);
    EXPECT_FALSE(a.open || a.actor || a.observer) << m;
    EXPECT_TRUE(a.admin) << m;
  }
  // A prefix look-alike is not the service.
  EXPECT_FALSE(AccessFor("/qstream.v1.ExperienceServiceX/Stream").actor);
  EXPECT_FALSE(AccessFor("/grpc.health.v1.HealthX/Check").open);
}

class TokenAuthorizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed());
    for (auto* t : {&actor_, &observer_, &admin_, &hashed_}) *t = RandomToken(rng);
    path_ = ::testing::TempDir() + "/tokens_" + std::to_string(rng());
    Write(absl::StrCat("actor ", actor_, "\nobserver ", observer_, "\nadmin ", admin_, "\nactor sha256:",
                       Hex(Sha256(hashed_)), "\n"));
    auto a = TokenAuthorizer::Create(path_);
    ASSERT_TRUE(a.ok()) << a.status();
    auth_ = *a;
  }
  void Write(const std::string& text) { std::ofstream(path_, std::ios::trunc) << text; }

  grpc::StatusCode Call(const std::string& method, const std::string* header, Role* role = nullptr) {
    Role r = Role::kObserver;
    absl::string_view h;
    if (header) h = *header;
    const grpc::Status st = auth_->Check(method, header ? &h : nullptr, &r);
    if (role) *role = r;
    return st.error_code();
  }
  grpc::StatusCode Bearer(const std::string& method, const std::string& token, Role* role = nullptr) {
    const std::string h = "Bearer " + token;
    return Call(method, &h, role);
  }

  std::string actor_, observer_, admin_, hashed_, path_;
  std::shared_ptr<TokenAuthorizer> auth_;
};

TEST_F(TokenAuthorizerTest, DecidesPerRoleAndCountsFailures) {
  const std::string stream = "/qstream.v1.ExperienceService/Stream";
  const std::string status = "/qstream.v1.AdminService/Status";
  const std::string pause = "/qstream.v1.AdminService/Pause";
  Role role;
  EXPECT_EQ(Bearer(stream, actor_, &role), grpc::StatusCode::OK);
  EXPECT_EQ(role, Role::kActor);
  EXPECT_EQ(Bearer(stream, hashed_, &role), grpc::StatusCode::OK);
  EXPECT_EQ(role, Role::kActor);
  EXPECT_EQ(Bearer(status, observer_, &role), grpc::StatusCode::OK);
  EXPECT_EQ(role, Role::kObserver);
  EXPECT_EQ(Bearer(pause, admin_, &role), grpc::StatusCode::OK);
  EXPECT_EQ(role, Role::kAdmin);
  EXPECT_EQ(Bearer(stream, admin_), grpc::StatusCode::OK);

  EXPECT_EQ(Bearer(status, actor_), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Bearer(stream, observer_), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Bearer(pause, observer_), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Call(stream, nullptr), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Bearer(stream, actor_ + "x"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Bearer(stream, actor_.substr(1)), grpc::StatusCode::UNAUTHENTICATED);
  const std::string basic = "Basic " + actor_;
  EXPECT_EQ(Call(stream, &basic), grpc::StatusCode::UNAUTHENTICATED);
  const std::string empty = "Bearer ";
  EXPECT_EQ(Call(stream, &empty), grpc::StatusCode::UNAUTHENTICATED);
  // The scheme is case-insensitive (RFC 7235).
  const std::string lower = "bearer " + actor_;
  EXPECT_EQ(Call(stream, &lower), grpc::StatusCode::OK);
  // Health needs nothing.
  EXPECT_EQ(Call("/grpc.health.v1.Health/Check", nullptr), grpc::StatusCode::OK);

  EXPECT_EQ(auth_->failures(AuthFailure::kWrongRole), 3);
  EXPECT_EQ(auth_->failures(AuthFailure::kMissing), 1);
  EXPECT_EQ(auth_->failures(AuthFailure::kUnknownToken), 2);
  EXPECT_EQ(auth_->failures(AuthFailure::kMalformed), 2);
  EXPECT_EQ(auth_->failures_by_reason().at("wrong_role"), 3);
}

TEST_F(TokenAuthorizerTest, ReloadReplacesTheTableAndKeepsItOnError) {
  const std::string stream = "/qstream.v1.ExperienceService/Stream";
  Write("actor " + admin_ + "\n");  // the admin token is now an actor's
  ASSERT_TRUE(auth_->Reload().ok());
  EXPECT_EQ(auth_->num_tokens(), 1);
  Role role;
  EXPECT_EQ(Bearer(stream, admin_, &role), grpc::StatusCode::OK);
  EXPECT_EQ(role, Role::kActor);
  EXPECT_EQ(Bearer(stream, actor_), grpc::StatusCode::UNAUTHENTICATED);

  Write("actor tooshort\n");
  const absl::Status st = auth_->Reload();
  EXPECT_FALSE(st.ok());
  EXPECT_THAT(std::string(st.message()), HasSubstr(path_ + ":1:"));
  EXPECT_EQ(Bearer(stream, admin_), grpc::StatusCode::OK);  // previous table in force
  std::remove(path_.c_str());
  EXPECT_FALSE(auth_->Reload().ok());
  EXPECT_EQ(Bearer(stream, admin_), grpc::StatusCode::OK);
}

TEST(IsLoopbackHost, OnlyLoopback) {
  for (const char* h : {"127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"}) EXPECT_TRUE(IsLoopbackHost(h)) << h;
  for (const char* h : {"0.0.0.0", "[::]", "::", "10.0.0.1", "128.0.0.1", "example.com", "", "127.0.0", "1.127.0.0.1"}) {
    EXPECT_FALSE(IsLoopbackHost(h)) << h;
  }
}

TEST(CheckSecurityOptions, RefusesUnsafeCombinations) {
  SecurityOptions o;
  EXPECT_TRUE(CheckSecurityOptions(o, "127.0.0.1:50051").ok());
  EXPECT_TRUE(CheckSecurityOptions(o, "[::1]:50051").ok());
  const absl::Status open = CheckSecurityOptions(o, "0.0.0.0:50051");
  EXPECT_EQ(open.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(open.message()), HasSubstr("--allow_insecure"));
  o.allow_insecure = true;
  EXPECT_TRUE(CheckSecurityOptions(o, "0.0.0.0:50051").ok());
  o.auth_tokens = "/some/file";
  EXPECT_THAT(std::string(CheckSecurityOptions(o, "0.0.0.0:50051").message()), HasSubstr("in clear"));
  SecurityOptions half;
  half.tls_cert = "/x.pem";
  EXPECT_THAT(std::string(CheckSecurityOptions(half, "127.0.0.1:1").message()), HasSubstr("give both"));
  SecurityOptions ca_only;
  ca_only.tls_client_ca = "/ca.pem";
  EXPECT_THAT(std::string(CheckSecurityOptions(ca_only, "127.0.0.1:1").message()), HasSubstr("mTLS is TLS first"));
}

}  // namespace
}  // namespace qstream
