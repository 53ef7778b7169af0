// Hostile clients end to end: a real qstreamd, real gRPC on loopback. Every
// server limit (README "Limits") is hit and answered with its status or Ack
// error naming the field while a well-behaved actor on another connection
// keeps getting its acks; the daemon's RSS stays flat across 10,000 distinct
// stream_ids and across repeated oversize attempts; an invalid-UTF-8
// stream_id never makes protobuf log; a cancelled stream's max_streams slot
// is free at once while its batch still goes into the replay; a full
// server.max_queued_bytes ends the stream with RESOURCE_EXHAUSTED.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "proto/tensor.h"
#include "qstream/v1/admin.grpc.pb.h"
#include "qstream/v1/experience.grpc.pb.h"
#include "qstream/v1/policy.grpc.pb.h"
#include "tests/server/e2e_support.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define QSTREAM_HAS_ASAN 1
#endif
#endif
#ifndef QSTREAM_HAS_ASAN
#define QSTREAM_HAS_ASAN 0
#endif

namespace qstream {
namespace {

using ::qstream::testing::GetStatus;

using ::testing::HasSubstr;

constexpr int kObsDim = 4;
constexpr int kMaxMessageBytes = 8 << 20;
constexpr int kMaxBatch = 256;
constexpr int kMaxEnvs = 32;
constexpr int kMaxStreamIdBytes = 64;
constexpr int kMaxSessions = 500;

// Small bounds; the learner is paused by the tests (inserts go on) so that
// no training competes with the clients for the two cores.
std::string LimitsConfig() {
  return absl::StrCat(
      R"(network { obs_dim: 4 trunk_hidden: 16 head_hidden: 16 num_atoms: 11 branch_actions: 3 }
replay { capacity: 4096 batch_size: 16 }
rate_limiter { min_size_to_sample: 32 samples_per_insert: 0 }
server { publish_every: 10 stats_every: 1 max_streams: 64 stream_resume_seconds: 1 session_ttl_seconds: 3600
         max_batch_transitions: )",
      kMaxBatch, " max_message_bytes: ", kMaxMessageBytes, " max_envs_per_stream: ", kMaxEnvs,
      " max_stream_id_bytes: ", kMaxStreamIdBytes, " max_sessions: ", kMaxSessions,
      R"( max_evaluate_observations: 64 }
checkpoint { every_seconds: 0 }
)");
}

testing::Daemon StartOrDie(const std::string& config) { return testing::StartCpuDaemonOrDie(config); }

// Its own connection (a local subchannel pool), so that one client's large
// messages never queue in front of another's on one TCP connection.
std::shared_ptr<grpc::Channel> Channel(const testing::Daemon& d) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(d.grpc_address, grpc::InsecureChannelCredentials(), args);
}

void Admin(const std::shared_ptr<grpc::Channel>& channel, bool pause) {
  auto stub = v1::AdminService::NewStub(channel);
  grpc::ClientContext context;
  grpc::Status st;
  if (pause) {
    v1::PauseResponse r;
    st = stub->Pause(&context, v1::PauseRequest(), &r);
  } else {
    v1::ResumeResponse r;
    st = stub->Resume(&context, v1::ResumeRequest(), &r);
  }
  ASSERT_TRUE(st.ok()) << st.error_message();
}

v1::TransitionBatch NStep(int count, uint64_t sequence, const std::string& stream_id) {
  v1::TransitionBatch b;
  b.set_kind(v1::TransitionBatch::KIND_NSTEP);
  b.set_sequence(sequence);
  b.set_stream_id(stream_id);
  b.set_count(count);
  std::vector<float> obs, next_obs;
  std::vector<int32_t> actions;
  obs.reserve(static_cast<size_t>(count) * kObsDim);
  next_obs.reserve(static_cast<size_t>(count) * kObsDim);
  actions.reserve(count);
  for (int i = 0; i < count * kObsDim; ++i) {
    obs.push_back(0.01f * (i % 100));
    next_obs.push_back(-0.01f * (i % 100));
  }
  for (int i = 0; i < count; ++i) actions.push_back(i % 3);
  wire::SetTensor(b.mutable_obs(), obs, {count, kObsDim});
  wire::SetTensor(b.mutable_next_obs(), next_obs, {count, kObsDim});
  wire::SetTensor(b.mutable_actions(), actions, {count, 1});
  wire::SetTensor(b.mutable_rewards(), std::vector<float>(count, 1.0f), {count});
  wire::SetTensor(b.mutable_discounts(), std::vector<float>(count, 0.9f), {count});
  return b;
}

// The wire bytes of `b` with a stream_id field of raw bytes appended.
std::string WithRawStreamId(const v1::TransitionBatch& b, const std::string& id) {
  std::string wire = b.SerializeAsString();
  wire.push_back(static_cast<char>((13 << 3) | 2));
  uint64_t length = id.size();
  do {
    wire.push_back(static_cast<char>((length & 0x7f) | (length > 0x7f ? 0x80 : 0)));
    length >>= 7;
  } while (length != 0);
  return wire + id;
}

// One ExperienceService stream of raw bytes (so a client can send what a
// typed stub would refuse to serialize), one operation at a time.
class RawStream {
 public:
  explicit RawStream(const std::shared_ptr<grpc::Channel>& channel) : stub_(channel) {
    call_ = stub_.PrepareCall(&context_, "/qstream.v1.ExperienceService/Stream", &cq_);
    call_->StartCall(this);
    started_ = Wait(absl::Seconds(30));
  }
  ~RawStream() {
    if (!finished_) {
      context_.TryCancel();
      Finish();
    }
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  bool started() const { return started_; }
  bool Write(const std::string& bytes) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer buffer(&slice, 1);
    call_->Write(buffer, this);
    return Wait(absl::Seconds(30));
  }
  // False when the stream ended (or nothing came within `timeout`).
  bool Read(v1::Ack* ack, absl::Duration timeout = absl::Seconds(30)) {
    grpc::ByteBuffer buffer;
    call_->Read(&buffer, this);
    if (!Wait(timeout)) return false;
    grpc::Slice slice;
    if (!buffer.DumpToSingleSlice(&slice).ok()) return false;
    return ack->ParseFromArray(slice.begin(), static_cast<int>(slice.size()));
  }
  void WritesDone() {
    call_->WritesDone(this);
    Wait(absl::Seconds(30));
  }
  void Cancel() { context_.TryCancel(); }
  grpc::Status Finish() {
    grpc::Status status;
    call_->Finish(&status, this);
    Wait(absl::Seconds(60));
    finished_ = true;
    return status;
  }

 private:
  bool Wait(absl::Duration timeout) {
    void* tag;
    bool ok = false;
    const auto status = cq_.AsyncNext(&tag, &ok, absl::ToChronoTime(absl::Now() + timeout));
    if (status == grpc::CompletionQueue::TIMEOUT) {  // the operation is still pending: end the call
      context_.TryCancel();
      cq_.Next(&tag, &ok);
      return false;
    }
    return status == grpc::CompletionQueue::GOT_EVENT && ok;
  }

  grpc::GenericStub stub_;
  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool started_ = false;
  bool finished_ = false;
};

// One batch on a fresh stream; returns its ack (or the status the stream
// ended with in *status).
bool SendOne(const std::shared_ptr<grpc::Channel>& channel, const std::string& bytes, v1::Ack* ack,
             grpc::Status* status) {
  RawStream s(channel);
  if (!s.started() || !s.Write(bytes)) {
    *status = s.Finish();
    return false;
  }
  if (!s.Read(ack)) {
    *status = s.Finish();
    return false;
  }
  s.WritesDone();
  *status = s.Finish();
  return true;
}

// The well-behaved actor: one stream, small KIND_NSTEP batches, write, wait
// for the ack, record its latency, repeat.
class GoodActor {
 public:
  explicit GoodActor(std::shared_ptr<grpc::Channel> channel)
      : stub_(v1::ExperienceService::NewStub(std::move(channel))), thread_([this] { Run(); }) {}
  ~GoodActor() { Stop(); }

  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  int64_t acks() {
    absl::MutexLock lock(&mu_);
    return static_cast<int64_t>(latencies_.size());
  }
  void WaitForAcks(int64_t n) {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return latencies_.size() >= static_cast<size_t>(n) || done_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(60));
  }
  // Latencies of the acks from index `from` on.
  std::vector<absl::Duration> LatenciesSince(int64_t from) {
    absl::MutexLock lock(&mu_);
    return std::vector<absl::Duration>(latencies_.begin() + std::min<int64_t>(from, latencies_.size()),
                                       latencies_.end());
  }
  // Longest time without an ack since ack index `from` (including the wait
  // for the one in flight now).
  absl::Duration LongestGapSince(int64_t from) {
    absl::MutexLock lock(&mu_);
    absl::Duration longest = absl::ZeroDuration();
    for (size_t i = std::min<size_t>(from, latencies_.size()); i < latencies_.size(); ++i) {
      longest = std::max(longest, latencies_[i]);
    }
    if (!done_) longest = std::max(longest, absl::Now() - sent_at_);
    return longest;
  }
  std::string error() {
    absl::MutexLock lock(&mu_);
    return error_;
  }

 private:
  void Run() {
    grpc::ClientContext context;
    auto stream = stub_->Stream(&context);
    for (uint64_t seq = 1; !stop_; ++seq) {
      {
        absl::MutexLock lock(&mu_);
        sent_at_ = absl::Now();
      }
      v1::Ack ack;
      if (!stream->Write(NStep(8, seq, "good-actor")) || !stream->Read(&ack)) break;
      absl::MutexLock lock(&mu_);
      if (ack.has_error() || ack.accepted() != 8) {
        error_ = absl::StrCat("ack ", seq, ": ", ack.ShortDebugString());
        break;
      }
      latencies_.push_back(absl::Now() - sent_at_);
    }
    stream->WritesDone();
    const grpc::Status st = stream->Finish();
    absl::MutexLock lock(&mu_);
    if (!st.ok() && error_.empty()) error_ = absl::StrCat("stream ended: ", st.error_message());
    done_ = true;
  }

  std::unique_ptr<v1::ExperienceService::Stub> stub_;
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  std::vector<absl::Duration> latencies_ ABSL_GUARDED_BY(mu_);
  absl::Time sent_at_ ABSL_GUARDED_BY(mu_) = absl::Now();
  std::string error_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the rest is constructed
};

// The value of qstream_ingest_rejected_total{reason} once it reaches `at_least`
// (the metrics thread polls the counters), or the last value seen after 10 s.
double RejectedMetric(int metrics_port, const std::string& reason, double at_least) {
  const std::string key = absl::StrCat("qstream_ingest_rejected_total{reason=\"", reason, "\"}");
  double value = -1;
  for (const absl::Time until = absl::Now() + absl::Seconds(10); absl::Now() < until;) {
    const auto m = testing::ParseMetrics(testing::HttpGet(metrics_port, "/metrics"));
    const auto it = m.find(key);
    value = it == m.end() ? -1 : it->second;
    if (value >= at_least) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return value;
}

int64_t MedianOf(std::vector<int64_t> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

absl::Duration Median(std::vector<absl::Duration> v) {
  if (v.empty()) return absl::ZeroDuration();
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// `ids` streams, each with its own stream_id: one batch, an ack, a
// half-close. Spread over `threads` clients with a connection each.
void DistinctStreamIds(const testing::Daemon& d, int first, int ids, int threads) {
  std::atomic<int> failures{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < threads; ++t) {
    clients.emplace_back([&, t] {
      auto stub = v1::ExperienceService::NewStub(Channel(d));
      for (int i = first + t; i < first + ids; i += threads) {
        grpc::ClientContext context;
        auto stream = stub->Stream(&context);
        v1::Ack ack;
        if (!stream->Write(NStep(1, 1, absl::StrCat("id-", i))) || !stream->Read(&ack) ||
            ack.accepted() != 1) {
          ++failures;
        }
        stream->WritesDone();
        if (!stream->Finish().ok()) ++failures;
      }
    });
  }
  for (auto& c : clients) c.join();
  EXPECT_EQ(failures.load(), 0);
}

struct Rejections {
  int stream_id = 0, count = 0, env_ids = 0, message_size = 0, utf8 = 0;
};

// One round of every oversize attempt; each is answered as README "Limits" says.
void OversizeAttempts(const std::shared_ptr<grpc::Channel>& channel, uint64_t sequence, Rejections* seen) {
  v1::Ack ack;
  grpc::Status st;
  {  // A 4 MiB stream_id: an error ack naming it; the stream carries on.
    RawStream s(channel);
    ASSERT_TRUE(s.started());
    ASSERT_TRUE(s.Write(WithRawStreamId(NStep(2, sequence, ""), std::string(4 << 20, 'h'))));
    ASSERT_TRUE(s.Read(&ack));
    EXPECT_EQ(ack.sequence(), sequence);
    EXPECT_EQ(ack.error().field(), "stream_id");
    EXPECT_EQ(ack.error().code(), v1::Error::TOO_LARGE);
    EXPECT_EQ(ack.error().message(),
              absl::StrCat("stream_id: ", 4 << 20,
                           " bytes, at most server.max_stream_id_bytes = ", kMaxStreamIdBytes));
    ++seen->stream_id;
    ASSERT_TRUE(s.Write(NStep(2, 1, "").SerializeAsString()));  // no stream_id: a private session
    ASSERT_TRUE(s.Read(&ack));
    EXPECT_FALSE(ack.has_error()) << ack.ShortDebugString();
    EXPECT_EQ(ack.accepted(), 2u);
    s.WritesDone();
    EXPECT_TRUE(s.Finish().ok());
  }
  {  // Invalid UTF-8: an error ack, and (checked at the end) no libprotobuf line.
    ASSERT_TRUE(SendOne(channel, WithRawStreamId(NStep(2, sequence, ""), "bad\xff\xfe"), &ack, &st));
    EXPECT_EQ(ack.error().field(), "stream_id");
    EXPECT_EQ(ack.error().message(), "stream_id[3]: byte 0xff is not one of [A-Za-z0-9._:@/-]");
    ++seen->utf8;
  }
  {  // 100,000 transitions in one batch: an error ack on `count`.
    ASSERT_TRUE(SendOne(channel, NStep(100000, sequence, "hostile-count").SerializeAsString(), &ack, &st));
    EXPECT_EQ(ack.error().field(), "count");
    EXPECT_EQ(ack.error().code(), v1::Error::TOO_LARGE);
    EXPECT_THAT(ack.error().message(), HasSubstr("server.max_batch_transitions = 256"));
    ++seen->count;
  }
  {  // kMaxBatch env ids on one stream: an error ack on `env_ids`.
    v1::TransitionBatch b = NStep(kMaxBatch, sequence, absl::StrCat("hostile-envs-", sequence));
    b.set_kind(v1::TransitionBatch::KIND_STEP);
    b.clear_discounts();
    std::vector<uint32_t> env_ids;
    env_ids.reserve(kMaxBatch);
    for (int i = 0; i < kMaxBatch; ++i) env_ids.push_back(1000 + i);
    wire::SetBoolTensor(b.mutable_done(), std::vector<bool>(kMaxBatch, false));
    wire::SetTensor(b.mutable_env_ids(), env_ids, {kMaxBatch});
    ASSERT_TRUE(SendOne(channel, b.SerializeAsString(), &ack, &st));
    EXPECT_EQ(ack.error().field(), "env_ids");
    EXPECT_EQ(ack.error().message(), absl::StrCat("env_ids[", kMaxEnvs, "]: ", 1000 + kMaxEnvs,
                                                  " opens more than server.max_envs_per_stream = ", kMaxEnvs,
                                                  " environments on this stream"));
    ++seen->env_ids;
  }
  {  // Over server.max_message_bytes: gRPC ends the stream with RESOURCE_EXHAUSTED.
    EXPECT_FALSE(SendOne(channel, WithRawStreamId(NStep(1, sequence, ""), std::string(kMaxMessageBytes, 'm')),
                         &ack, &st));
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    ++seen->message_size;
  }
}

TEST(HostileClientE2E, EveryLimitIsAnsweredWhileAGoodActorKeepsItsAcksAndRssStaysFlat) {
  auto d = StartOrDie(LimitsConfig());
  auto admin = Channel(d);
  Admin(admin, /*pause=*/true);
  const pid_t pid = d.process->pid();

  GoodActor good(Channel(d));
  good.WaitForAcks(100);
  ASSERT_EQ(good.error(), "");
  const absl::Duration baseline = Median(good.LatenciesSince(20));
  const absl::Duration bound = std::max(20 * baseline, absl::Milliseconds(500));
  std::fprintf(stderr, "good actor: baseline ack latency %s, bound %s\n",
               absl::FormatDuration(baseline).c_str(), absl::FormatDuration(bound).c_str());

  // Warm-up: the sessions table fills to max_sessions, the replay wraps, and
  // every attack runs once, so the allocator has seen each size.
  auto hostile = Channel(d);
  Rejections seen;
  const int64_t warm_from = good.acks();
  DistinctStreamIds(d, 0, 3 * kMaxSessions, 4);
  std::vector<int64_t> warm_samples;
  for (uint64_t round = 1; round <= 10; ++round) {
    OversizeAttempts(hostile, round, &seen);
    warm_samples.push_back(testing::RssBytes(pid));
  }
  const int64_t rss_warm_attacks = MedianOf(warm_samples);
  // The replay full: further inserts only overwrite.
  for (const absl::Time until = absl::Now() + absl::Seconds(30);
       GetStatus(admin).replay_size() < 4096 && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const int64_t rss_warm = testing::RssBytes(pid);
  ASSERT_GT(rss_warm, 0);

  // 10,000 more distinct stream_ids.
  const int64_t ids_from = good.acks();
  const absl::Time ids_start = absl::Now();
  DistinctStreamIds(d, 3 * kMaxSessions, 10000, 4);
  const absl::Duration ids_time = absl::Now() - ids_start;
  const int64_t rss_ids = testing::RssBytes(pid);
  EXPECT_GT(good.acks(), ids_from + 10) << "the good actor's acks stopped during the stream_id flood";

  // Repeated oversize attempts.
  const int64_t attacks_from = good.acks();
  // One oversize message held at the moment of a sample is ~8 MiB of a
  // ~30 MiB daemon, so each level is the median of one sample per round.
  std::vector<int64_t> attack_samples;
  for (uint64_t round = 11; round <= 20; ++round) {
    OversizeAttempts(hostile, round, &seen);
    attack_samples.push_back(testing::RssBytes(pid));
  }
  const int64_t rss_attacks = MedianOf(attack_samples);
  const int64_t rss_attacks_max = *std::max_element(attack_samples.begin(), attack_samples.end());
  EXPECT_GT(good.acks(), attacks_from + 10) << "the good actor's acks stopped during the oversize attempts";

  std::fprintf(
      stderr,
      "RSS: warm %.1f MiB, after 10,000 stream_ids %.1f MiB (%+.1f%%, %s); oversize attempts: median "
      "%.1f MiB over the 10 warm-up rounds, %.1f MiB (%+.1f%%, max %.1f MiB) over the next 10\n",
      rss_warm / 1048576.0, rss_ids / 1048576.0, 100.0 * (rss_ids - rss_warm) / rss_warm,
      absl::FormatDuration(ids_time).c_str(), rss_warm_attacks / 1048576.0, rss_attacks / 1048576.0,
      100.0 * (rss_attacks - rss_warm_attacks) / rss_warm_attacks, rss_attacks_max / 1048576.0);
#if defined(__SANITIZE_ADDRESS__) || QSTREAM_HAS_ASAN
  // ASan's allocator keeps freed blocks in its quarantine and never hands
  // them back, so the daemon's RSS says nothing about what it holds; the
  // attacks and their answers above are still checked.
  std::printf("RSS not checked: built with AddressSanitizer\n");
#else
  EXPECT_LE(std::abs(rss_ids - rss_warm), rss_warm / 10);
  // Which malloc arena keeps a freed ~8 MiB parse buffer varies with thread
  // timing, and one buffer kept or given back moves this ~30 MiB daemon's RSS
  // by ~25 % (over 10 % in 3 of 14 runs of a loaded 2-core machine): the bound
  // is 10 % plus one such buffer. A leak of even one attempt per round would
  // still put the median of rounds 11-20 tens of MiB above that of rounds 1-10.
  constexpr int64_t kOneParseBuffer = int64_t{8} << 20;
  EXPECT_LE(std::abs(rss_attacks - rss_warm_attacks), rss_warm_attacks / 10 + kOneParseBuffer);
#endif

  // Evaluate: non-finite observations and too many of them.
  {
    auto policy = v1::PolicyService::NewStub(hostile);
    v1::EvaluateRequest eval;
    eval.set_count(2);
    for (int i = 0; i < 2 * kObsDim; ++i) eval.add_obs(0.1f);
    eval.set_obs(5, std::numeric_limits<float>::quiet_NaN());
    v1::EvaluateResponse q;
    grpc::ClientContext c1;
    grpc::Status st = policy->Evaluate(&c1, eval, &q);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(st.error_message(), "obs[5]: nan is not finite");
    eval.set_obs(5, std::numeric_limits<float>::infinity());
    grpc::ClientContext c2;
    st = policy->Evaluate(&c2, eval, &q);
    EXPECT_EQ(st.error_message(), "obs[5]: inf is not finite");
    v1::EvaluateRequest many;
    many.set_count(65);
    for (int i = 0; i < 65 * kObsDim; ++i) many.add_obs(0);
    grpc::ClientContext c3;
    st = policy->Evaluate(&c3, many, &q);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(st.error_message(), "count: 65 not in [1, server.max_evaluate_observations = 64]");
  }

  // The good actor's acks kept coming, each within the bound.
  const absl::Duration gap = good.LongestGapSince(warm_from);
  std::fprintf(stderr, "good actor: %lld acks during the attacks, longest wait %s\n",
               static_cast<long long>(good.acks() - warm_from), absl::FormatDuration(gap).c_str());
  EXPECT_LE(gap, bound);
  good.Stop();
  EXPECT_EQ(good.error(), "");

  // Every rejection is on /metrics under its field.
  EXPECT_GE(RejectedMetric(d.metrics_port, "stream_id", seen.stream_id + seen.utf8),
            seen.stream_id + seen.utf8);
  EXPECT_GE(RejectedMetric(d.metrics_port, "count", seen.count), seen.count);
  EXPECT_GE(RejectedMetric(d.metrics_port, "env_ids", seen.env_ids), seen.env_ids);

  d.process->WaitForLine("no such line", absl::Milliseconds(200));  // drain the daemon's output
  EXPECT_EQ(d.process->output().find("libprotobuf"), std::string::npos) << d.process->output();
}

// With the learner paused, the rate limiter holds every insert back, so
// batches stay queued: the queued-bytes budget fills and ends the next
// stream with RESOURCE_EXHAUSTED; a cancelled stream gives its max_streams
// slot back at once and its batch still goes into the replay.
TEST(HostileClientE2E, CancelledStreamFreesItsSlotAtOnceAndAFullQueueIsResourceExhausted) {
  auto d =
      StartOrDie(R"(network { obs_dim: 4 trunk_hidden: 16 head_hidden: 16 num_atoms: 11 branch_actions: 3 }
replay { capacity: 8192 batch_size: 16 }
rate_limiter { min_size_to_sample: 32 samples_per_insert: 1 error_buffer: 100 }
server { max_streams: 2 max_batch_transitions: 1000 max_queued_bytes: 65536 }
checkpoint { every_seconds: 0 }
)");
  auto channel = Channel(d);
  Admin(channel, /*pause=*/true);
  v1::Ack ack;
  grpc::Status st;
  // 200 transitions go in; after them the limiter admits no insert until
  // the learner has sampled.
  ASSERT_TRUE(SendOne(channel, NStep(200, 1, "filler").SerializeAsString(), &ack, &st));
  ASSERT_EQ(ack.accepted(), 200u) << ack.ShortDebugString();

  // Two streams, each with a batch (44 KB) waiting for the learner: the
  // slots and the budget are taken.
  RawStream victim(channel), second(channel);
  ASSERT_TRUE(victim.started() && second.started());
  ASSERT_TRUE(victim.Write(NStep(1000, 1, "victim").SerializeAsString()));
  ASSERT_TRUE(second.Write(NStep(1000, 1, "second").SerializeAsString()));
  // The client's start and write complete before the daemon has admitted the
  // streams (slow under ASan): wait until it counts both, or a third stream
  // can take a slot first and then wait on the paused learner.
  const absl::Time opened_at = absl::Now();
  while (GetStatus(channel).actor_streams() < 2 && absl::Now() - opened_at < absl::Seconds(30)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(GetStatus(channel).actor_streams(), 2);
  // A third stream is refused while both are open.
  {
    RawStream third(channel);
    third.Write(NStep(1, 1, "third").SerializeAsString());
    EXPECT_FALSE(third.Read(&ack));
    const grpc::Status refused = third.Finish();
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(refused.error_message(), HasSubstr("server.max_streams = 2"));
  }
  // Both cancelled while their batches are still in the learner: the slots
  // are free at once.
  victim.Cancel();
  second.Cancel();
  const absl::Time cancelled_at = absl::Now();
  while (GetStatus(channel).actor_streams() > 0 && absl::Now() - cancelled_at < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const absl::Duration freed_after = absl::Now() - cancelled_at;
  EXPECT_EQ(GetStatus(channel).actor_streams(), 0);
  std::fprintf(stderr, "slots free %s after the cancel\n", absl::FormatDuration(freed_after).c_str());
  bool admitted = false;
  {
    RawStream next(channel);
    v1::TransitionBatch no_kind = NStep(1, 1, "next");
    no_kind.clear_kind();
    if (next.Write(no_kind.SerializeAsString()) && next.Read(&ack)) {
      admitted = true;
      EXPECT_EQ(ack.error().field(), "kind");  // answered: the stream was admitted
      // The budget is full: the next batch ends the stream, naming the field.
      ASSERT_TRUE(next.Write(NStep(10, 1, "next").SerializeAsString()));
      EXPECT_FALSE(next.Read(&ack));
      const grpc::Status full = next.Finish();
      EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
      EXPECT_THAT(full.error_message(), HasSubstr("server.max_queued_bytes = 65536 is reached"));
    }
  }
  EXPECT_TRUE(admitted) << "no stream admitted after the cancel";
  EXPECT_EQ(GetStatus(channel).replay_size(), 200);

  // The learner runs again: both held batches go in (their streams are gone).
  Admin(channel, /*pause=*/false);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (GetStatus(channel).replay_size() < 2200 && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(GetStatus(channel).replay_size(), 2200);
  // Committed with their insert: a reconnect's resend is a duplicate.
  ASSERT_TRUE(SendOne(channel, NStep(1000, 1, "victim").SerializeAsString(), &ack, &st));
  EXPECT_TRUE(ack.duplicate()) << ack.ShortDebugString();
  // The refused batch was not: its resend goes in now that the budget is free.
  ASSERT_TRUE(SendOne(channel, NStep(10, 1, "next").SerializeAsString(), &ack, &st));
  EXPECT_FALSE(ack.has_error()) << ack.ShortDebugString();
  EXPECT_EQ(ack.accepted(), 10u);

  EXPECT_GE(RejectedMetric(d.metrics_port, "queued_bytes", 1), 1);
}

}  // namespace
}  // namespace qstream
