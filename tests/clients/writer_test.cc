// The buffered Writer against an in-process daemon over loopback gRPC: it
// sends by size, by age and on Close, Flush returns exactly what the daemon
// accepted (per-env n-step included), and a stalled daemon holds it back
// (blocking, or ResourceExhausted). The columns it puts on the wire are
// checked against a recording ExperienceService.
#include "clients/cpp/writer.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "clients/cpp/experience_stream.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/episode_limits.h"
#include "proto/tensor.h"
#include "server/daemon.h"
#include "trainer/config.h"

namespace qstream::actor {
namespace {

constexpr int kObsDim = 4;  // the default network's
constexpr absl::Duration kNever = absl::Hours(1);

v1::TrainerConfig SmallConfig(int n_step) {
  v1::TrainerConfig c = DefaultConfig();
  c.mutable_network()->clear_trunk_hidden();
  c.mutable_network()->add_trunk_hidden(16);
  c.mutable_network()->set_head_hidden(8);
  c.mutable_network()->set_num_atoms(11);
  c.mutable_replay()->set_capacity(100000);
  c.mutable_replay()->set_batch_size(16);
  c.mutable_returns()->set_n_step(n_step);
  c.mutable_rate_limiter()->set_min_size_to_sample(100000);  // no learning
  return c;
}

// Waits for `done` to hold, up to 20 s.
template <typename F>
bool Eventually(F done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

class WriterTest : public ::testing::Test {
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

  void OpenStream(int max_in_flight = 8) {
    ExperienceStream::Options so;
    so.max_in_flight = max_in_flight;
    so.stream_id = "writer-test";
    auto s = ExperienceStream::Open(channel_, so);
    ASSERT_TRUE(s.ok()) << s.status();
    stream_ = *std::move(s);
  }

  std::unique_ptr<Writer> MakeWriter(WriterOptions o) {
    o.obs_dim = kObsDim;
    auto w = Writer::Create(*stream_, o);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? *std::move(w) : nullptr;
  }

  // One step of env `env` whose obs encodes (env, t).
  static absl::Status Step(Writer& w, int env, int t, bool terminated = false, bool truncated = false) {
    const std::vector<float> obs(kObsDim, static_cast<float>(env * 1000 + t));
    const std::vector<float> next(kObsDim, static_cast<float>(env * 1000 + t + 1));
    const int32_t action = t % 2;
    return w.Append(env, obs, {&action, 1}, 1.0f, terminated, truncated, next);
  }

  std::unique_ptr<Daemon> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ExperienceStream> stream_;
};

TEST_F(WriterTest, SendsAFullBatchAsSoonAsItHoldsFlushTransitions) {
  StartDaemon(SmallConfig(1));
  OpenStream();
  WriterOptions o;
  o.flush_transitions = 16;
  o.flush_after = kNever;
  auto w = MakeWriter(o);
  ASSERT_NE(w, nullptr);
  for (int t = 0; t < 40; ++t) ASSERT_TRUE(Step(*w, 0, t).ok());
  ASSERT_TRUE(Eventually([&] { return stream_->totals().acked_batches == 2; }));
  EXPECT_EQ(stream_->totals().sent_transitions, 32);  // the last 8 wait for more
  // Step-stream batches: step 31's next state is step 32's obs, not sent yet.
  EXPECT_EQ(daemon_->counters().transitions(), 31);

  // Flush sends the rest in the full form: every step is complete.
  auto flushed = w->Flush();
  ASSERT_TRUE(flushed.ok()) << flushed.status();
  EXPECT_EQ(*flushed, 40);
  EXPECT_EQ(stream_->totals().sent_batches, 3);
  EXPECT_EQ(daemon_->counters().transitions(), 40);
}

TEST_F(WriterTest, SendsAPartialBatchOnceItsOldestTransitionIsFlushAfterOld) {
  StartDaemon(SmallConfig(1));
  OpenStream();
  WriterOptions o;
  o.flush_transitions = 512;
  o.flush_after = absl::Milliseconds(100);
  auto w = MakeWriter(o);
  ASSERT_NE(w, nullptr);
  const absl::Time appended = absl::Now();
  for (int t = 0; t < 3; ++t) ASSERT_TRUE(Step(*w, 0, t).ok());
  // No further Append or Flush: the writer's own thread sends it.
  ASSERT_TRUE(Eventually([&] { return stream_->totals().sent_batches == 1; }));
  EXPECT_GE(absl::Now() - appended, o.flush_after);
  // Sent by time, in the step-stream form: step 2 waits for step 3's obs.
  ASSERT_TRUE(Eventually([&] { return daemon_->counters().transitions() == 2; }));
  EXPECT_EQ(stream_->totals().sent_transitions, 3);

  // The next batch's clock starts at its own first row.
  const absl::Time second = absl::Now();
  for (int t = 3; t < 5; ++t) ASSERT_TRUE(Step(*w, 0, t).ok());
  ASSERT_TRUE(Eventually([&] { return stream_->totals().sent_batches == 2; }));
  EXPECT_GE(absl::Now() - second, o.flush_after);
  EXPECT_EQ(stream_->totals().sent_transitions, 5);
  // Nothing is left for Flush to send: step 4 waits in the daemon for a
  // next obs (at the stream's close it has none and is dropped).
  auto flushed = w->Flush();
  ASSERT_TRUE(flushed.ok());
  EXPECT_EQ(*flushed, 4);
  EXPECT_EQ(stream_->totals().sent_batches, 2);
}

TEST_F(WriterTest, CloseSendsWhatIsBufferedAndRefusesLaterAppends) {
  StartDaemon(SmallConfig(1));
  OpenStream();
  WriterOptions o;
  o.flush_after = kNever;
  auto w = MakeWriter(o);
  ASSERT_NE(w, nullptr);
  for (int t = 0; t < 5; ++t) ASSERT_TRUE(Step(*w, 0, t).ok());
  EXPECT_EQ(stream_->totals().sent_batches, 0);
  auto closed = w->Close();
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(*closed, 5);
  EXPECT_EQ(daemon_->counters().transitions(), 5);
  EXPECT_EQ(Step(*w, 0, 5).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(stream_->Close().ok());
}

// n = 3 per env, assembled by the daemon: env 0 ends its episode at its 5th
// step (all 5 leave), env 1 is truncated at its 2nd and then steps twice (2
// leave, 2 wait), env 2 steps 4 times. Both flags on one step count as
// terminated, which the daemon accepts. The first 12 rows go out by size in
// the step-stream form, so env 2's 4th step completes only its 1st (1 leaves,
// 3 wait); env 0's last row goes out with Flush in the full form. At the
// close, env 1's and env 2's newest steps have no next state: they are
// dropped, the steps before them leave (1 + 2).
TEST_F(WriterTest, FlushReturnsExactlyWhatThePerEnvNStepWindowsReleased) {
  StartDaemon(SmallConfig(3));
  OpenStream();
  WriterOptions o;
  o.num_envs = 3;
  o.flush_transitions = 4;
  o.flush_after = kNever;
  auto w = MakeWriter(o);
  ASSERT_NE(w, nullptr);
  for (int t = 0; t < 5; ++t) {
    ASSERT_TRUE(Step(*w, 0, t, /*terminated=*/t == 4, /*truncated=*/t == 4).ok());
    if (t < 4) {
      ASSERT_TRUE(Step(*w, 1, t, false, /*truncated=*/t == 1).ok());
      ASSERT_TRUE(Step(*w, 2, t).ok());
    }
  }
  auto flushed = w->Flush();
  ASSERT_TRUE(flushed.ok()) << flushed.status();
  EXPECT_EQ(*flushed, 5 + 2 + 1);
  EXPECT_EQ(stream_->totals().sent_transitions, 13);
  auto again = w->Flush();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 8);  // a count since the writer was created
  ASSERT_TRUE(w->Close().ok());
  // The clean half-close releases the 3 steps in windows that have a next state.
  ASSERT_TRUE(stream_->Close().ok());
  EXPECT_EQ(daemon_->counters().transitions(), 8 + 3);
}

// The rate limiter holds inserts once 40 transitions are in while the
// learner is paused, so acks stop: with max_in_flight = 2 the writer holds
// 2 unacknowledged batches, one in its sender and one filling, and no more.
v1::TrainerConfig StallingConfig() {
  v1::TrainerConfig c = SmallConfig(1);
  c.mutable_rate_limiter()->set_min_size_to_sample(16);
  c.mutable_rate_limiter()->set_samples_per_insert(1);
  c.mutable_rate_limiter()->set_error_buffer(16);
  return c;
}
constexpr int kStallFlush = 8;
constexpr int kStallInFlight = 2;
constexpr int kMostBuffered = (kStallInFlight + 2) * kStallFlush;

TEST_F(WriterTest, AppendBlocksWhileTheDaemonDoesNotAcknowledge) {
  StartDaemon(StallingConfig());
  daemon_->learner()->Pause();
  OpenStream(kStallInFlight);
  WriterOptions o;
  o.flush_transitions = kStallFlush;
  o.flush_after = kNever;
  o.step_stream = false;  // every sent step is inserted at once: acked = sent
  auto w = MakeWriter(o);
  ASSERT_NE(w, nullptr);
  constexpr int kSteps = 200;
  std::atomic<int> appended{0};
  std::thread actor([&] {
    for (int t = 0; t < kSteps; ++t) {
      ASSERT_TRUE(Step(*w, 0, t).ok());
      appended.fetch_add(1);
    }
  });
  // Stalled: Append returns no more once every buffer is taken (which also
  // holds for a moment before the first acks come in, hence the 300 ms).
  int stalled_at = -1;
  ASSERT_TRUE(Eventually([&] {
    const int before = appended.load();
    if (before - stream_->totals().accepted_transitions != kMostBuffered) return false;
    absl::SleepFor(absl::Milliseconds(300));
    stalled_at = appended.load();
    return stalled_at == before && stalled_at - stream_->totals().accepted_transitions == kMostBuffered;
  })) << appended.load()
      << " appended, " << stream_->totals().accepted_transitions << " accepted";
  EXPECT_LT(stalled_at, kSteps);
  EXPECT_EQ(stream_->totals().sent_transitions - stream_->totals().accepted_transitions,
            kStallInFlight * kStallFlush);

  daemon_->learner()->Resume();  // steps sample, so the limiter lets inserts in again
  actor.join();
  auto flushed = w->Flush();
  ASSERT_TRUE(flushed.ok()) << flushed.status();
  EXPECT_EQ(*flushed, kSteps);
  EXPECT_EQ(daemon_->counters().transitions(), kSteps);
}

TEST_F(WriterTest, NonBlockingAppendReturnsResourceExhaustedAndAppendsNothing) {
  StartDaemon(StallingConfig());
  daemon_->learner()->Pause();
  OpenStream(kStallInFlight);
  WriterOptions o;
  o.flush_transitions = kStallFlush;
  o.flush_after = kNever;
  o.block = false;
  o.step_stream = false;  // every sent step is inserted at once: acked = sent
  auto w = MakeWriter(o);
  ASSERT_NE(w, nullptr);
  // Appends until refused for 300 ms on end (a refusal can also be momentary,
  // while the sender hands a batch to a stream that has room).
  int appended = 0;
  auto append_until_refused = [&](int limit) {
    absl::Time refused_since = absl::InfiniteFuture();
    while (appended < limit) {
      absl::Status s = Step(*w, 0, appended);
      if (s.ok()) {
        ++appended;
        refused_since = absl::InfiniteFuture();
        continue;
      }
      EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
      if (s.code() != absl::StatusCode::kResourceExhausted) return;
      refused_since = std::min(refused_since, absl::Now());
      if (absl::Now() - refused_since > absl::Milliseconds(300)) return;
      absl::SleepFor(absl::Milliseconds(1));
    }
  };
  append_until_refused(1000);
  EXPECT_LT(appended, 1000);
  EXPECT_EQ(appended - stream_->totals().accepted_transitions, kMostBuffered);
  EXPECT_EQ(stream_->totals().sent_transitions - stream_->totals().accepted_transitions,
            kStallInFlight * kStallFlush);

  daemon_->learner()->Resume();
  const int before = appended;
  append_until_refused(before + 100);
  EXPECT_EQ(appended, before + 100);
  auto flushed = w->Flush();
  ASSERT_TRUE(flushed.ok()) << flushed.status();
  EXPECT_EQ(*flushed, appended);
  EXPECT_EQ(daemon_->counters().transitions(), appended);
}

TEST_F(WriterTest, ErrorAckSurfacesOnTheNextCall) {
  StartDaemon(SmallConfig(1));
  OpenStream();
  WriterOptions o;
  o.flush_after = kNever;
  auto w = MakeWriter(o);
  ASSERT_NE(w, nullptr);
  const std::vector<float> obs(kObsDim, 0.0f);
  const int32_t bad_action = 7;  // the default network has 2 actions
  ASSERT_TRUE(w->Append(0, obs, {&bad_action, 1}, 0.0f, false, false, obs).ok());
  auto flushed = w->Flush();
  ASSERT_FALSE(flushed.ok());
  EXPECT_EQ(flushed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(flushed.status().message().find("actions"), std::string::npos) << flushed.status();
  EXPECT_FALSE(Step(*w, 0, 1).ok());
  EXPECT_EQ(daemon_->counters().transitions(), 0);
}

TEST_F(WriterTest, RefusesRowsOfTheWrongSize) {
  StartDaemon(SmallConfig(1));
  OpenStream();
  WriterOptions o;
  o.num_envs = 2;
  auto w = MakeWriter(o);
  ASSERT_NE(w, nullptr);
  const std::vector<float> obs(kObsDim, 0.0f);
  const std::vector<float> short_obs(kObsDim - 1, 0.0f);
  const int32_t action = 0;
  EXPECT_NE(w->Append(0, short_obs, {&action, 1}, 0, false, false, obs).message().find("obs"),
            std::string::npos);
  EXPECT_NE(w->Append(2, obs, {&action, 1}, 0, false, false, obs).message().find("env_id"),
            std::string::npos);
  const std::vector<float> two_obs(size_t{2} * kObsDim, 0.0f);
  const std::vector<int32_t> two_actions(2, 0);
  const std::vector<float> one_reward(1, 0.0f);
  const std::vector<uint8_t> two_flags(2, 0);
  VectorStep step{two_obs, two_actions, one_reward, two_flags, {}, two_obs};
  EXPECT_NE(w->AppendStep(step).message().find("rewards"), std::string::npos);
  EXPECT_FALSE(Writer::Create(*stream_, WriterOptions{}).ok());  // no obs_dim
  WriterOptions tiny;
  tiny.obs_dim = kObsDim;
  tiny.num_envs = 4;
  tiny.flush_transitions = 3;
  EXPECT_FALSE(Writer::Create(*stream_, tiny).ok());
}

// Episode reports reach the daemon once: with the next batch, and alone (a
// batch of count 0) at Flush when no row is left to carry them.
TEST_F(WriterTest, EpisodeReportsReachTheDaemonWithTheNextBatchOrAlone) {
  StartDaemon(SmallConfig(1));
  OpenStream();
  WriterOptions o;
  o.flush_transitions = 4;
  o.flush_after = kNever;
  o.env = "CartPole-v1";
  auto w = MakeWriter(o);
  ASSERT_NE(w, nullptr);
  w->set_policy_version(3);
  for (int t = 0; t < 3; ++t) ASSERT_TRUE(Step(*w, 0, t, /*terminated=*/t == 2).ok());
  ASSERT_TRUE(w->ReportEpisode(3, 3).ok());
  ASSERT_TRUE(w->ReportEpisode(-1.5, 1, 0).ok());
  ASSERT_TRUE(Step(*w, 0, 3).ok());  // the 4th row sends the batch, reports with it
  ASSERT_TRUE(Eventually([&] { return stream_->totals().acked_batches == 1; }));
  auto episodes = daemon_->counters().episodes();
  ASSERT_EQ(episodes.count("CartPole-v1"), 1u);
  EXPECT_DOUBLE_EQ(episodes.at("CartPole-v1").return_sum, 1.5);
  EXPECT_EQ(episodes.at("CartPole-v1").length_sum, 4);
  // No row left: Flush sends the report alone.
  ASSERT_TRUE(w->ReportEpisode(10, 10).ok());
  auto flushed = w->Flush();
  ASSERT_TRUE(flushed.ok()) << flushed.status();
  EXPECT_EQ(*flushed, 3);  // the 4th step (step-stream form) waits for its next obs
  EXPECT_EQ(stream_->totals().sent_batches, 2);
  episodes = daemon_->counters().episodes();
  EXPECT_DOUBLE_EQ(episodes.at("CartPole-v1").return_sum, 11.5);
  EXPECT_EQ(episodes.at("CartPole-v1").length_sum, 14);
  ASSERT_TRUE(w->Flush().ok());  // nothing left: nothing sent
  EXPECT_EQ(stream_->totals().sent_batches, 2);

  // Bad reports are refused here, naming the argument; nothing is sent.
  EXPECT_NE(w->ReportEpisode(std::nan(""), 1).message().find("episode_return"), std::string::npos);
  EXPECT_NE(w->ReportEpisode(2e12, 1).message().find("episode_return"), std::string::npos);
  EXPECT_NE(w->ReportEpisode(1, 0).message().find("length"), std::string::npos);
  EXPECT_NE(w->ReportEpisode(1, 1'000'000'001).message().find("length"), std::string::npos);
  EXPECT_NE(w->ReportEpisode(1, 1, -1).message().find("policy_version"), std::string::npos);
  ASSERT_TRUE(w->Close().ok());
  EXPECT_EQ(stream_->totals().sent_batches, 2);
  EXPECT_EQ(w->ReportEpisode(1, 1).code(), absl::StatusCode::kFailedPrecondition);
  WriterOptions bad_env = o;
  bad_env.obs_dim = kObsDim;
  bad_env.env = "Cart Pole";
  EXPECT_FALSE(Writer::Create(*stream_, bad_env).ok());
  bad_env.env = std::string(65, 'e');
  EXPECT_FALSE(Writer::Create(*stream_, bad_env).ok());
}

// An ExperienceService that keeps every batch and accepts all of it.
class RecordingService final : public v1::ExperienceService::Service {
 public:
  grpc::Status Stream(grpc::ServerContext*,
                      grpc::ServerReaderWriter<v1::Ack, v1::TransitionBatch>* stream) override {
    v1::TransitionBatch batch;
    while (stream->Read(&batch)) {
      v1::Ack ack;
      ack.set_sequence(batch.sequence());
      ack.set_accepted(batch.count());
      {
        absl::MutexLock lock(&mu_);
        batches_.push_back(batch);
      }
      if (!stream->Write(ack)) break;
    }
    return grpc::Status::OK;
  }

  std::vector<v1::TransitionBatch> batches() const {
    absl::MutexLock lock(&mu_);
    return batches_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<v1::TransitionBatch> batches_ ABSL_GUARDED_BY(mu_);
};

TEST(WriterWireTest, VectorStepsBecomeTensorColumnsRowPerEnvWithEachEnvsNextObs) {
  RecordingService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  auto stream = ExperienceStream::Open(channel, {});
  ASSERT_TRUE(stream.ok());

  constexpr int kEnvs = 3;
  constexpr int kDim = 2;
  constexpr int kBranches = 2;
  WriterOptions o;
  o.obs_dim = kDim;
  o.num_branches = kBranches;
  o.num_envs = kEnvs;
  o.flush_transitions = 4;  // the second step's rows straddle two batches
  o.flush_after = kNever;
  auto w = Writer::Create(**stream, o);
  ASSERT_TRUE(w.ok());
  // Env e at step t observes (10e + t, -(10e + t)); next_obs is what its
  // step reached (env 0 ends its episode at step 0: its next_obs is the
  // terminal state, not the reset one). Only the rows that end send it.
  auto obs_of = [](int e, int t) { return std::vector<float>{10.0f * e + t, -(10.0f * e + t)}; };
  for (int t = 0; t < 2; ++t) {
    std::vector<float> obs;
    std::vector<float> next;
    for (int e = 0; e < kEnvs; ++e) {
      for (float v : obs_of(e, t)) obs.push_back(v);
      for (float v : obs_of(e, t + 1)) next.push_back(v + 0.5f);
    }
    const std::vector<int32_t> actions = {t, 1, 2, t, 0, 1};
    const std::vector<float> rewards = {1.0f + t, 2.0f + t, 3.0f + t};
    const std::vector<uint8_t> terminated = {static_cast<uint8_t>(t == 0), 0, static_cast<uint8_t>(t == 1)};
    const std::vector<uint8_t> truncated = {1, static_cast<uint8_t>(t == 1), static_cast<uint8_t>(t == 1)};
    (*w)->set_policy_version(7 + t);
    ASSERT_TRUE((*w)->AppendStep({obs, actions, rewards, terminated, truncated, next}).ok());
  }
  auto flushed = (*w)->Flush();
  ASSERT_TRUE(flushed.ok()) << flushed.status();
  EXPECT_EQ(*flushed, 6);
  ASSERT_TRUE((*stream)->Close().ok());
  server->Shutdown();

  const std::vector<v1::TransitionBatch> got = service.batches();
  ASSERT_EQ(got.size(), 2u);
  const v1::TransitionBatch& b = got[0];
  EXPECT_EQ(b.kind(), v1::TransitionBatch::KIND_STEP);
  EXPECT_EQ(b.sequence(), 1u);
  ASSERT_EQ(b.count(), 4u);
  EXPECT_EQ(b.policy_version(), 7);  // the oldest of its rows
  EXPECT_EQ(got[1].policy_version(), 8);
  EXPECT_EQ(b.obs().dtype(), v1::Tensor::DTYPE_FLOAT32);
  EXPECT_EQ(std::vector<int64_t>(b.obs().shape().begin(), b.obs().shape().end()),
            (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(b.actions().dtype(), v1::Tensor::DTYPE_INT32);
  EXPECT_EQ(std::vector<int64_t>(b.actions().shape().begin(), b.actions().shape().end()),
            (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(b.done().dtype(), v1::Tensor::DTYPE_BOOL);
  EXPECT_EQ(b.env_ids().dtype(), v1::Tensor::DTYPE_UINT32);
  EXPECT_FALSE(b.has_discounts());

  // Rows: (env 0, t 0), (1, 0), (2, 0), (0, 1) | (1, 1), (2, 1).
  EXPECT_EQ(wire::Values<float>(b.obs()), (std::vector<float>{0, 0, 10, -10, 20, -20, 1, -1}));
  // The step-stream form: next_obs only of the rows that end, as final_obs.
  EXPECT_FALSE(b.has_next_obs());
  EXPECT_EQ(std::vector<int64_t>(b.final_obs().shape().begin(), b.final_obs().shape().end()),
            (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(wire::Values<float>(b.final_obs()), (std::vector<float>{1.5f, -0.5f, 2.5f, -1.5f}));
  EXPECT_EQ(wire::Values<int32_t>(b.actions()), (std::vector<int32_t>{0, 1, 2, 0, 0, 1, 1, 1}));
  EXPECT_EQ(wire::Values<float>(b.rewards()), (std::vector<float>{1, 2, 3, 2}));
  EXPECT_EQ(wire::Values<uint32_t>(b.env_ids()), (std::vector<uint32_t>{0, 1, 2, 0}));
  // Env 0 at t 0: terminated and truncated -> terminated only.
  EXPECT_EQ(wire::Values<uint8_t>(b.done()), (std::vector<uint8_t>{1, 0, 0, 0}));
  EXPECT_EQ(wire::Values<uint8_t>(b.truncated()), (std::vector<uint8_t>{0, 0, 0, 1}));

  const v1::TransitionBatch& c = got[1];
  ASSERT_EQ(c.count(), 2u);
  EXPECT_EQ(wire::Values<float>(c.obs()), (std::vector<float>{11, -11, 21, -21}));
  // Flush sent it: the full form, next_obs of every row.
  EXPECT_FALSE(c.has_final_obs());
  EXPECT_EQ(wire::Values<float>(c.next_obs()), (std::vector<float>{12.5f, -11.5f, 22.5f, -21.5f}));
  EXPECT_EQ(wire::Values<uint32_t>(c.env_ids()), (std::vector<uint32_t>{1, 2}));
  EXPECT_EQ(wire::Values<uint8_t>(c.done()), (std::vector<uint8_t>{0, 1}));
  EXPECT_EQ(wire::Values<uint8_t>(c.truncated()), (std::vector<uint8_t>{1, 0}));
}

TEST(WriterWireTest, AllFalseTruncatedColumnIsLeftUnset) {
  RecordingService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  auto stream = ExperienceStream::Open(channel, {});
  ASSERT_TRUE(stream.ok());
  WriterOptions o;
  o.obs_dim = 1;
  auto w = Writer::Create(**stream, o);
  ASSERT_TRUE(w.ok());
  const float x = 1;
  const int32_t a = 0;
  ASSERT_TRUE((*w)->Append(0, {&x, 1}, {&a, 1}, 0, /*terminated=*/true, false, {&x, 1}).ok());
  ASSERT_TRUE((*w)->Flush().ok());
  ASSERT_TRUE((*stream)->Close().ok());
  server->Shutdown();
  ASSERT_EQ(service.batches().size(), 1u);
  EXPECT_FALSE(service.batches()[0].has_truncated());
  EXPECT_TRUE(service.batches()[0].has_done());
}

}  // namespace
}  // namespace qstream::actor

namespace qstream::actor {
namespace {

// The reports on the wire: on the batch after them, with env and versions;
// alone in a batch of count 0 with no column; at most 4096 per batch.
TEST(WriterWireTest, EpisodeReportsOnTheWire) {
  RecordingService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  auto stream = ExperienceStream::Open(channel, {});
  ASSERT_TRUE(stream.ok());
  WriterOptions o;
  o.obs_dim = 1;
  o.flush_after = kNever;
  o.env = "MountainCar";
  auto w = Writer::Create(**stream, o);
  ASSERT_TRUE(w.ok());
  const float x = 1;
  const int32_t a = 0;
  (*w)->set_policy_version(5);
  ASSERT_TRUE((*w)->Append(0, {&x, 1}, {&a, 1}, -1, /*terminated=*/true, false, {&x, 1}).ok());
  ASSERT_TRUE((*w)->ReportEpisode(-200, 200).ok());
  ASSERT_TRUE((*w)->Flush().ok());
  (*w)->set_policy_version(6);
  ASSERT_TRUE((*w)->ReportEpisode(-150.5, 151, 4).ok());
  ASSERT_TRUE((*w)->Flush().ok());
  for (int i = 0; i <= wire::kMaxEpisodesPerBatch; ++i) ASSERT_TRUE((*w)->ReportEpisode(i, 1).ok());
  ASSERT_TRUE((*w)->Close().ok());
  ASSERT_TRUE((*stream)->Close().ok());
  server->Shutdown();

  const auto got = service.batches();
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got[0].count(), 1u);
  EXPECT_EQ(got[0].env(), "MountainCar");
  ASSERT_EQ(got[0].episodes_size(), 1);
  EXPECT_EQ(got[0].episodes(0).episode_return(), -200);
  EXPECT_EQ(got[0].episodes(0).length(), 200u);
  EXPECT_EQ(got[0].episodes(0).policy_version(), 5);
  // Alone: count 0, no column, the batch's version the report's.
  const v1::TransitionBatch& alone = got[1];
  EXPECT_EQ(alone.count(), 0u);
  EXPECT_EQ(alone.kind(), v1::TransitionBatch::KIND_STEP);
  EXPECT_FALSE(alone.has_obs() || alone.has_next_obs() || alone.has_actions() || alone.has_rewards() ||
               alone.has_done() || alone.has_truncated() || alone.has_env_ids());
  ASSERT_EQ(alone.episodes_size(), 1);
  EXPECT_EQ(alone.episodes(0).policy_version(), 4);
  EXPECT_EQ(alone.policy_version(), 4);
  EXPECT_EQ(alone.env(), "MountainCar");
  // 4097 reports: 4096 in one batch, the last in the next.
  EXPECT_EQ(got[2].episodes_size(), wire::kMaxEpisodesPerBatch);
  EXPECT_EQ(got[2].episodes(0).policy_version(), 6);
  ASSERT_EQ(got[3].episodes_size(), 1);
  EXPECT_EQ(got[3].episodes(0).episode_return(), wire::kMaxEpisodesPerBatch);
}

}  // namespace
}  // namespace qstream::actor
