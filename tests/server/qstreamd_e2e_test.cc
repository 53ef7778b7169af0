// qstreamd end to end: the daemon as a child process on loopback ports chosen
// at run time, driven by real gRPC clients and scraped over HTTP.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <future>
#include <limits>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "clients/cpp/health_check.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/tensor.h"
#include "qstream/v1/admin.grpc.pb.h"
#include "qstream/v1/experience.grpc.pb.h"
#include "qstream/v1/policy.grpc.pb.h"
#include "tests/server/e2e_support.h"

namespace qstream {
namespace {

using ::qstream::testing::FreePort;
using ::qstream::testing::GetStatus;
using ::qstream::testing::HealthStatus;
using ::qstream::testing::HttpGet;
using ::qstream::testing::MetricTypes;
using ::qstream::testing::ParseMetrics;
using ::testing::HasSubstr;

constexpr int kObsDim = 4;
const std::vector<int> kBranches = {3, 2};
constexpr int kMaxMessageBytes = 65536;

// Small network and a replay larger than anything a test inserts, so the
// replay size equals the number of transitions ever accepted.
std::string ConfigText(int max_streams = 16) {
  return absl::StrCat(R"(
network { obs_dim: 4 trunk_hidden: 32 trunk_hidden: 32 head_hidden: 32 num_atoms: 11
          branch_actions: 3 branch_actions: 2 }
replay { capacity: 4000000 batch_size: 32 }
rate_limiter { min_size_to_sample: 64 samples_per_insert: 0 }
returns { n_step: 3 gamma: 0.9 }
server { publish_every: 5 stats_every: 1 max_batch_transitions: 1024 max_message_bytes: )",
                      kMaxMessageBytes, " max_streams: ", max_streams, " max_in_flight_per_stream: 8 }\n");
}

testing::Daemon StartOrDie(const std::vector<std::string>& extra = {}, int max_streams = 16) {
  return testing::StartCpuDaemonOrDie(ConfigText(max_streams), extra);
}

std::shared_ptr<grpc::Channel> Channel(const testing::Daemon& d) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(d.grpc_address, grpc::InsecureChannelCredentials(), args);
}

v1::TransitionBatch NStepBatch(int count, uint64_t sequence, std::mt19937* rng) {
  return testing::RandomNStepBatch(count, sequence, kObsDim, kBranches, 0.729f, rng);
}

// One-step transitions of `envs` environments whose episodes end every 7 steps.
v1::TransitionBatch StepBatch(int count, uint64_t sequence, int envs, int64_t* t, std::mt19937* rng) {
  v1::TransitionBatch b = NStepBatch(count, sequence, rng);
  b.set_kind(v1::TransitionBatch::KIND_STEP);
  b.clear_discounts();
  std::vector<uint32_t> env_ids;
  std::vector<bool> done;
  for (int i = 0; i < count; ++i, ++*t) {
    env_ids.push_back(static_cast<uint32_t>(*t % envs));
    done.push_back((*t / envs) % 7 == 6);
  }
  wire::SetTensor(b.mutable_env_ids(), env_ids, {count});
  wire::SetBoolTensor(b.mutable_done(), done);
  return b;
}

// Pushes valid batches on one stream until stopped; counts what was acked.
class Streamer {
 public:
  Streamer(std::shared_ptr<grpc::Channel> channel, bool step_kind, int batch = 64)
      : stub_(v1::ExperienceService::NewStub(channel)), step_kind_(step_kind), batch_(batch) {
    thread_ = std::thread([this] { Run(); });
  }
  ~Streamer() { Stop(); }

  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  int64_t accepted() const { return accepted_; }
  int64_t acks() const { return acks_; }
  int64_t errors() const { return errors_; }
  const grpc::Status& status() const { return status_; }
  void WaitForAcks(int64_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (acks_ < n && !done_ && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  }

 private:
  void Run() {
    grpc::ClientContext context;
    auto stream = stub_->Stream(&context);
    std::mt19937 rng(step_kind_ ? 7 : 11);
    int64_t t = 0;
    v1::Ack ack;
    for (uint64_t seq = 1; !stop_; ++seq) {
      const auto batch = step_kind_ ? StepBatch(batch_, seq, 5, &t, &rng) : NStepBatch(batch_, seq, &rng);
      if (!stream->Write(batch) || !stream->Read(&ack)) break;
      if (ack.sequence() != seq) ADD_FAILURE() << "ack " << ack.sequence() << " for batch " << seq;
      if (ack.has_error()) ++errors_;
      accepted_ += ack.accepted();
      ++acks_;
    }
    stream->WritesDone();
    status_ = stream->Finish();
    done_ = true;
  }

  std::unique_ptr<v1::ExperienceService::Stub> stub_;
  const bool step_kind_;
  const int batch_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> done_{false};
  std::atomic<int64_t> accepted_{0};
  std::atomic<int64_t> acks_{0};
  std::atomic<int64_t> errors_{0};
  grpc::Status status_;
  std::thread thread_;
};

// Service names listed by server reflection (v1alpha ListServices).
std::string ReflectionListing(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  grpc::CompletionQueue cq;
  auto call =
      stub.PrepareCall(&context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  const std::string request("\x3a\x00", 2);  // list_services: ""
  grpc::Slice slice(request);
  grpc::ByteBuffer out(&slice, 1);
  call->Write(out, reinterpret_cast<void*>(2));
  cq.Next(&tag, &ok);
  grpc::ByteBuffer in;
  call->Read(&in, reinterpret_cast<void*>(3));
  cq.Next(&tag, &ok);
  std::string listing;
  grpc::Slice all;
  if (ok && in.DumpToSingleSlice(&all).ok())
    listing.assign(reinterpret_cast<const char*>(all.begin()), all.size());
  call->WritesDone(reinterpret_cast<void*>(4));
  cq.Next(&tag, &ok);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return listing;
}

const std::vector<std::string> kDesignMetrics = {"qstream_train_step_seconds",
                                                 "qstream_train_steps_total",
                                                 "qstream_transitions_ingested_total",
                                                 "qstream_ingest_rejected_total",
                                                 "qstream_replay_size",
                                                 "qstream_replay_capacity",
                                                 "qstream_q_value",
                                                 "qstream_loss",
                                                 "qstream_grad_norm",
                                                 "qstream_target_clip_ratio",
                                                 "qstream_guard_trips_total",
                                                 "qstream_guard_tripped",
                                                 "qstream_policy_version",
                                                 "qstream_actor_streams",
                                                 "qstream_samples_per_insert",
                                                 "qstream_policy_lag_versions"};

TEST(QstreamdE2E, TrainsFromStreamsAndExportsEveryMetric) {
  auto d = StartOrDie({"--reflection"});
  auto channel = Channel(d);
  EXPECT_EQ(HealthStatus(channel), 1);
  const std::string services = ReflectionListing(channel);
  EXPECT_THAT(services, HasSubstr("qstream.v1.ExperienceService"));
  EXPECT_THAT(services, HasSubstr("qstream.v1.PolicyService"));
  EXPECT_THAT(services, HasSubstr("qstream.v1.AdminService"));

  Streamer nstep(channel, /*step_kind=*/false);
  Streamer step(channel, /*step_kind=*/true);
  nstep.WaitForAcks(20);
  step.WaitForAcks(20);
  const v1::StatusResponse s1 = GetStatus(channel);
  const std::string page1 = HttpGet(d.metrics_port, "/metrics");
  nstep.WaitForAcks(nstep.acks() + 50);
  // Steps advance once the metrics poll has seen new ones.
  absl::Time deadline = absl::Now() + absl::Seconds(30);
  v1::StatusResponse s2;
  std::string page2;
  do {
    absl::SleepFor(absl::Milliseconds(600));
    s2 = GetStatus(channel);
    page2 = HttpGet(d.metrics_port, "/metrics");
  } while (
      (s2.learner_steps() <= s1.learner_steps() || ParseMetrics(page2)["qstream_train_steps_total"] <=
                                                       ParseMetrics(page1)["qstream_train_steps_total"]) &&
      absl::Now() < deadline);

  EXPECT_GT(s2.learner_steps(), s1.learner_steps());
  EXPECT_GT(s2.transitions_ingested(), s1.transitions_ingested());
  EXPECT_GT(s2.replay_size(), s1.replay_size());
  EXPECT_EQ(s2.backend(), "cpu");
  EXPECT_EQ(s2.actor_streams(), 2);
  EXPECT_EQ(s2.config().network().obs_dim(), kObsDim);
  EXPECT_EQ(s2.replay_capacity(), 4000000);
  EXPECT_GT(s2.policy_version(), 0);
  EXPECT_TRUE(std::isfinite(s2.last_step().loss()));

  ASSERT_FALSE(page2.empty());
  const auto types = MetricTypes(page2);
  for (const auto& name : kDesignMetrics) {
    EXPECT_NE(std::find(types.begin(), types.end(), name), types.end()) << name << " missing";
  }
  const auto m1 = ParseMetrics(page1);
  const auto m2 = ParseMetrics(page2);
  EXPECT_GT(m2.at("qstream_train_steps_total"), m1.at("qstream_train_steps_total"));
  EXPECT_GT(m2.at("qstream_transitions_ingested_total"), m1.at("qstream_transitions_ingested_total"));
  EXPECT_GT(m2.at("qstream_train_step_seconds_count"), m1.at("qstream_train_step_seconds_count"));
  EXPECT_GT(m2.at("qstream_policy_lag_versions_count"), 0);
  EXPECT_GT(m2.at("qstream_replay_size"), 0);
  EXPECT_EQ(m2.at("qstream_replay_capacity"), 4000000);
  EXPECT_EQ(m2.at("qstream_actor_streams"), 2);
  EXPECT_GT(m2.at("qstream_policy_version"), 0);
  EXPECT_LE(m2.at("qstream_q_value{stat=\"min\"}"), m2.at("qstream_q_value{stat=\"mean\"}"));
  EXPECT_LE(m2.at("qstream_q_value{stat=\"mean\"}"), m2.at("qstream_q_value{stat=\"max\"}"));
  EXPECT_TRUE(m2.count("qstream_guard_trips_total{reason=\"q_range\"}"));
  EXPECT_TRUE(m2.count("qstream_train_step_seconds_bucket{le=\"1e-05\"}"));
  EXPECT_TRUE(m2.count("qstream_train_step_seconds_bucket{le=\"1\"}"));
  EXPECT_GT(m2.at("qstream_samples_per_insert"), 0);
  EXPECT_TRUE(m2.count("qstream_loss"));
  EXPECT_TRUE(m2.count("qstream_grad_norm"));
  EXPECT_TRUE(m2.count("qstream_target_clip_ratio"));
  EXPECT_TRUE(m2.count("qstream_guard_tripped"));

  nstep.Stop();
  step.Stop();
  EXPECT_TRUE(nstep.status().ok()) << nstep.status().error_message();
  EXPECT_EQ(nstep.errors() + step.errors(), 0);
  // No accepted transition is lost: with a replay larger than everything
  // sent, its size is exactly the sum of the acks.
  // The step stream's half-close flushed its open windows before it ended
  // with OK: per env, the steps since its last episode end, at most n - 1 = 2
  // (StepBatch: 5 envs, 64 steps a batch, episodes of 7 steps).
  const v1::StatusResponse s3 = GetStatus(channel);
  const int64_t flushed = s3.replay_size() - nstep.accepted() - step.accepted();
  std::vector<int64_t> open(5, 0);
  for (int64_t t = 0; t < step.acks() * 64; ++t)
    open[t % 5] = (t / 5) % 7 == 6 ? 0 : std::min<int64_t>(open[t % 5] + 1, 2);
  int64_t expected_flush = 0;
  for (int64_t o : open) expected_flush += o;
  EXPECT_EQ(flushed, expected_flush);
  EXPECT_EQ(s3.transitions_ingested(), s3.replay_size());
  EXPECT_GT(step.accepted(), 0);
  // Every step left as an item: acknowledged, or flushed at the half-close
  // (none when every env had just ended an episode: 420 batches did that).
  EXPECT_EQ(step.accepted() + expected_flush, step.acks() * 64);
}

TEST(QstreamdE2E, PolicyVersionsIncrease) {
  auto d = StartOrDie();
  auto channel = Channel(d);
  auto policy = v1::PolicyService::NewStub(channel);
  v1::Policy p0;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(policy->GetPolicy(&context, v1::GetPolicyRequest(), &p0).ok());
  }
  EXPECT_EQ(p0.architecture().obs_dim(), kObsDim);
  EXPECT_THAT(p0.architecture().branch_actions(), ::testing::ElementsAre(3, 2));
  EXPECT_GT(p0.weights_size(), 0);

  Streamer streamer(channel, false);
  grpc::ClientContext watch_context;
  v1::WatchPolicyRequest request;
  request.set_after_version(p0.version());
  auto watch = policy->WatchPolicy(&watch_context, request);
  int64_t last = p0.version();
  for (int i = 0; i < 3; ++i) {
    v1::Policy p;
    ASSERT_TRUE(watch->Read(&p));
    EXPECT_GT(p.version(), last);
    EXPECT_EQ(p.weights_size(), p0.weights_size());
    EXPECT_GE(p.learner_steps(), 5 * p.version());
    last = p.version();
  }
  watch_context.TryCancel();
  v1::Policy p1;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(policy->GetPolicy(&context, v1::GetPolicyRequest(), &p1).ok());
  }
  EXPECT_GE(p1.version(), last);
  EXPECT_NE(std::vector<float>(p1.weights().begin(), p1.weights().end()),
            std::vector<float>(p0.weights().begin(), p0.weights().end()));

  v1::EvaluateRequest eval;
  eval.set_count(2);
  for (int i = 0; i < 2 * kObsDim; ++i) eval.add_obs(0.1f * i);
  v1::EvaluateResponse q;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(policy->Evaluate(&context, eval, &q).ok());
  }
  EXPECT_EQ(q.q_size(), 2 * 5);
  for (float v : q.q()) EXPECT_TRUE(v >= -10 && v <= 10) << v;
  eval.add_obs(1.0f);
  {
    grpc::ClientContext context;
    const grpc::Status st = policy->Evaluate(&context, eval, &q);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("obs: 9 values"));
  }
}

// One bad batch on a stream of its own; returns the ack.
v1::Ack SendOne(v1::ExperienceService::Stub* stub, const v1::TransitionBatch& batch) {
  grpc::ClientContext context;
  auto stream = stub->Stream(&context);
  v1::Ack ack;
  EXPECT_TRUE(stream->Write(batch));
  EXPECT_TRUE(stream->Read(&ack));
  // The stream stays usable after an error ack: a valid batch is accepted.
  std::mt19937 rng(5);
  v1::Ack good;
  EXPECT_TRUE(stream->Write(NStepBatch(8, batch.sequence() + 1, &rng)));
  EXPECT_TRUE(stream->Read(&good));
  EXPECT_FALSE(good.has_error()) << good.error().message();
  EXPECT_EQ(good.accepted(), 8u);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  return ack;
}

TEST(QstreamdE2E, BadInputsGetErrorsWhileAGoodStreamKeepsGoing) {
  auto d = StartOrDie();
  auto channel = Channel(d);
  auto stub = v1::ExperienceService::NewStub(channel);
  Streamer good(channel, false);
  good.WaitForAcks(10);
  std::mt19937 rng(3);
  int64_t extra_accepted = 0;

  auto expect_error = [&](v1::TransitionBatch batch, const std::string& field, const std::string& message) {
    const int64_t before = good.acks();
    const v1::Ack ack = SendOne(stub.get(), batch);
    extra_accepted += 8;
    ASSERT_TRUE(ack.has_error()) << field;
    EXPECT_EQ(ack.error().code(), v1::Error::INVALID_FIELD);
    EXPECT_EQ(ack.error().field(), field);
    EXPECT_THAT(ack.error().message(), HasSubstr(message));
    EXPECT_EQ(ack.accepted(), 0u);
    EXPECT_EQ(ack.sequence(), batch.sequence());
    good.WaitForAcks(before + 3);
    EXPECT_GE(good.acks(), before + 3) << "good stream stalled after a bad " << field;
  };

  v1::TransitionBatch obs = NStepBatch(16, 1, &rng);
  obs.mutable_obs()->mutable_data()->resize(size_t{63} * 4);
  expect_error(obs, "obs", "obs: data holds 252 bytes, shape [16, 4] of DTYPE_FLOAT32 needs 256 (truncated)");

  v1::TransitionBatch nan = NStepBatch(16, 1, &rng);
  wire::SetElement(nan.mutable_rewards(), 5, std::numeric_limits<float>::quiet_NaN());
  expect_error(nan, "rewards", "rewards[5]: nan is not finite");

  v1::TransitionBatch action = NStepBatch(16, 1, &rng);
  wire::SetElement(action.mutable_actions(), 13, int32_t{2});  // row 6, branch 1 has 2 actions
  expect_error(action, "actions", "actions[13]: 2 out of range [0, 2) for branch 1");

  v1::TransitionBatch branches = NStepBatch(16, 1, &rng);
  // Three branches instead of two.
  wire::SetTensor(branches.mutable_actions(), std::vector<int32_t>(size_t{16} * 3, 0), {16, 3});
  expect_error(branches, "actions", "actions: shape [16, 3], expected [count, branches] = [16, 2]");

  v1::TransitionBatch dtype = NStepBatch(16, 1, &rng);
  dtype.mutable_obs()->set_dtype(v1::Tensor::DTYPE_INT32);
  expect_error(dtype, "obs", "obs: dtype DTYPE_INT32, expected DTYPE_FLOAT32");

  // Over server.max_message_bytes: gRPC itself refuses the message.
  {
    grpc::ClientContext context;
    auto stream = stub->Stream(&context);
    const v1::TransitionBatch huge = NStepBatch(2000, 1, &rng);
    ASSERT_GT(huge.ByteSizeLong(), static_cast<size_t>(kMaxMessageBytes));
    stream->Write(huge);
    v1::Ack ack;
    EXPECT_FALSE(stream->Read(&ack));
    const grpc::Status st = stream->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  }
  const int64_t before = good.acks();
  good.WaitForAcks(before + 3);
  EXPECT_GE(good.acks(), before + 3) << "good stream stalled after an oversize message";

  good.Stop();
  EXPECT_TRUE(good.status().ok()) << good.status().error_message();
  EXPECT_EQ(good.errors(), 0);
  const v1::StatusResponse s = GetStatus(channel);
  EXPECT_EQ(s.batches_rejected(), 5);
  EXPECT_EQ(s.replay_size(), good.accepted() + extra_accepted);
  EXPECT_EQ(s.transitions_ingested(), good.accepted() + extra_accepted);

  absl::SleepFor(absl::Milliseconds(700));  // one metrics poll
  const auto m = ParseMetrics(HttpGet(d.metrics_port, "/metrics"));
  EXPECT_EQ(m.at("qstream_ingest_rejected_total{reason=\"obs\"}"), 2);
  EXPECT_EQ(m.at("qstream_ingest_rejected_total{reason=\"rewards\"}"), 1);
  EXPECT_EQ(m.at("qstream_ingest_rejected_total{reason=\"actions\"}"), 2);
}

TEST(QstreamdE2E, ResentSequencesAreAckedWithoutInsert) {
  auto d = StartOrDie();
  auto channel = Channel(d);
  auto stub = v1::ExperienceService::NewStub(channel);
  std::mt19937 rng(9);
  const v1::TransitionBatch b1 = NStepBatch(10, 1, &rng);
  v1::TransitionBatch b2 = NStepBatch(10, 2, &rng);
  b2.set_stream_id("actor-7");
  auto send = [&](grpc::ClientReaderWriter<v1::TransitionBatch, v1::Ack>* s, const v1::TransitionBatch& b) {
    v1::Ack ack;
    EXPECT_TRUE(s->Write(b));
    EXPECT_TRUE(s->Read(&ack));
    EXPECT_FALSE(ack.has_error());
    return ack;
  };
  // (accepted, accepted_before) of the ack.
  using Counts = std::pair<uint32_t, uint32_t>;
  auto counts = [](const v1::Ack& ack) { return Counts{ack.accepted(), ack.accepted_before()}; };
  {
    grpc::ClientContext context;
    auto s = stub->Stream(&context);
    EXPECT_EQ(counts(send(s.get(), b1)), Counts(10, 0));
    // Same sequence, same stream: nothing inserted, the first insert's count.
    const v1::Ack again = send(s.get(), b1);
    EXPECT_TRUE(again.duplicate());
    EXPECT_EQ(counts(again), Counts(0, 10));
    s->WritesDone();
    EXPECT_TRUE(s->Finish().ok());
  }
  {
    grpc::ClientContext context;  // one stream_id per stream
    auto s = stub->Stream(&context);
    EXPECT_EQ(counts(send(s.get(), b2)), Counts(10, 0));
    s->WritesDone();
    EXPECT_TRUE(s->Finish().ok());
  }
  {
    grpc::ClientContext context;  // a reconnect resending under the same stream_id
    auto s = stub->Stream(&context);
    EXPECT_EQ(counts(send(s.get(), b2)), Counts(0, 10));
    // Another stream_id on the same stream is an error ack naming stream_id.
    v1::TransitionBatch other = b2;
    other.set_sequence(3);
    other.set_stream_id("actor-8");
    v1::Ack ack;
    EXPECT_TRUE(s->Write(other));
    EXPECT_TRUE(s->Read(&ack));
    EXPECT_EQ(ack.error().field(), "stream_id");
    s->WritesDone();
    EXPECT_TRUE(s->Finish().ok());
  }
  {
    grpc::ClientContext context;
    auto s = stub->Stream(&context);
    EXPECT_EQ(counts(send(s.get(), b1)), Counts(10, 0));  // no stream_id: a new stream starts fresh
    s->WritesDone();
    EXPECT_TRUE(s->Finish().ok());
  }
  EXPECT_EQ(GetStatus(channel).replay_size(), 30);
}

// Two streams of one stream_id send the same sequence at the same moment:
// it is inserted once, and the older stream ends ABORTED.
TEST(QstreamdE2E, ConcurrentResendUnderOneStreamIdInsertsOnce) {
  auto d = StartOrDie();
  auto channel = Channel(d);
  auto stub = v1::ExperienceService::NewStub(channel);
  std::mt19937 rng(21);
  int64_t expected = 0;
  for (int round = 0; round < 30; ++round) {
    v1::TransitionBatch b = NStepBatch(5, 1, &rng);
    b.set_stream_id(absl::StrCat("twin-", round));
    grpc::ClientContext old_context, new_context;
    auto older = stub->Stream(&old_context);
    v1::TransitionBatch hello = NStepBatch(1, 0, &rng);  // attaches the older stream first
    hello.set_stream_id(b.stream_id());
    v1::Ack ack;
    ASSERT_TRUE(older->Write(hello));
    ASSERT_TRUE(older->Read(&ack));
    expected += 1;
    auto newer = stub->Stream(&new_context);
    std::thread t([&] { older->Write(b); });
    EXPECT_TRUE(newer->Write(b));
    t.join();
    v1::Ack new_ack;
    ASSERT_TRUE(newer->Read(&new_ack));
    EXPECT_FALSE(new_ack.has_error());
    expected += 5;
    // The older stream either acks its batch and then ends, or ends at once.
    v1::Ack old_ack;
    while (older->Read(&old_ack)) {
      EXPECT_FALSE(old_ack.duplicate() && new_ack.duplicate());
    }
    const grpc::Status st = older->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::ABORTED) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("was taken over by a newer stream"));
    newer->WritesDone();
    EXPECT_TRUE(newer->Finish().ok());
    EXPECT_EQ(GetStatus(channel).replay_size(), expected) << "round " << round;
  }
}

// A message that is not a TransitionBatch ends that stream with
// INVALID_ARGUMENT; other streams keep going.
TEST(QstreamdE2E, GarbageMessageEndsOnlyItsStream) {
  auto d = StartOrDie();
  auto channel = Channel(d);
  Streamer good(channel, false);
  good.WaitForAcks(5);
  grpc::GenericStub generic(channel);
  grpc::ClientContext context;
  grpc::CompletionQueue cq;
  auto call = generic.PrepareCall(&context, "/qstream.v1.ExperienceService/Stream", &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  const std::string garbage = "\x0f\xff\xff\xff not a protobuf";
  grpc::Slice slice(garbage);
  grpc::ByteBuffer buffer(&slice, 1);
  call->Write(buffer, reinterpret_cast<void*>(2));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(3));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr(absl::StrCat("TransitionBatch: message does not parse (",
                                                             garbage.size(), " bytes)")));
  const int64_t before = good.acks();
  good.WaitForAcks(before + 3);
  EXPECT_GE(good.acks(), before + 3);
  good.Stop();
  EXPECT_TRUE(good.status().ok()) << good.status().error_message();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

TEST(QstreamdE2E, MissingKindAndDoneWithTruncatedAreErrorAcks) {
  auto d = StartOrDie();
  auto channel = Channel(d);
  auto stub = v1::ExperienceService::NewStub(channel);
  std::mt19937 rng(4);
  v1::TransitionBatch unspecified = NStepBatch(8, 1, &rng);
  unspecified.set_kind(v1::TransitionBatch::KIND_UNSPECIFIED);
  v1::Ack ack = SendOne(stub.get(), unspecified);
  ASSERT_TRUE(ack.has_error());
  EXPECT_EQ(ack.error().field(), "kind");
  int64_t t = 0;
  v1::TransitionBatch both = StepBatch(8, 1, 2, &t, &rng);
  std::vector<bool> truncated(8, false);
  truncated[3] = true;
  wire::SetBoolTensor(both.mutable_truncated(), truncated);
  wire::SetElement(both.mutable_done(), 3, uint8_t{1});
  ack = SendOne(stub.get(), both);
  ASSERT_TRUE(ack.has_error());
  EXPECT_EQ(ack.error().field(), "done");
  EXPECT_THAT(ack.error().message(), HasSubstr("done[3]"));
  EXPECT_EQ(GetStatus(channel).replay_size(), 16);  // only SendOne's two good batches
}

// A client that does not wait for acks: 40 batches written back to back
// (more than server.max_in_flight_per_stream = 8 here, so the daemon also
// stops reading for a while), among them a batch missing its kind, a resend
// of a batch still in flight and one of an acked batch. One ack per batch,
// in write order, each with its own outcome; the replay holds every good
// batch exactly once.
TEST(QstreamdE2E, PipelinedBatchesGetOneAckEachInOrder) {
  auto d = StartOrDie({"--start_paused"});  // acks need no learner step
  auto channel = Channel(d);
  auto stub = v1::ExperienceService::NewStub(channel);
  grpc::ClientContext context;
  auto stream = stub->Stream(&context);
  std::mt19937 rng(21);
  std::vector<v1::TransitionBatch> sent;
  std::vector<uint64_t> sequences;
  for (uint64_t i = 1; i <= 40; ++i) sent.push_back(NStepBatch(3, i, &rng));
  sent[9].set_kind(v1::TransitionBatch::KIND_UNSPECIFIED);  // sequence 10: error ack
  sent.insert(sent.begin() + 20, sent[19]);                 // resend of 20, likely in flight
  sent.push_back(sent[4]);                                  // resend of 5, acked by now
  std::thread writer([&] {
    for (const auto& b : sent) ASSERT_TRUE(stream->Write(b));
    stream->WritesDone();
  });
  std::vector<v1::Ack> acks;
  v1::Ack ack;
  while (stream->Read(&ack)) acks.push_back(ack);
  writer.join();
  ASSERT_TRUE(stream->Finish().ok());
  ASSERT_EQ(acks.size(), sent.size());
  int64_t accepted = 0;
  for (size_t i = 0; i < acks.size(); ++i) {
    EXPECT_EQ(acks[i].sequence(), sent[i].sequence()) << "ack " << i;
    accepted += acks[i].accepted();
  }
  ASSERT_TRUE(acks[9].has_error());
  EXPECT_EQ(acks[9].error().field(), "kind");
  EXPECT_FALSE(acks[19].duplicate());
  EXPECT_TRUE(acks[20].duplicate());  // waited for the original, then found it committed
  EXPECT_EQ(acks[20].accepted(), 0u);
  EXPECT_TRUE(acks.back().duplicate());
  EXPECT_EQ(accepted, 39 * 3);
  EXPECT_EQ(GetStatus(channel).replay_size(), 39 * 3);
}

// Streams opened while the learner steps: their first batches wait for the
// same insert round, so the acks of a stream's first few batches become
// ready together and leave as one run (buffer hint). The stream's first
// write carries the initial metadata and must not be buffered: gRPC 1.51
// would complete it only once sent, and the stream waited forever for its
// first ack (a hang in about one of three 16-stream load runs before).
TEST(QstreamdE2E, PipelinedStreamsOpenedTogetherGetEveryAck) {
  auto d = StartOrDie({"--start_paused"});
  constexpr int kStreams = 16;      // each on its own connection, all at once
  constexpr uint64_t kBatches = 8;  // the daemon's max_in_flight_per_stream
  constexpr int kRounds = 12;
  std::atomic<int64_t> accepted{0};
  for (int round = 0; round < kRounds; ++round) {
    std::vector<std::thread> actors;
    actors.reserve(kStreams);
    for (int s = 0; s < kStreams; ++s) {
      actors.emplace_back([&, s] {
        std::mt19937 rng(1000 * round + s);
        grpc::ChannelArguments args;
        args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
        auto stub = v1::ExperienceService::NewStub(
            grpc::CreateCustomChannel(d.grpc_address, grpc::InsecureChannelCredentials(), args));
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
        auto stream = stub->Stream(&context);
        for (uint64_t i = 1; i <= kBatches; ++i) ASSERT_TRUE(stream->Write(NStepBatch(1, i, &rng)));
        // Every ack before the half-close: nothing else the client sends may
        // be what gets a held-back ack written.
        std::vector<uint64_t> sequences;
        v1::Ack ack;
        while (sequences.size() < kBatches && stream->Read(&ack)) {
          sequences.push_back(ack.sequence());
          accepted += ack.accepted();
        }
        stream->WritesDone();
        const grpc::Status status = stream->Finish();
        ASSERT_TRUE(status.ok()) << "round " << round << " stream " << s << ": " << status.error_message()
                                 << " after " << sequences.size() << " acks";
        ASSERT_EQ(sequences.size(), kBatches);
        for (uint64_t i = 0; i < kBatches; ++i) EXPECT_EQ(sequences[i], i + 1) << "stream " << s;
      });
    }
    for (std::thread& t : actors) t.join();
  }
  EXPECT_EQ(accepted.load(), int64_t{kRounds} * kStreams * static_cast<int64_t>(kBatches));
}

// --start_paused: actors stream into the replay, but no step is taken until
// Admin.Resume.
TEST(QstreamdE2E, StartPausedIngestsWithoutStepsUntilResume) {
  auto d = StartOrDie({"--start_paused"});
  auto channel = Channel(d);
  Streamer streamer(channel, false);
  streamer.WaitForAcks(20);
  absl::SleepFor(absl::Milliseconds(300));  // the learner could step by now, were it running
  v1::StatusResponse s = GetStatus(channel);
  EXPECT_TRUE(s.paused());
  EXPECT_EQ(s.learner_steps(), 0);
  EXPECT_GE(s.replay_size(), 20 * 64);
  {
    auto admin = v1::AdminService::NewStub(channel);
    grpc::ClientContext context;
    v1::ResumeResponse r;
    ASSERT_TRUE(admin->Resume(&context, v1::ResumeRequest(), &r).ok());
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (GetStatus(channel).learner_steps() == 0 && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(20));
  EXPECT_GT(GetStatus(channel).learner_steps(), 0);
  EXPECT_FALSE(GetStatus(channel).paused());
}

// The step-stream form (no next_obs; final_obs at episode ends) over real
// gRPC, n = 3: two envs send three steps each (every step waits for a later
// obs), then env 0 ends its episode (its 4 steps leave) and env 1's fourth obs
// completes its first step. A step-stream batch whose done row has no
// final_obs is an error ack naming it and changes nothing. The half-close
// flushes env 1's steps 1 and 2 (bootstrapping from step 3's obs) and drops
// step 3, which never got a next state.
TEST(QstreamdE2E, StepStreamBatchesChainEachEnvsNextObs) {
  auto d = StartOrDie({"--start_paused"});
  auto channel = Channel(d);
  auto stub = v1::ExperienceService::NewStub(channel);
  std::mt19937 rng(31);
  grpc::ClientContext context;
  auto s = stub->Stream(&context);
  auto stream_batch = [&](uint64_t sequence, const std::vector<uint32_t>& envs,
                          const std::vector<bool>& done) {
    const int n = static_cast<int>(envs.size());
    int64_t t = 0;
    v1::TransitionBatch b = StepBatch(n, sequence, 1, &t, &rng);
    b.set_stream_id("chainer");
    b.clear_next_obs();
    wire::SetTensor(b.mutable_env_ids(), envs, {n});
    wire::SetBoolTensor(b.mutable_done(), done);
    const auto ends = std::count(done.begin(), done.end(), true);
    if (ends > 0)
      wire::SetTensor(b.mutable_final_obs(), std::vector<float>(ends * kObsDim, 0.25f), {ends, kObsDim});
    return b;
  };
  v1::Ack ack;
  ASSERT_TRUE(s->Write(stream_batch(1, {0, 1, 0, 1, 0, 1}, std::vector<bool>(6, false))));
  ASSERT_TRUE(s->Read(&ack));
  EXPECT_FALSE(ack.has_error()) << ack.error().message();
  EXPECT_EQ(ack.accepted(), 0u);
  v1::TransitionBatch missing = stream_batch(2, {0, 1}, {true, false});
  missing.clear_final_obs();
  ASSERT_TRUE(s->Write(missing));
  ASSERT_TRUE(s->Read(&ack));
  ASSERT_TRUE(ack.has_error());
  EXPECT_EQ(ack.error().field(), "final_obs");
  EXPECT_THAT(ack.error().message(), HasSubstr("[ends, obs_dim]"));
  ASSERT_TRUE(s->Write(stream_batch(3, {0, 1}, {true, false})));
  ASSERT_TRUE(s->Read(&ack));
  EXPECT_FALSE(ack.has_error()) << ack.error().message();
  EXPECT_EQ(ack.accepted(), 4u + 1u);
  EXPECT_EQ(GetStatus(channel).replay_size(), 5);
  s->WritesDone();
  EXPECT_TRUE(s->Finish().ok());
  EXPECT_EQ(GetStatus(channel).replay_size(), 5 + 2);
}

// A clean half-close flushes the open n-step windows before OK.
TEST(QstreamdE2E, HalfCloseFlushesTheWindows) {
  auto d = StartOrDie();
  auto channel = Channel(d);
  auto stub = v1::ExperienceService::NewStub(channel);
  std::mt19937 rng(8);
  grpc::ClientContext context;
  auto s = stub->Stream(&context);
  int64_t t = 0;
  v1::TransitionBatch b = StepBatch(4, 1, 4, &t, &rng);  // 4 envs, one step each, no done
  b.set_stream_id("flusher");
  v1::Ack ack;
  ASSERT_TRUE(s->Write(b));
  ASSERT_TRUE(s->Read(&ack));
  EXPECT_EQ(ack.accepted(), 0u);
  EXPECT_EQ(GetStatus(channel).replay_size(), 0);
  s->WritesDone();
  EXPECT_TRUE(s->Finish().ok());
  EXPECT_EQ(GetStatus(channel).replay_size(), 4);  // the 4 pending windows
}

TEST(QstreamdE2E, StreamsBeyondMaxStreamsAreRefused) {
  auto d = StartOrDie({}, /*max_streams=*/2);
  auto channel = Channel(d);
  Streamer a(channel, false), b(channel, false);
  a.WaitForAcks(1);
  b.WaitForAcks(1);
  auto stub = v1::ExperienceService::NewStub(channel);
  grpc::ClientContext context;
  auto s = stub->Stream(&context);
  std::mt19937 rng(1);
  s->Write(NStepBatch(4, 1, &rng));
  v1::Ack ack;
  EXPECT_FALSE(s->Read(&ack));
  const grpc::Status st = s->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(), HasSubstr("max_streams"));
  const int64_t before = a.acks();
  a.WaitForAcks(before + 2);
  EXPECT_GE(a.acks(), before + 2);
}

TEST(QstreamdE2E, StreamsShareTheLearnerQueueWithoutLosingData) {
  // Six streams of both kinds into one learner queue.
  auto d = StartOrDie();
  auto channel = Channel(d);
  std::vector<std::unique_ptr<Streamer>> streams;
  for (int i = 0; i < 6; ++i) streams.push_back(std::make_unique<Streamer>(channel, i % 2 == 1));
  for (auto& s : streams) s->WaitForAcks(30);
  int64_t accepted = 0;
  for (auto& s : streams) {
    EXPECT_GE(s->acks(), 30);
    s->Stop();
    EXPECT_TRUE(s->status().ok()) << s->status().error_message();
    accepted += s->accepted();
  }
  // Plus what the three step streams' half-closes flushed (<= 5 envs x 2 each).
  const int64_t flushed = GetStatus(channel).replay_size() - accepted;
  EXPECT_GE(flushed, 0);
  EXPECT_LE(flushed, 3 * 10);
}

TEST(QstreamdE2E, SigtermWhileStreamsAreOpenExitsZeroAndKeepsAckedData) {
  auto d = StartOrDie();
  auto channel = Channel(d);
  Streamer a(channel, false), b(channel, true);
  auto policy = v1::PolicyService::NewStub(channel);
  grpc::ClientContext watch_context;
  auto watch = policy->WatchPolicy(&watch_context, v1::WatchPolicyRequest());
  a.WaitForAcks(20);
  b.WaitForAcks(20);
  const absl::Time signalled = absl::Now();
  d.process->Signal(SIGTERM);
  const auto code = d.process->Wait(absl::Seconds(30));
  std::printf("qstreamd exited %.3f s after SIGTERM\n", absl::ToDoubleSeconds(absl::Now() - signalled));
  ASSERT_TRUE(code.has_value()) << "qstreamd did not exit; output:\n" << d.process->output();
  EXPECT_EQ(*code, 0) << d.process->output();
  a.Stop();
  b.Stop();
  watch_context.TryCancel();
  EXPECT_FALSE(a.status().ok());  // the daemon ended the stream
  // Everything acknowledged is in the replay the daemon reports at exit.
  const std::string out = d.process->output();
  const size_t at = out.find("transitions in the replay");
  ASSERT_NE(at, std::string::npos) << out;
  const size_t start = out.rfind(", ", at);
  const int64_t in_replay = std::stoll(out.substr(start + 2, at - start - 2));
  EXPECT_GE(in_replay, a.accepted() + b.accepted());
}

TEST(QstreamdE2E, BadFlagsAndConfigExitTwoNamingTheField) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::string bad_config = testing::WriteTempFile("bad.txt", "replay { alpha: 3 }\n");
  const std::vector<Case> cases = {
      {{"--lr=-1"}, "optimizer.lr"},
      {{"--no_such_flag=1"}, "unknown flag --no_such_flag"},
      {{"--batch_size=abc"}, "--batch_size=abc"},
      {{"--backend=tpu"}, "--backend"},
      {{"--config=" + bad_config}, "replay.alpha"},
      {{"--config=/nonexistent/qstream.txt"}, "/nonexistent/qstream.txt"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {testing::BuildDir() + "/qstreamd", "--listen=127.0.0.1:0",
                                     "--metrics_listen="};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto p = testing::ChildProcess::Spawn(argv);
    const auto code = p->Wait(absl::Seconds(30));
    ASSERT_TRUE(code.has_value());
    EXPECT_EQ(*code, 2) << c.args[0] << ": " << p->output();
    EXPECT_THAT(p->output(), HasSubstr(c.message)) << c.args[0];
  }
}

TEST(QstreamdE2E, PushesToPushgateway) {
  const std::string gateway_bin = "/usr/bin/prometheus-pushgateway";
  if (access(gateway_bin.c_str(), X_OK) != 0) GTEST_SKIP() << gateway_bin << " not installed";
  const int port = FreePort();
  auto gateway = testing::ChildProcess::Spawn(
      {gateway_bin, absl::StrCat("--web.listen-address=127.0.0.1:", port), "--log.level=error"});
  absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (HttpGet(port, "/metrics").empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(100));
  ASSERT_FALSE(HttpGet(port, "/metrics").empty()) << gateway->output();

  auto d = StartOrDie(
      {absl::StrCat("--pushgateway=127.0.0.1:", port), "--push_interval=200ms", "--instance=e2e-instance"});
  Streamer s(Channel(d), false);
  std::string page;
  deadline = absl::Now() + absl::Seconds(30);
  // Pushed under their own job, apart from the scrape job ("qstream").
  const std::string key = R"(qstream_train_steps_total{instance="e2e-instance",job="qstream-push"})";
  while (absl::Now() < deadline) {
    page = HttpGet(port, "/metrics");
    const auto m = ParseMetrics(page);
    if (m.count(key) && m.at(key) > 0) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  const auto m = ParseMetrics(page);
  ASSERT_TRUE(m.count(key)) << page.substr(0, 4000);
  EXPECT_GT(m.at(key), 0);
  EXPECT_TRUE(m.count(R"(qstream_replay_capacity{instance="e2e-instance",job="qstream-push"})"));
  EXPECT_FALSE(m.count(R"(qstream_train_steps_total{instance="e2e-instance",job="qstream"})"));
}

// Runs `promtool check metrics` on `page`; its exit code and output.
std::pair<int, std::string> PromtoolCheckMetrics(const std::string& page) {
  const std::string path = testing::WriteTempFile("exposition.txt", page);
  auto p =
      testing::ChildProcess::Spawn({"/bin/sh", "-c", absl::StrCat("exec promtool check metrics < ", path)});
  const auto code = p->Wait(absl::Seconds(60));
  return {code.value_or(-1), p->output()};
}

void ResumeLearner(const std::shared_ptr<grpc::Channel>& channel) {
  auto admin = v1::AdminService::NewStub(channel);
  grpc::ClientContext context;
  v1::ResumeResponse r;
  ASSERT_TRUE(admin->Resume(&context, v1::ResumeRequest(), &r).ok());
}

// /metrics as Prometheus's own linter reads it, and the operational series
// saying what they should: build, paused, serving, process, thresholds.
TEST(QstreamdE2E, ExpositionPassesPromtoolAndTellsTheTruth) {
  auto which = testing::ChildProcess::Spawn({"/bin/sh", "-c", "command -v promtool"});
  ASSERT_EQ(which->Wait(absl::Seconds(30)), 0)
      << "promtool not found: install Debian's `prometheus` package (deploy/install-deps.sh does)";
  const std::string dir = testing::WriteTempFile("ckpt-marker", "") + ".d";
  auto d = StartOrDie({"--start_paused", absl::StrCat("--checkpoint_dir=", dir)});
  auto channel = Channel(d);
  Streamer streamer(channel, false);
  streamer.WaitForAcks(5);
  absl::SleepFor(absl::Seconds(1));  // one metrics poll
  std::string page = HttpGet(d.metrics_port, "/metrics");
  ASSERT_FALSE(page.empty());
  const auto [code, lint] = PromtoolCheckMetrics(page);
  EXPECT_EQ(code, 0) << lint;
  EXPECT_EQ(lint, "") << lint;

  auto m = ParseMetrics(page);
  EXPECT_EQ(m["qstream_paused"], 1);
  EXPECT_EQ(m["qstream_serving"], 1);
  EXPECT_EQ(m["qstream_replay_min_size"], 64);
  EXPECT_EQ(m["qstream_checkpoint_interval_seconds"], 600);  // checkpoint.every_seconds' default
  bool build_info = false;
  for (const auto& [key, value] : m) {
    if (absl::StartsWith(key, "qstream_build_info{") && absl::StrContains(key, "backend=\"cpu\"") &&
        absl::StrContains(key, "version=\"") && absl::StrContains(key, "device=\"cpu")) {
      build_info = value == 1;
    }
  }
  EXPECT_TRUE(build_info) << page.substr(0, 3000);
  EXPECT_GT(m["process_cpu_seconds_total"], 0);
  EXPECT_GT(m["process_resident_memory_bytes"], 1 << 20);
  EXPECT_GT(m["process_open_fds"], 3);
  EXPECT_GT(m["process_max_fds"], m["process_open_fds"]);
  EXPECT_NEAR(m["process_start_time_seconds"], absl::ToUnixSeconds(absl::Now()), 120);
  EXPECT_EQ(m.count("qstream_gpu_memory_used_bytes"), 0u);  // CPU backend: no GPU series
  EXPECT_EQ(m["qstream_train_steps_total"], 0);

  ResumeLearner(channel);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  do {
    absl::SleepFor(absl::Milliseconds(200));
    m = ParseMetrics(HttpGet(d.metrics_port, "/metrics"));
  } while ((m["qstream_paused"] != 0 || m["qstream_train_steps_total"] == 0) && absl::Now() < deadline);
  EXPECT_EQ(m["qstream_paused"], 0);
  EXPECT_GT(m["qstream_train_steps_total"], 0);
  EXPECT_GT(m["qstream_train_step_seconds_count"], 0);
  streamer.Stop();
}

// grpc.health.v1 through the qstream-healthcheck binary (Docker's
// HEALTHCHECK): the whole server and the "liveness" service, on the
// plaintext health port; an unknown service and a closed port fail.
TEST(QstreamdE2E, HealthcheckBinaryAnswersFromTheHealthPort) {
  const int health_port = FreePort();
  auto d = StartOrDie({absl::StrCat("--health_listen=127.0.0.1:", health_port)});
  const std::string bin = testing::BuildDir() + "/qstream-healthcheck";
  const std::string target = absl::StrCat("127.0.0.1:", health_port);
  auto run = [&](const std::vector<std::string>& args) {
    std::vector<std::string> argv = {bin};
    argv.insert(argv.end(), args.begin(), args.end());
    auto p = testing::ChildProcess::Spawn(argv);
    const auto code = p->Wait(absl::Seconds(30));
    return std::make_pair(code.value_or(-1), p->output());
  };
  auto [code, out] = run({target});
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("SERVING"));
  std::tie(code, out) = run({"--service=liveness", target});
  EXPECT_EQ(code, 0) << out;
  std::tie(code, out) = run({"--service=no.such.Service", target});
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("NOT_FOUND"));
  std::tie(code, out) = run({"--timeout=2s", absl::StrCat("127.0.0.1:", FreePort())});
  EXPECT_EQ(code, 1) << out;
  std::tie(code, out) = run({});
  EXPECT_EQ(code, 2) << out;
}

// A learner halted by the guard: readiness ("" service) NOT_SERVING, liveness
// still SERVING (a restart would not cure it), qstream_serving 0.
TEST(QstreamdE2E, GuardHaltIsNotServingButLive) {
  // Support 1..10 and |Q| <= 0.5: every step trips the Q-range check.
  const std::string config = R"(
network { obs_dim: 4 trunk_hidden: 32 head_hidden: 32 num_atoms: 11 v_min: 1 v_max: 10
          branch_actions: 3 branch_actions: 2 }
replay { capacity: 100000 batch_size: 32 }
rate_limiter { min_size_to_sample: 64 samples_per_insert: 0 }
returns { n_step: 3 gamma: 0.9 }
server { stats_every: 1 max_message_bytes: 65536 }
guard { max_abs_q: 0.5 max_consecutive_trips: 3 on_repeated_trips: HALT }
)";
  const int health_port = FreePort();
  auto d = testing::StartCpuDaemonOrDie(config, {absl::StrCat("--health_listen=127.0.0.1:", health_port)});
  auto channel = Channel(d);
  auto health =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", health_port), grpc::InsecureChannelCredentials());
  EXPECT_EQ(HealthStatus(health), 1);
  Streamer streamer(channel, false);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (HealthStatus(health) == 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(HealthStatus(health), 2);
  EXPECT_EQ(HealthStatus(channel), 2);
  auto live = actor::CheckHealth(health, "liveness", absl::Seconds(10));
  ASSERT_TRUE(live.ok()) << live.status();
  EXPECT_EQ(*live, actor::ServingStatus::kServing);
  EXPECT_TRUE(GetStatus(channel).halted());
  absl::SleepFor(absl::Seconds(1));  // one metrics poll
  auto m = ParseMetrics(HttpGet(d.metrics_port, "/metrics"));
  EXPECT_EQ(m["qstream_serving"], 0);
  EXPECT_EQ(m["qstream_learner_halted"], 1);
  EXPECT_TRUE(d.process->WaitForLine("health: NOT_SERVING: the guard halted the learner", absl::Seconds(10)))
      << d.process->output();
  streamer.Stop();
}

// --log_format=json: every line the daemon writes is one JSON object with
// time, level and msg, from the start-up line to the last one.
TEST(QstreamdE2E, JsonLogLinesFromStartToExit) {
  auto d = StartOrDie({"--log_format=json"});
  d.process->Signal(SIGTERM);
  const auto code = d.process->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0) << d.process->output();
  int lines = 0;
  bool listening = false, stopped = false;
  for (absl::string_view line : absl::StrSplit(d.process->output(), '\n', absl::SkipEmpty())) {
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(line)) << line;
    ASSERT_TRUE(j.contains("time") && j.contains("level") && j.contains("msg")) << line;
    const std::string msg = j["msg"];
    listening |= absl::StrContains(msg, "listening grpc=");
    stopped |= absl::StrContains(msg, "stopped after");
    ++lines;
  }
  EXPECT_GE(lines, 3);
  EXPECT_TRUE(listening) << d.process->output();
  EXPECT_TRUE(stopped) << d.process->output();

  // An unknown format is a usage error naming the flag.
  std::string error;
  EXPECT_FALSE(testing::StartDaemon({"--log_format=xml"}, &error).has_value());
  EXPECT_THAT(error, HasSubstr("--log_format")) << error;
}

}  // namespace
}  // namespace qstream
