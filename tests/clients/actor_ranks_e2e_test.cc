// Actors over several ranks end to end: two qstreamd child processes on
// loopback ports chosen at run time, fed by one qstream-actor given both
// addresses (--server=A,B: each env streams to one rank, every step ends up
// in exactly one replay shard, the acks add up to what the ranks ingested),
// and by streams on one channel to a target URI of both (round_robin spreads
// new streams over its addresses).
#include <cstdint>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "clients/cpp/channel.h"
#include "clients/cpp/experience_stream.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/tensor.h"
#include "qstream/v1/admin.grpc.pb.h"
#include "tests/server/e2e_support.h"

namespace qstream {
namespace {

using ::testing::HasSubstr;

// CartPole's shapes; the learner never starts (min size = capacity), so the
// replay holds exactly what was inserted.
constexpr char kConfig[] = R"(
network { obs_dim: 4 trunk_hidden: 16 head_hidden: 8 num_atoms: 11 branch_actions: 2 }
replay { capacity: 200000 }
rate_limiter { min_size_to_sample: 200000 samples_per_insert: 1 }
returns { n_step: 3 gamma: 0.99 }
)";
constexpr int kNStep = 3;

int64_t Ingested(const testing::Daemon& d) {
  auto stub =
      v1::AdminService::NewStub(grpc::CreateChannel(d.grpc_address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  v1::StatusResponse status;
  const grpc::Status st = stub->Status(&context, v1::StatusRequest(), &status);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return status.transitions_ingested();
}

// qstream_transitions_ingested_total once the daemon's metrics poll reached
// `expected` (or whatever it shows after 20 s).
double IngestedMetric(const testing::Daemon& d, double expected) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  double value = -1;
  do {
    const auto metrics = testing::ParseMetrics(testing::HttpGet(d.metrics_port, "/metrics"));
    const auto it = metrics.find("qstream_transitions_ingested_total");
    value = it == metrics.end() ? -1 : it->second;
    if (value == expected) break;
    absl::SleepFor(absl::Milliseconds(100));
  } while (absl::Now() < deadline);
  return value;
}

std::unique_ptr<testing::ChildProcess> StartActor(const std::vector<std::string>& flags) {
  std::vector<std::string> argv = {testing::BuildDir() + "/qstream-actor", "--report_every_s=60"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return testing::ChildProcess::Spawn(argv);
}

TEST(ActorRanksE2E, EveryEnvStreamsToOneListedRankAndTheAcksAddUp) {
  const testing::Daemon a = testing::StartCpuDaemonOrDie(kConfig);
  const testing::Daemon b = testing::StartCpuDaemonOrDie(kConfig);
  constexpr int kEnvs = 4;
  constexpr int kSteps = 2000;  // 500 steps of each env
  auto actor = StartActor({absl::StrCat("--server=", a.grpc_address, ",", b.grpc_address),
                           absl::StrCat("--num_envs=", kEnvs), absl::StrCat("--steps=", kSteps),
                           "--batch_transitions=64", "--stream_id=ranks"});
  ASSERT_NE(actor, nullptr);
  ASSERT_EQ(actor->Wait(absl::Seconds(120)), 0) << actor->output();
  std::smatch m;
  const std::string& out = actor->output();
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(finished env_steps=(\d+) .* accepted=(\d+))"))) << out;
  EXPECT_EQ(std::stoll(m[1]), kSteps);
  const int64_t accepted = std::stoll(m[2]);

  // Envs 0-1 went to A, 2-3 to B; each rank's clean half-close flushed its
  // n-step windows, so every step is in exactly one shard.
  const int64_t on_a = Ingested(a);
  const int64_t on_b = Ingested(b);
  EXPECT_EQ(on_a, kSteps / 2);
  EXPECT_EQ(on_b, kSteps / 2);
  EXPECT_EQ(IngestedMetric(a, on_a), on_a);
  EXPECT_EQ(IngestedMetric(b, on_b), on_b);
  // The acks count a window's steps once they leave it: all but the last
  // n-1 steps of each env before the half-close.
  EXPECT_LE(accepted, on_a + on_b);
  EXPECT_GE(accepted, on_a + on_b - int64_t{kEnvs} * (kNStep - 1));
}

TEST(ActorRanksE2E, BadServerListsAreRefusedNamingTheFlag) {
  for (const auto& [flags, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--server=127.0.0.1:1,,127.0.0.1:2"},
            "--server: entry 2 of '127.0.0.1:1,,127.0.0.1:2' is empty"},
           {{"--server=127.0.0.1:1,127.0.0.1"}, "--server: '127.0.0.1' is not host:port"},
           {{"--server=127.0.0.1:1,127.0.0.1:1"}, "--server: '127.0.0.1:1' is listed twice"},
           {{"--server=127.0.0.1:1,127.0.0.1:2", "--num_envs=1"}, "--num_envs=1 is less than the 2 --server"},
       }) {
    auto actor = StartActor(flags);
    ASSERT_NE(actor, nullptr);
    EXPECT_EQ(actor->Wait(absl::Seconds(30)), 1) << actor->output();
    EXPECT_THAT(actor->output(), HasSubstr(message));
  }
}

// One KIND_NSTEP transition.
v1::TransitionBatch OneTransition() {
  v1::TransitionBatch b;
  b.set_kind(v1::TransitionBatch::KIND_NSTEP);
  b.set_count(1);
  const std::vector<float> obs = {0.1f, 0.2f, 0.3f, 0.4f};
  wire::SetTensor(b.mutable_obs(), obs, {1, 4});
  wire::SetTensor(b.mutable_next_obs(), obs, {1, 4});
  wire::SetTensor(b.mutable_actions(), std::vector<int32_t>{1}, {1, 1});
  wire::SetTensor(b.mutable_rewards(), std::vector<float>{1.0f}, {1});
  wire::SetTensor(b.mutable_discounts(), std::vector<float>{0.99f}, {1});
  return b;
}

TEST(ActorRanksE2E, TargetUriSpreadsNewStreamsOverItsAddresses) {
  const testing::Daemon a = testing::StartCpuDaemonOrDie(kConfig);
  const testing::Daemon b = testing::StartCpuDaemonOrDie(kConfig);
  // One target that resolves to both addresses, as dns:/// of a headless
  // Service does (a test cannot make a DNS name resolve to two ports).
  actor::ChannelOptions options;
  options.server = absl::StrCat("ipv4:", a.grpc_address, ",", b.grpc_address);
  auto channel = actor::CreateChannel(options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  // Each new stream goes to the next ready address; the first ones may all
  // find only one connected yet.
  int streams = 0;
  for (; streams < 20 && (Ingested(a) == 0 || Ingested(b) == 0); ++streams) {
    actor::ExperienceStream::Options so;
    so.stream_id = absl::StrCat("uri-", streams);
    auto stream = actor::ExperienceStream::Open(*channel, so);
    ASSERT_TRUE(stream.ok()) << stream.status();
    ASSERT_TRUE((*stream)->Send(OneTransition()).ok());
    ASSERT_TRUE((*stream)->Close().ok());
  }
  EXPECT_GT(Ingested(a), 0);
  EXPECT_GT(Ingested(b), 0);
  EXPECT_EQ(Ingested(a) + Ingested(b), streams);
}

}  // namespace
}  // namespace qstream
