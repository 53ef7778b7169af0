// Two qstreamd ranks of one data-parallel group, one GPU each (child
// processes with CUDA_VISIBLE_DEVICES=0 and 1, rendezvous and NCCL over
// loopback), fed different data: after a common Pause at_step both hold
// bitwise-equal weights (read back from their checkpoints), report their
// rank in Status and on /metrics. Label gpu; skips with fewer than 2 devices.
#include <cuda_runtime_api.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "qstream/v1/admin.grpc.pb.h"
#include "qstream/v1/experience.grpc.pb.h"
#include "tests/server/e2e_support.h"
#include "trainer/checkpoint.h"

namespace qstream::testing {
namespace {

constexpr int kObsDim = 8;

constexpr char kConfig[] = R"pb(
  network { obs_dim: 8 trunk_hidden: 64 trunk_hidden: 64 head_hidden: 32 num_atoms: 51 branch_actions: 3 }
  replay { capacity: 20000 batch_size: 64 }
  rate_limiter { min_size_to_sample: 256 samples_per_insert: 0 }
  server { stats_every: 1 }
  matmul_precision: FP32
)pb";

// Spawns rank `rank` on GPU `rank` without waiting: rank 0 starts serving
// only once the whole group has formed.
std::unique_ptr<ChildProcess> SpawnRank(int rank, int rendezvous_port, const std::string& config,
                                        const std::string& checkpoints) {
  // Children inherit the environment as it is at fork time.
  setenv("CUDA_VISIBLE_DEVICES", absl::StrCat(rank).c_str(), 1);
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  auto process = SpawnDaemon(
      {"--backend=cuda", "--config=" + config, "--world_size=2", absl::StrCat("--rank=", rank),
       absl::StrCat("--rendezvous_address=127.0.0.1:", rendezvous_port), "--checkpoint_dir=" + checkpoints});
  unsetenv("CUDA_VISIBLE_DEVICES");
  return process;
}

// Sends `batches` batches of `count` transitions drawn from `seed` on one
// stream, each acked before the next; returns the transitions accepted.
int64_t SendBatches(const std::shared_ptr<grpc::Channel>& channel, uint32_t seed, int batches, int count) {
  std::mt19937 rng(seed);
  auto stub = v1::ExperienceService::NewStub(channel);
  grpc::ClientContext context;
  auto stream = stub->Stream(&context);
  int64_t accepted = 0;
  v1::Ack ack;
  for (int s = 1; s <= batches; ++s) {
    v1::TransitionBatch batch = RandomNStepBatch(count, s, kObsDim, {3}, 0.9f, &rng);
    batch.set_stream_id(absl::StrCat("rank-data-", seed));
    if (!stream->Write(batch) || !stream->Read(&ack)) break;
    EXPECT_FALSE(ack.has_error()) << ack.error().message();
    accepted += ack.accepted();
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  return accepted;
}

TEST(DistributedE2E, TwoRanksOnTwoGpusHoldEqualWeights) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) {
    GTEST_SKIP() << "needs 2 CUDA devices, " << devices << " visible";
  }
  const std::string config = WriteTempFile("config.txt", kConfig);
  const std::string root = ::testing::TempDir() + "/distributed_e2e";
  std::filesystem::remove_all(root);
  const int port = FreePort();
  std::unique_ptr<ChildProcess> spawned[2] = {SpawnRank(0, port, config, root + "/rank0"),
                                              SpawnRank(1, port, config, root + "/rank1")};
  Daemon ranks[2];
  std::shared_ptr<grpc::Channel> channels[2];
  for (int r = 0; r < 2; ++r) {
    std::string error;
    auto d = AwaitDaemon(std::move(spawned[r]), absl::Seconds(180), &error);
    ASSERT_TRUE(d.has_value()) << error;
    ranks[r] = std::move(*d);
    channels[r] = grpc::CreateChannel(ranks[r].grpc_address, grpc::InsecureChannelCredentials());
  }
  for (int r = 0; r < 2; ++r) {
    const v1::StatusResponse s = GetStatus(channels[r]);
    EXPECT_EQ(s.world_size(), 2);
    EXPECT_EQ(s.rank(), r);
    EXPECT_EQ(s.backend(), "cuda");
  }
  // Different data per rank.
  for (int r = 0; r < 2; ++r) EXPECT_EQ(SendBatches(channels[r], 1 + r, 20, 64), 20 * 64);

  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  int64_t steps[2] = {0, 0};
  while (absl::Now() < deadline && (steps[0] < 20 || steps[1] < 20)) {
    for (int r = 0; r < 2; ++r) steps[r] = GetStatus(channels[r]).learner_steps();
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_GE(std::min(steps[0], steps[1]), 20) << "the group did not train";
  // A common stop: far enough ahead of both ranks.
  const int64_t at_step = std::max(steps[0], steps[1]) + 100;
  for (const auto& channel : channels) {
    auto stub = v1::AdminService::NewStub(channel);
    grpc::ClientContext context;
    v1::PauseRequest request;
    request.set_at_step(at_step);
    v1::PauseResponse response;
    ASSERT_TRUE(stub->Pause(&context, request, &response).ok());
  }
  bool paused[2] = {false, false};
  while (absl::Now() < deadline && !(paused[0] && paused[1])) {
    for (int r = 0; r < 2; ++r) {
      const v1::StatusResponse s = GetStatus(channels[r]);
      paused[r] = s.paused() && s.learner_steps() == at_step;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(paused[0] && paused[1]) << "not both paused at step " << at_step;

  std::vector<float> params[2], target[2];
  for (int r = 0; r < 2; ++r) {
    auto stub = v1::AdminService::NewStub(channels[r]);
    grpc::ClientContext context;
    v1::CheckpointRequest request;
    request.set_name("compare");
    v1::CheckpointResponse response;
    ASSERT_TRUE(stub->Checkpoint(&context, request, &response).ok());
    EXPECT_EQ(response.learner_steps(), at_step);
    auto data = ReadCheckpoint(absl::StrCat(root, "/rank", r, "/compare"));
    ASSERT_TRUE(data.ok()) << data.status();
    params[r] = data->state.params;
    target[r] = data->state.target;
    const std::string metrics = HttpGet(ranks[r].metrics_port, "/metrics");
    EXPECT_NE(metrics.find(absl::StrCat("rank=\"", r, "\"")), std::string::npos);
  }
  ASSERT_EQ(params[0].size(), params[1].size());
  EXPECT_EQ(std::memcmp(params[0].data(), params[1].data(), params[0].size() * sizeof(float)), 0)
      << "the ranks' online weights differ after " << at_step << " steps";
  EXPECT_EQ(std::memcmp(target[0].data(), target[1].data(), target[0].size() * sizeof(float)), 0);
  // Shut the group down together.
  for (Daemon& r : ranks) r.process->Signal(SIGTERM);
  for (Daemon& r : ranks) EXPECT_EQ(r.process->Wait(absl::Seconds(60)), 0);
}

}  // namespace
}  // namespace qstream::testing
