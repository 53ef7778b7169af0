// Episode reports end to end: qstreamd as a child process on loopback ports
// chosen at run time, real gRPC streams carrying TransitionBatch.episodes,
// and the /metrics page scraped over HTTP. Each report is counted exactly
// once: a resent batch (on the same stream, and after a reconnect) and a
// rejected batch count nothing; env labels beyond the bound count as
// env="other".
#include <algorithm>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "proto/tensor.h"
#include "qstream/v1/admin.grpc.pb.h"
#include "qstream/v1/experience.grpc.pb.h"
#include "tests/server/e2e_support.h"

namespace qstream {
namespace {

using ::qstream::testing::HttpGet;
using ::qstream::testing::MetricTypes;
using ::qstream::testing::ParseMetrics;

constexpr int kObsDim = 4;
constexpr int kMaxEnvLabels = 32;  // kMaxEpisodeEnvLabels of server/ingest_counters.h (README "Limits")

// A small network; --start_paused: batches are inserted and acknowledged,
// no step is taken.
constexpr char kConfig[] = R"(
network { obs_dim: 4 trunk_hidden: 16 head_hidden: 16 num_atoms: 11 branch_actions: 3 }
replay { capacity: 100000 batch_size: 8 }
rate_limiter { min_size_to_sample: 64 samples_per_insert: 0 }
returns { n_step: 3 gamma: 0.9 }
)";

v1::EpisodeReport Episode(double episode_return, uint32_t length, int64_t policy_version = 0) {
  v1::EpisodeReport r;
  r.set_episode_return(episode_return);
  r.set_length(length);
  r.set_policy_version(policy_version);
  return r;
}

// KIND_NSTEP batch of `count` random transitions carrying `episodes`.
v1::TransitionBatch Batch(int count, uint64_t sequence, const std::string& env,
                          const std::vector<v1::EpisodeReport>& episodes, std::mt19937* rng) {
  v1::TransitionBatch b;
  if (count > 0) {
    b = testing::RandomNStepBatch(count, sequence, kObsDim, {3}, 0.81f, rng);
  } else {  // episode reports alone
    b.set_kind(v1::TransitionBatch::KIND_NSTEP);
    b.set_sequence(sequence);
  }
  b.set_env(env);
  for (const auto& e : episodes) *b.add_episodes() = e;
  return b;
}

// One stream: writes every batch under `stream_id`, half-closes, returns the
// acks (one per batch); the stream must end with OK.
std::vector<v1::Ack> Exchange(v1::ExperienceService::Stub* stub, const std::string& stream_id,
                              std::vector<v1::TransitionBatch> batches) {
  grpc::ClientContext context;
  auto stream = stub->Stream(&context);
  for (auto& b : batches) {
    b.set_stream_id(stream_id);
    EXPECT_TRUE(stream->Write(b));
  }
  stream->WritesDone();
  std::vector<v1::Ack> acks;
  v1::Ack ack;
  while (stream->Read(&ack)) acks.push_back(ack);
  const grpc::Status st = stream->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(acks.size(), batches.size());
  return acks;
}

std::string Label(const std::string& env) { return absl::StrCat("{env=\"", env, "\"}"); }

std::string Bucket(const std::string& env, const std::string& le) {
  return absl::StrCat("qstream_episode_return_bucket{env=\"", env, "\",le=\"", le, "\"}");
}

double Get(const std::map<std::string, double>& m, const std::string& key) {
  const auto it = m.find(key);
  if (it == m.end()) {
    ADD_FAILURE() << key << " is not on the page";
    return -1;
  }
  return it->second;
}

TEST(EpisodesE2E, ReportsAreExportedOncePerCommittedBatchByEnv) {
  testing::Daemon d = testing::StartCpuDaemonOrDie(kConfig, {"--start_paused"});
  grpc::ChannelArguments args;
  auto channel = grpc::CreateCustomChannel(d.grpc_address, grpc::InsecureChannelCredentials(), args);
  auto stub = v1::ExperienceService::NewStub(channel);
  std::mt19937 rng(14);

  // An actor of CartPole-v1: two batches with reports, a resend of the first
  // on the same stream, a batch whose report is bad (rejected whole), one
  // whose column is bad (its good report rejected with it), and reports
  // alone in a batch of count 0.
  const v1::TransitionBatch b1 = Batch(4, 1, "CartPole-v1", {Episode(10, 10, 1), Episode(20, 20, 1)}, &rng);
  const v1::TransitionBatch b2 = Batch(3, 2, "CartPole-v1", {Episode(475.5, 476, 2)}, &rng);
  const v1::TransitionBatch bad_report = Batch(2, 3, "CartPole-v1", {Episode(1, 1), Episode(5, 0)}, &rng);
  v1::TransitionBatch bad_column = Batch(2, 4, "CartPole-v1", {Episode(1000, 7)}, &rng);
  wire::SetElement(bad_column.mutable_rewards(), 1, std::numeric_limits<float>::quiet_NaN());
  const v1::TransitionBatch alone = Batch(0, 5, "CartPole-v1", {Episode(-7.25, 3, 2)}, &rng);
  std::vector<v1::Ack> acks = Exchange(stub.get(), "actor-cart", {b1, b2, b1, bad_report, bad_column, alone});
  ASSERT_EQ(acks.size(), 6u);
  EXPECT_EQ(acks[0].accepted(), 4u);
  EXPECT_EQ(acks[1].accepted(), 3u);
  EXPECT_TRUE(acks[2].duplicate());
  EXPECT_EQ(acks[3].error().field(), "episodes");
  EXPECT_EQ(acks[3].error().message(), "episodes[1].length: 0 is not in [1, 1000000000]");
  EXPECT_EQ(acks[4].error().field(), "rewards");
  EXPECT_FALSE(acks[5].has_error()) << acks[5].error().message();
  EXPECT_FALSE(acks[5].duplicate());
  EXPECT_EQ(acks[5].accepted(), 0u);
  // The actor reconnects and resends everything it sent: all duplicates.
  acks = Exchange(stub.get(), "actor-cart", {b1, b2, alone});
  for (const v1::Ack& ack : acks) EXPECT_TRUE(ack.duplicate()) << ack.sequence();

  // An unnumbered batch without env: counted each time, as "unnamed".
  acks = Exchange(stub.get(), "",
                  {Batch(1, 0, "", {Episode(-3, 5)}, &rng), Batch(1, 0, "", {Episode(-1, 6)}, &rng)});
  for (const v1::Ack& ack : acks) EXPECT_FALSE(ack.has_error()) << ack.error().message();

  // More envs than labels: 30 more get their own, the last two count as "other".
  std::vector<v1::TransitionBatch> many;
  many.reserve(kMaxEnvLabels);
  for (int i = 0; i < kMaxEnvLabels; ++i) {
    many.push_back(Batch(1, static_cast<uint64_t>(i) + 1, absl::StrCat("env-", i), {Episode(i, 1)}, &rng));
  }
  acks = Exchange(stub.get(), "actor-many", many);
  for (const v1::Ack& ack : acks) EXPECT_FALSE(ack.has_error()) << ack.error().message();

  // Every ack is in: the next metrics polls export all of it, once.
  const std::string cart = Label("CartPole-v1");
  std::map<std::string, double> m;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  do {
    absl::SleepFor(absl::Milliseconds(200));
    m = ParseMetrics(HttpGet(d.metrics_port, "/metrics"));
  } while ((!m.count("qstream_episode_return_count" + Label("other")) ||
            !m.count("qstream_episode_return_count" + cart)) &&
           absl::Now() < deadline);
  absl::SleepFor(absl::Milliseconds(1200));  // two more polls: nothing is counted again
  const std::string page = HttpGet(d.metrics_port, "/metrics");
  m = ParseMetrics(page);
  const auto types = MetricTypes(page);
  EXPECT_NE(std::find(types.begin(), types.end(), "qstream_episode_return"), types.end());
  EXPECT_NE(std::find(types.begin(), types.end(), "qstream_episode_length_steps"), types.end());

  EXPECT_EQ(Get(m, "qstream_episode_return_count" + cart), 4);
  EXPECT_EQ(Get(m, "qstream_episode_return_sum" + cart), 10 + 20 + 475.5 - 7.25);
  EXPECT_EQ(Get(m, "qstream_episode_length_steps_count" + cart), 4);
  EXPECT_EQ(Get(m, "qstream_episode_length_steps_sum" + cart), 10 + 20 + 476 + 3);
  // Cumulative buckets: -7.25 <= 0, 10 and 20 <= 20, 475.5 in (475, 500].
  EXPECT_EQ(Get(m, Bucket("CartPole-v1", "-10")), 0);
  EXPECT_EQ(Get(m, Bucket("CartPole-v1", "0")), 1);
  EXPECT_EQ(Get(m, Bucket("CartPole-v1", "20")), 3);
  EXPECT_EQ(Get(m, Bucket("CartPole-v1", "475")), 3);
  EXPECT_EQ(Get(m, Bucket("CartPole-v1", "500")), 4);
  EXPECT_EQ(Get(m, Bucket("CartPole-v1", "+Inf")), 4);
  EXPECT_EQ(Get(m, "qstream_episode_length_steps_bucket{env=\"CartPole-v1\",le=\"500\"}"), 4);
  EXPECT_EQ(Get(m, "qstream_episode_length_steps_bucket{env=\"CartPole-v1\",le=\"200\"}"), 3);

  EXPECT_EQ(Get(m, "qstream_episode_return_count" + Label("unnamed")), 2);
  EXPECT_EQ(Get(m, "qstream_episode_return_sum" + Label("unnamed")), -4);
  // CartPole-v1 and unnamed took two labels: env-0 .. env-29 have theirs.
  for (int i = 0; i < kMaxEnvLabels - 2; ++i) {
    EXPECT_EQ(Get(m, "qstream_episode_return_count" + Label(absl::StrCat("env-", i))), 1) << i;
  }
  EXPECT_FALSE(m.count("qstream_episode_return_count" + Label("env-30")));
  EXPECT_EQ(Get(m, "qstream_episode_return_count" + Label("other")), 2);
  EXPECT_EQ(Get(m, "qstream_episode_return_sum" + Label("other")), 30 + 31);
  EXPECT_EQ(Get(m, "qstream_ingest_rejected_total{reason=\"episodes\"}"), 1);

  // The count-0 batch inserted nothing.
  auto admin = v1::AdminService::NewStub(channel);
  grpc::ClientContext context;
  v1::StatusResponse status;
  ASSERT_TRUE(admin->Status(&context, v1::StatusRequest(), &status).ok());
  EXPECT_EQ(status.replay_size(), 4 + 3 + 2 + kMaxEnvLabels);

  // The Grafana dashboard's learning panels query these very families.
  std::ifstream file(QSTREAM_TEST_SOURCE_DIR "/deploy/grafana/qstream-dashboard.json");
  ASSERT_TRUE(file.good());
  std::stringstream dashboard;
  dashboard << file.rdbuf();
  const std::string text = dashboard.str();
  const std::regex name("qstream_episode_[a-z_]+?(_sum|_count|_bucket)?\\b");
  std::set<std::string> queried;
  for (std::sregex_iterator it(text.begin(), text.end(), name), end; it != end; ++it) {
    queried.insert(it->str().substr(0, it->str().size() - (*it)[1].length()));
  }
  EXPECT_EQ(queried, (std::set<std::string>{"qstream_episode_length_steps", "qstream_episode_return"}));
  for (const std::string& family : queried) {
    EXPECT_NE(std::find(types.begin(), types.end(), family), types.end()) << family;
  }
}

}  // namespace
}  // namespace qstream
