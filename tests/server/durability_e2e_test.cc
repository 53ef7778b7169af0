// Durable state end to end: real qstreamd processes, real gRPC on loopback,
// real SIGKILLs. Checkpoints written by a running daemon restore in a new
// process (steps, policy version, replay, de-duplication table); a kill in
// the middle of a checkpoint write leaves the previous one restorable; a
// truncated file is refused and the older checkpoint used; Admin.Checkpoint
// takes names, never paths.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "proto/tensor.h"
#include "qstream/v1/admin.grpc.pb.h"
#include "qstream/v1/experience.grpc.pb.h"
#include "qstream/v1/policy.grpc.pb.h"
#include "tests/server/e2e_support.h"

namespace qstream {
namespace {

using ::qstream::testing::GetStatus;

namespace fs = std::filesystem;

constexpr int kObsDim = 4;

std::string ConfigText(int64_t every_steps, int obs_dim = kObsDim, int64_t capacity = 200000) {
  return absl::StrCat("network { obs_dim: ", obs_dim, R"( trunk_hidden: 16 head_hidden: 16 num_atoms: 11
          branch_actions: 3 }
replay { capacity: )",
                      capacity, R"( batch_size: 16 }
rate_limiter { min_size_to_sample: 32 samples_per_insert: 0 }
server { publish_every: 10 stats_every: 1 max_batch_transitions: 4096 }
checkpoint { every_steps: )",
                      every_steps, R"( every_seconds: 0 keep: 3 }
)");
}

class CheckpointRoot {
 public:
  CheckpointRoot()
      : path_(fs::temp_directory_path() / absl::StrCat("qstream-durability-", getpid(), "-", n_++)) {
    fs::remove_all(path_);
  }
  ~CheckpointRoot() { fs::remove_all(path_); }
  std::string path() const { return path_.string(); }

 private:
  static inline int n_ = 0;
  fs::path path_;
};

testing::Daemon Start(const std::string& config, const std::vector<std::string>& extra) {
  return testing::StartCpuDaemonOrDie(config, extra);
}

std::shared_ptr<grpc::Channel> Channel(const testing::Daemon& d) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(d.grpc_address, grpc::InsecureChannelCredentials(), args);
}

grpc::Status Checkpoint(const std::shared_ptr<grpc::Channel>& channel, const std::string& name,
                        v1::CheckpointResponse* response = nullptr) {
  auto stub = v1::AdminService::NewStub(channel);
  grpc::ClientContext context;
  v1::CheckpointRequest request;
  request.set_name(name);
  v1::CheckpointResponse r;
  grpc::Status st = stub->Checkpoint(&context, request, &r);
  if (response) *response = r;
  return st;
}

template <typename Pred>
bool WaitFor(Pred pred, absl::Duration timeout = absl::Seconds(60)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!pred()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// Client-assembled transitions whose reward encodes (batch, row), so a
// transition is recognizable.
v1::TransitionBatch Batch(uint64_t sequence, int count, int obs_dim = kObsDim) {
  std::mt19937 rng(static_cast<uint32_t>(sequence));
  std::normal_distribution<float> g(0, 1);
  v1::TransitionBatch b;
  b.set_kind(v1::TransitionBatch::KIND_NSTEP);
  b.set_sequence(sequence);
  b.set_stream_id("actor-durable");
  b.set_count(count);
  std::vector<float> obs, next_obs, rewards;
  std::vector<int32_t> actions;
  for (int i = 0; i < count * obs_dim; ++i) {
    obs.push_back(g(rng));
    next_obs.push_back(g(rng));
  }
  for (int i = 0; i < count; ++i) {
    actions.push_back(static_cast<int32_t>(rng() % 3));
    rewards.push_back(0.001f * static_cast<float>(sequence) + 1e-6f * static_cast<float>(i));
  }
  wire::SetTensor(b.mutable_obs(), obs, {count, obs_dim});
  wire::SetTensor(b.mutable_next_obs(), next_obs, {count, obs_dim});
  wire::SetTensor(b.mutable_actions(), actions, {count, 1});
  wire::SetTensor(b.mutable_rewards(), rewards, {count});
  wire::SetTensor(b.mutable_discounts(), std::vector<float>(count, 0.9f), {count});
  return b;
}

struct SendResult {
  int64_t accepted = 0;
  int64_t duplicates = 0;
  int64_t accepted_before = 0;  // the duplicates' first inserts (Ack.accepted_before)
  int64_t acks = 0;
  grpc::Status status;
};

// Sends sequences [first, last] of 16 transitions on one stream, one at a time.
SendResult Send(const std::shared_ptr<grpc::Channel>& channel, uint64_t first, uint64_t last, int count = 16,
                int obs_dim = kObsDim) {
  auto stub = v1::ExperienceService::NewStub(channel);
  grpc::ClientContext context;
  auto stream = stub->Stream(&context);
  SendResult r;
  v1::Ack ack;
  for (uint64_t seq = first; seq <= last; ++seq) {
    if (!stream->Write(Batch(seq, count, obs_dim)) || !stream->Read(&ack)) break;
    EXPECT_EQ(ack.sequence(), seq);
    EXPECT_FALSE(ack.has_error()) << ack.error().message();
    r.accepted += ack.accepted();
    r.duplicates += ack.duplicate() ? 1 : 0;
    r.accepted_before += ack.accepted_before();
    ++r.acks;
  }
  stream->WritesDone();
  r.status = stream->Finish();
  return r;
}

// kill -9 during training and ingest; restart with --restore=latest: steps
// and the policy version continue from the checkpoint, the replay holds what
// it held, and an actor resending everything it ever sent gets duplicates for
// what the checkpoint holds and inserts only the rest.
TEST(DurabilityE2E, KillNineRestoreContinuesAndResendsAreNotInsertedTwice) {
  CheckpointRoot root;
  const std::string config = ConfigText(/*every_steps=*/25);
  auto d = Start(config, {"--checkpoint_dir=" + root.path()});
  auto channel = Channel(d);
  SendResult first = Send(channel, 1, 40);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_EQ(first.accepted, 40 * 16);
  // A checkpoint taken after every one of those acks holds all 40 batches.
  const int64_t acked_at_step = GetStatus(channel).learner_steps();
  ASSERT_TRUE(WaitFor([&] { return GetStatus(channel).last_checkpoint_step() > acked_at_step + 25; }));
  // Training and ingest go on while the daemon is killed.
  std::thread more([&] { Send(channel, 41, 100000); });
  ASSERT_TRUE(WaitFor([&] { return GetStatus(channel).replay_size() > 60 * 16; }));
  const v1::StatusResponse before = GetStatus(channel);
  d.process->Signal(SIGKILL);
  ASSERT_EQ(d.process->Wait(absl::Seconds(10)), 128 + SIGKILL);
  more.join();

  auto e = Start(config, {"--checkpoint_dir=" + root.path(), "--restore=latest"});
  EXPECT_NE(e.process->output().find("qstreamd: restored "), std::string::npos) << e.process->output();
  auto channel2 = Channel(e);
  const v1::StatusResponse after = GetStatus(channel2);
  EXPECT_GE(after.learner_steps(), acked_at_step + 25);
  EXPECT_LE(after.learner_steps(), before.learner_steps() + 1000);
  // Never goes back: above every version published before the kill.
  EXPECT_GT(after.policy_version(), before.policy_version());
  const int64_t restored_replay = after.replay_size();
  EXPECT_GE(restored_replay, 40 * 16);
  EXPECT_EQ(restored_replay % 16, 0);
  const uint64_t restored_batches = static_cast<uint64_t>(restored_replay / 16);
  // The actor resends everything: the checkpointed batches are duplicates.
  SendResult resend = Send(channel2, 1, restored_batches + 10);
  ASSERT_TRUE(resend.status.ok()) << resend.status.error_message();
  EXPECT_EQ(resend.duplicates, static_cast<int64_t>(restored_batches));
  EXPECT_EQ(resend.accepted, 10 * 16);
  // The newest 64 duplicates (what a session remembers, kept in the
  // checkpoint) carry their first insert's count; older ones 0.
  EXPECT_EQ(resend.accepted_before, static_cast<int64_t>(std::min<uint64_t>(restored_batches, 64)) * 16);
  EXPECT_EQ(GetStatus(channel2).replay_size(), restored_replay + 10 * 16);
  const int64_t steps_now = GetStatus(channel2).learner_steps();
  ASSERT_TRUE(WaitFor([&] { return GetStatus(channel2).learner_steps() > steps_now + 50; }));  // trains on
}

// kill -9 while a checkpoint is being written: the half-written one is never
// used, the previous one restores.
TEST(DurabilityE2E, KillNineDuringCheckpointWriteKeepsThePreviousOne) {
  CheckpointRoot root;
  constexpr int kObs = 256;  // big rows, so a checkpoint write takes a while
  const std::string config = ConfigText(/*every_steps=*/0, kObs, 400000);
  auto d = Start(config, {"--checkpoint_dir=" + root.path()});
  auto channel = Channel(d);
  ASSERT_TRUE(Send(channel, 1, 60, 1024, kObs).status.ok());  // ~125 MB of transitions
  v1::CheckpointResponse good;
  ASSERT_TRUE(Checkpoint(channel, "good", &good).ok());
  // The next write is killed as soon as its temporary directory exists.
  auto slow = std::async(std::launch::async, [&] { return Checkpoint(channel, "doomed"); });
  bool saw_tmp = WaitFor(
      [&] {
        for (const auto& entry : fs::directory_iterator(root.path())) {
          if (entry.path().filename().string().rfind(".tmp-doomed", 0) == 0) return true;
        }
        return false;
      },
      absl::Seconds(30));
  d.process->Signal(SIGKILL);
  ASSERT_TRUE(saw_tmp);
  d.process->Wait(absl::Seconds(10));
  EXPECT_FALSE(slow.get().ok());
  EXPECT_FALSE(fs::exists(root.path() + "/doomed"));

  // Restart on a known port, polling health from the start: NOT_SERVING while
  // the ~125 MB checkpoint is read and loaded, then SERVING.
  const int port = testing::FreePort();
  const std::string address = absl::StrCat("127.0.0.1:", port);
  auto e = testing::ChildProcess::Spawn({testing::BuildDir() + "/qstreamd", "--listen=" + address,
                                         "--metrics_listen=", "--backend=cpu",
                                         "--config=" + testing::WriteTempFile("durable-big.txt", config),
                                         "--checkpoint_dir=" + root.path(), "--restore=latest"});
  // Reconnect at once while the port is not bound yet (the default backoff
  // would sleep through the restore).
  grpc::ChannelArguments fast;
  fast.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 10);
  fast.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 10);
  fast.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 20);
  auto health_channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), fast);
  bool saw_not_serving = false;
  ASSERT_TRUE(WaitFor([&] {
    const int h = testing::HealthStatus(health_channel);
    saw_not_serving |= h == 2;
    return h == 1;
  }));
  EXPECT_TRUE(saw_not_serving);
  ASSERT_TRUE(e->WaitForLine("listening grpc=", absl::Seconds(30)).has_value());
  EXPECT_NE(e->output().find("/good: learner step"), std::string::npos) << e->output();
  grpc::ChannelArguments args;
  const v1::StatusResponse s =
      GetStatus(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  EXPECT_EQ(s.replay_size(), 60 * 1024);
  EXPECT_GE(s.learner_steps(), good.learner_steps());
}

// A truncated safetensors file is refused with a message naming it, and
// --restore=latest falls back to the older good checkpoint.
TEST(DurabilityE2E, TruncatedCheckpointIsRefusedAndTheOlderOneRestores) {
  CheckpointRoot root;
  const std::string config = ConfigText(0);
  auto d = Start(config, {"--checkpoint_dir=" + root.path()});
  auto channel = Channel(d);
  ASSERT_TRUE(Send(channel, 1, 10).status.ok());
  v1::CheckpointResponse older;
  ASSERT_TRUE(Checkpoint(channel, "", &older).ok());
  ASSERT_TRUE(Send(channel, 11, 20).status.ok());
  const int64_t steps = GetStatus(channel).learner_steps();
  ASSERT_TRUE(WaitFor([&] { return GetStatus(channel).learner_steps() > steps + 20; }));
  v1::CheckpointResponse newer;
  ASSERT_TRUE(Checkpoint(channel, "", &newer).ok());
  ASSERT_GT(newer.learner_steps(), older.learner_steps());
  d.process->Signal(SIGKILL);
  d.process->Wait(absl::Seconds(10));

  const std::string victim = root.path() + "/" + newer.name() + "/replay.safetensors";
  ASSERT_TRUE(fs::exists(victim));
  fs::resize_file(victim, fs::file_size(victim) / 2);

  auto e = Start(config, {"--checkpoint_dir=" + root.path(), "--restore=latest"});
  const std::string& log = e.process->output();
  EXPECT_NE(log.find("refused"), std::string::npos) << log;
  EXPECT_NE(log.find("replay.safetensors"), std::string::npos) << log;
  EXPECT_NE(log.find("/" + older.name() + ": learner step"), std::string::npos) << log;
  const v1::StatusResponse s = GetStatus(Channel(e));
  EXPECT_EQ(s.replay_size(), 10 * 16);

  // Naming the bad one directly fails the start, naming the file.
  std::vector<std::string> argv = {testing::BuildDir() + "/qstreamd",
                                   "--listen=127.0.0.1:0",
                                   "--metrics_listen=",
                                   "--backend=cpu",
                                   "--config=" + testing::WriteTempFile("durable2.txt", config),
                                   "--restore=" + root.path() + "/" + newer.name()};
  auto bad = testing::ChildProcess::Spawn(argv);
  const auto code = bad->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_NE(*code, 0);
  EXPECT_NE(bad->output().find("replay.safetensors"), std::string::npos) << bad->output();
}

// A config whose network shape differs from the checkpoint's is refused.
TEST(DurabilityE2E, RestoreWithAnotherNetworkShapeIsRefused) {
  CheckpointRoot root;
  auto d = Start(ConfigText(0), {"--checkpoint_dir=" + root.path()});
  ASSERT_TRUE(Send(Channel(d), 1, 3).status.ok());
  ASSERT_TRUE(Checkpoint(Channel(d), "").ok());
  d.process->Signal(SIGTERM);
  ASSERT_EQ(d.process->Wait(absl::Seconds(30)), 0);
  std::string other = ConfigText(0);
  other.replace(other.find("trunk_hidden: 16"), 16, "trunk_hidden: 24");
  std::vector<std::string> argv = {testing::BuildDir() + "/qstreamd",
                                   "--listen=127.0.0.1:0",
                                   "--metrics_listen=",
                                   "--backend=cpu",
                                   "--config=" + testing::WriteTempFile("other.txt", other),
                                   "--checkpoint_dir=" + root.path(),
                                   "--restore=latest"};
  auto p = testing::ChildProcess::Spawn(argv);
  const auto code = p->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_NE(*code, 0);
  EXPECT_NE(p->output().find("network.trunk_hidden"), std::string::npos) << p->output();
}

// SIGTERM writes a final checkpoint; Admin.Checkpoint takes plain names only,
// never echoes host paths, and writes 0600 files in a 0700 directory.
TEST(DurabilityE2E, AdminCheckpointTakesNamesNotPaths) {
  CheckpointRoot root;
  auto d = Start(ConfigText(0), {"--checkpoint_dir=" + root.path()});
  auto channel = Channel(d);
  ASSERT_TRUE(Send(channel, 1, 3).status.ok());
  for (const std::string& name :
       {std::string("../escape"), std::string("/etc/passwd"), std::string("a/b"), std::string(".."),
        std::string("nul\0byte", 8), std::string(200, 'x'), std::string(".hidden")}) {
    const grpc::Status st = Checkpoint(channel, name);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << name;
    EXPECT_NE(st.error_message().find("name"), std::string::npos) << st.error_message();
    EXPECT_EQ(st.error_message().find(root.path()), std::string::npos) << st.error_message();
  }
  EXPECT_FALSE(fs::exists(root.path() + "/../escape"));
  v1::CheckpointResponse r;
  ASSERT_TRUE(Checkpoint(channel, "exp-1.v2", &r).ok());
  EXPECT_EQ(r.name(), "exp-1.v2");
  EXPECT_GT(r.bytes(), 0u);
  struct stat st {};
  ASSERT_EQ(stat((root.path() + "/exp-1.v2").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  for (const auto& f : fs::directory_iterator(root.path() + "/exp-1.v2")) {
    ASSERT_EQ(stat(f.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << f.path();
  }
  // The checkpoint metrics on /metrics.
  ASSERT_TRUE(WaitFor([&] {
    const auto m = testing::ParseMetrics(testing::HttpGet(d.metrics_port, "/metrics"));
    auto it = m.find("qstream_checkpoints_written_total");
    return it != m.end() && it->second >= 1;
  }));
  const auto metrics = testing::ParseMetrics(testing::HttpGet(d.metrics_port, "/metrics"));
  EXPECT_GT(metrics.at("qstream_checkpoint_bytes"), 0);
  EXPECT_GE(metrics.at("qstream_checkpoint_last_step"), 0);
  EXPECT_GT(metrics.at("qstream_checkpoint_last_timestamp_seconds"), 1.7e9);
  EXPECT_EQ(metrics.at("qstream_checkpoint_failures_total{reason=\"write\"}"), 0);
  EXPECT_EQ(metrics.at("qstream_learner_halted"), 0);
  const int64_t steps_before_term = GetStatus(channel).learner_steps();
  d.process->Signal(SIGTERM);
  ASSERT_EQ(d.process->Wait(absl::Seconds(30)), 0);
  bool final_written = false;
  for (const auto& entry : fs::directory_iterator(root.path())) {
    const std::string n = entry.path().filename().string();
    if (n.rfind("ckpt-", 0) == 0 && std::stoll(n.substr(5)) >= steps_before_term) final_written = true;
  }
  EXPECT_TRUE(final_written);

  // Without --checkpoint_dir: FAILED_PRECONDITION.
  auto plain = Start(ConfigText(0), {});
  const grpc::Status st2 = Checkpoint(Channel(plain), "x");
  EXPECT_EQ(st2.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st2.error_message();
}

}  // namespace
}  // namespace qstream
