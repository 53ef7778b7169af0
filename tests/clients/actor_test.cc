// The C++ actor against an in-process daemon over real gRPC on loopback:
// everything it streams is acknowledged and in the replay, it follows new
// policy versions, and it refuses a policy that does not fit its env.
#include "clients/cpp/actor.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <sstream>
#include <vector>

#include "absl/time/clock.h"
#include "clients/cpp/experience_stream.h"
#include "clients/cpp/policy_watcher.h"
#include "gtest/gtest.h"
#include "proto/tensor.h"
#include "server/daemon.h"
#include "trainer/config.h"

namespace qstream::actor {
namespace {

constexpr int kNStep = 3;

v1::TrainerConfig SmallConfig(bool train) {
  v1::TrainerConfig c = DefaultConfig();
  c.mutable_network()->clear_trunk_hidden();
  c.mutable_network()->add_trunk_hidden(16);
  c.mutable_network()->set_head_hidden(8);
  c.mutable_network()->set_num_atoms(11);
  c.mutable_replay()->set_capacity(100000);
  c.mutable_replay()->set_batch_size(16);
  c.mutable_returns()->set_n_step(kNStep);
  c.mutable_rate_limiter()->set_min_size_to_sample(train ? 200 : 100000);
  c.mutable_rate_limiter()->set_samples_per_insert(train ? 4 : 1);
  // The learner stays near the ratio instead of running on alone.
  c.mutable_rate_limiter()->set_error_buffer(1000);
  c.mutable_server()->set_publish_every(5);
  return c;
}

class ActorTest : public ::testing::Test {
 protected:
  void StartDaemon(const v1::TrainerConfig& config) {
    DaemonOptions options;
    options.config = config;
    options.backend = BackendKind::kCpu;
    options.listen = "127.0.0.1:0";
    auto d = Daemon::Start(options);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    channel_ = grpc::CreateChannel(daemon_->grpc_address(), grpc::InsecureChannelCredentials());
  }

  std::unique_ptr<Daemon> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
  std::atomic<bool> stop_{false};
};

TEST_F(ActorTest, EverythingStreamedIsAcknowledgedAndInTheReplay) {
  StartDaemon(SmallConfig(/*train=*/false));
  auto policy = PolicyWatcher::Create(channel_, absl::Seconds(10));
  ASSERT_TRUE(policy.ok()) << policy.status();
  ExperienceStream::Options so;
  so.max_in_flight = 2;
  so.stream_id = "actor-test";
  auto stream = ExperienceStream::Open(channel_, so);
  ASSERT_TRUE(stream.ok()) << stream.status();

  ActorOptions options;
  options.num_envs = 3;
  options.max_steps = 3000;
  options.batch_transitions = 64;
  options.flush_after = absl::Hours(1);  // batches by size only
  options.epsilon = {1.0, 0.1, 1000};
  std::ostringstream log;
  auto result = RunActor(options, {stream->get()}, **policy, stop_, log);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_TRUE((*stream)->Close().ok());

  EXPECT_EQ(result->env_steps, 3000);
  EXPECT_GT(result->episodes, 10);  // mostly random CartPole episodes are short
  EXPECT_EQ(result->stream.sent_transitions, 3000);
  EXPECT_EQ(result->stream.acked_batches, result->stream.sent_batches);
  // The queue never held half of server.max_queued_bytes: no ack throttled.
  EXPECT_EQ(result->stream.throttled_acks, 0);
  EXPECT_EQ(result->stream.window, 2);
  // A batch goes out once it holds 64 transitions (a round of 3 envs may
  // straddle two batches), in the step-stream form: 46 of them; the last 56
  // rows go out with the writer's Close, in the full form.
  EXPECT_EQ(result->stream.sent_batches, 47);
  // Each env's n-step window may still hold its last n-1 steps.
  EXPECT_LE(result->stream.accepted_transitions, 3000);
  EXPECT_GE(result->stream.accepted_transitions, 3000 - options.num_envs * (kNStep - 1));
  // The clean half-close flushed the open n-step windows: every step is in
  // (each env's newest step came with its next_obs in the full-form batch).
  EXPECT_EQ(daemon_->counters().transitions(), 3000);
  // Every finished episode was reported once, under the env's name; CartPole
  // pays 1 per step, so the returns add up to the lengths.
  const auto episodes = daemon_->counters().episodes();
  ASSERT_EQ(episodes.size(), 1u);
  const EpisodeCounts& cart = episodes.at("CartPole");
  int64_t reported = 0;
  for (int64_t n : cart.return_buckets) reported += n;
  EXPECT_EQ(reported, result->episodes);
  EXPECT_EQ(cart.return_sum, static_cast<double>(cart.length_sum));
  EXPECT_GT(cart.length_sum, 0);
  EXPECT_LE(cart.length_sum, 3000);
  EXPECT_NE(log.str().find("done env_steps=3000"), std::string::npos) << log.str();
}

TEST_F(ActorTest, FollowsNewPolicyVersions) {
  StartDaemon(SmallConfig(/*train=*/true));
  auto policy = PolicyWatcher::Create(channel_, absl::Seconds(10));
  ASSERT_TRUE(policy.ok()) << policy.status();
  const int64_t first = (*policy)->Latest()->version;
  auto stream = ExperienceStream::Open(channel_, {});
  ASSERT_TRUE(stream.ok());
  ActorOptions options;
  options.num_envs = 2;
  options.max_steps = 4000;
  std::ostringstream log;
  ASSERT_TRUE(RunActor(options, {stream->get()}, **policy, stop_, log).ok());
  ASSERT_TRUE((*stream)->Close().ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while ((*policy)->Latest()->version <= first && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_GT((*policy)->Latest()->version, first);
  EXPECT_EQ(static_cast<int64_t>((*policy)->Latest()->weights.size()),
            (*policy)->Latest()->network.num_weights());
}

TEST_F(ActorTest, StopsWhenTheReturnTargetIsMet) {
  StartDaemon(SmallConfig(/*train=*/false));
  auto policy = PolicyWatcher::Create(channel_, absl::Seconds(10));
  ASSERT_TRUE(policy.ok());
  auto stream = ExperienceStream::Open(channel_, {});
  ASSERT_TRUE(stream.ok());
  ActorOptions options;
  options.num_envs = 2;
  options.max_steps = 100000;
  options.return_window = 5;
  options.stop_at_return = 1;  // any 5 episodes qualify
  std::ostringstream log;
  auto result = RunActor(options, {stream->get()}, **policy, stop_, log);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->reached_target);
  EXPECT_GE(result->episodes, 5);
  EXPECT_LT(result->env_steps, 100000);
  EXPECT_EQ(result->stream.acked_batches, result->stream.sent_batches);
  EXPECT_TRUE((*stream)->Close().ok());
}

TEST_F(ActorTest, RefusesPolicyOfAnotherShape) {
  v1::TrainerConfig config = SmallConfig(false);
  config.mutable_network()->set_obs_dim(6);
  StartDaemon(config);
  auto policy = PolicyWatcher::Create(channel_, absl::Seconds(10));
  ASSERT_TRUE(policy.ok());
  auto stream = ExperienceStream::Open(channel_, {});
  ASSERT_TRUE(stream.ok());
  ActorOptions options;
  options.max_steps = 10;
  std::ostringstream log;
  auto result = RunActor(options, {stream->get()}, **policy, stop_, log);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(result.status().message().find("obs_dim"), std::string::npos);
}

TEST_F(ActorTest, ErrorAckSurfacesWithTheField) {
  StartDaemon(SmallConfig(false));
  auto stream = ExperienceStream::Open(channel_, {});
  ASSERT_TRUE(stream.ok());
  v1::TransitionBatch b;
  b.set_kind(v1::TransitionBatch::KIND_STEP);
  b.set_count(1);
  const std::vector<float> obs(4, 0.0f);
  wire::SetTensor(b.mutable_obs(), obs, {1, 4});
  wire::SetTensor(b.mutable_next_obs(), obs, {1, 4});
  wire::SetTensor(b.mutable_actions(), std::vector<int32_t>{0}, {1, 1});
  wire::SetTensor(b.mutable_rewards(), std::vector<float>{std::numeric_limits<float>::quiet_NaN()}, {1});
  wire::SetBoolTensor(b.mutable_done(), {false});
  ASSERT_TRUE((*stream)->Send(b).ok());
  absl::Status s = (*stream)->Flush();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rewards"), std::string::npos) << s;
  EXPECT_EQ(daemon_->counters().transitions(), 0);
}

// The daemon goes away mid-stream and a new one comes up on the same port:
// the stream reconnects, resends what was not acknowledged, and ends with
// every batch acknowledged.
TEST_F(ActorTest, StreamSurvivesDaemonRestart) {
  StartDaemon(SmallConfig(false));
  const std::string address = daemon_->grpc_address();
  ExperienceStream::Options so;
  so.max_in_flight = 4;
  so.stream_id = "restart-test";
  so.max_backoff = absl::Milliseconds(200);
  auto stream = ExperienceStream::Open(channel_, so);
  ASSERT_TRUE(stream.ok());
  auto batch = [] {
    v1::TransitionBatch b;
    b.set_kind(v1::TransitionBatch::KIND_NSTEP);
    b.set_count(10);
    std::vector<float> obs(40);
    std::vector<float> next_obs(40);
    std::vector<int32_t> actions(10);
    for (int i = 0; i < 40; ++i) {
      obs[i] = 0.01f * i;
      next_obs[i] = 0.02f * i;
    }
    for (int i = 0; i < 10; ++i) actions[i] = i % 2;
    wire::SetTensor(b.mutable_obs(), obs, {10, 4});
    wire::SetTensor(b.mutable_next_obs(), next_obs, {10, 4});
    wire::SetTensor(b.mutable_actions(), actions, {10, 1});
    wire::SetTensor(b.mutable_rewards(), std::vector<float>(10, 1.0f), {10});
    wire::SetTensor(b.mutable_discounts(), std::vector<float>(10, 0.9f), {10});
    return b;
  };
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE((*stream)->Send(batch()).ok());
  }
  ASSERT_TRUE((*stream)->Flush().ok());

  daemon_->Shutdown(absl::Milliseconds(200));
  daemon_.reset();
  // Batches sent while no daemon is up wait in the stream for the next one.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE((*stream)->Send(batch()).ok());
  }
  DaemonOptions options;
  options.config = SmallConfig(false);
  options.backend = BackendKind::kCpu;
  options.listen = address;
  auto d = Daemon::Start(options);
  ASSERT_TRUE(d.ok()) << d.status();
  daemon_ = *std::move(d);
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE((*stream)->Send(batch()).ok());
  }
  ASSERT_TRUE((*stream)->Flush().ok());
  ASSERT_TRUE((*stream)->Close().ok());
  const StreamTotals t = (*stream)->totals();
  EXPECT_GE(t.reconnects, 1);
  EXPECT_EQ(t.acked_batches, 28);
  EXPECT_EQ(t.accepted_transitions, 280);
  EXPECT_EQ(daemon_->counters().transitions(), 80);  // the new daemon got the last 8 batches
}

}  // namespace
}  // namespace qstream::actor
