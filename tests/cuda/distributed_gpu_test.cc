// Data-parallel groups on the CUDA backend (trainer/backend.h SyncGroup):
// a group of one against the plain step, and two ranks on two devices
// (threads of this process, one backend each) against each other and
// against one device stepping on the union batch. Skips without the devices.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/cuda/gpu_test_util.h"
#include "trainer/config.h"
#include "trainer/cuda/cuda_backend.h"
#include "trainer/cuda/nccl.h"

namespace qstream {
namespace {

using testing::RandomTransitions;

v1::TrainerConfig GroupConfig(int batch, int capacity) {
  v1::TrainerConfig c = testing::SmallNetworkConfig();
  c.mutable_replay()->set_capacity(capacity);
  c.mutable_replay()->set_batch_size(batch);
  c.mutable_rate_limiter()->set_min_size_to_sample(1);
  c.set_seed(11);
  c.set_matmul_precision(v1::TrainerConfig::FP32);
  return c;
}

// Rows [from, from + n) of `t`.
TransitionColumns Rows(const TransitionColumns& t, int64_t from, int64_t n) {
  TransitionColumns r;
  r.n = n;
  r.obs_dim = t.obs_dim;
  r.num_branches = t.num_branches;
  auto slice = [](const auto& v, int64_t width, int64_t a, int64_t k) {
    return std::decay_t<decltype(v)>(v.begin() + a * width, v.begin() + (a + k) * width);
  };
  r.obs = slice(t.obs, t.obs_dim, from, n);
  r.next_obs = slice(t.next_obs, t.obs_dim, from, n);
  r.rewards = slice(t.rewards, 1, from, n);
  r.discounts = slice(t.discounts, 1, from, n);
  r.actions = slice(t.actions, t.num_branches, from, n);
  return r;
}

std::string MustNewId() {
  auto id = cuda::NewNcclUniqueId();
  EXPECT_TRUE(id.ok()) << id.status() << " (" << cuda::NcclVersion() << ")";
  return id.ok() ? *id : std::string();
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ||a - b|| / ||b - base||: the disagreement relative to how far training moved.
double RelativeToMovement(const std::vector<float>& a, const std::vector<float>& b,
                          const std::vector<float>& base) {
  double diff = 0, moved = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    moved += (double(b[i]) - base[i]) * (double(b[i]) - base[i]);
  }
  return std::sqrt(diff / std::max(moved, 1e-30));
}

// A group of one runs the all-reduce inside the graph: the same training as
// the plain step (bitwise on the cuBLASLt path, whose norm partials come from
// the same kernel; within rounding on the fused path, whose backward kernel
// computes them otherwise).
TEST(DistributedCuda, GroupOfOneEqualsPlainStep) {
  QS_SKIP_WITHOUT_GPU();
  for (bool cublas : {true, false}) {
    SCOPED_TRACE(cublas ? "cublas path" : "fused path");
    if (cublas) setenv("QSTREAM_CUDA_PATH", "cublas", 1);
    const v1::TrainerConfig c = GroupConfig(32, 1000);
    DistributedGroup group;
    group.nccl_unique_id = MustNewId();
    ASSERT_FALSE(group.nccl_unique_id.empty());
    auto plain = CreateCudaBackend(c);
    auto grouped = CreateCudaBackend(c, &group);
    unsetenv("QSTREAM_CUDA_PATH");
    ASSERT_TRUE(plain.ok()) << plain.status();
    ASSERT_TRUE(grouped.ok()) << grouped.status();
    EXPECT_EQ((*grouped)->world_size(), 1);
    ASSERT_TRUE((*grouped)->SyncGroup().ok());
    const std::vector<float> init = (*plain)->GetParams();
    for (Backend* b : {plain->get(), grouped->get()}) {
      ASSERT_TRUE(b->Insert(RandomTransitions(c, 700, 1)).ok());
      ASSERT_TRUE(b->Insert(RandomTransitions(c, 600, 2)).ok());
    }
    for (int step = 0; step < 30; ++step) {
      ASSERT_TRUE((*plain)->Step().ok());
      ASSERT_TRUE((*grouped)->Step().ok());
    }
    const std::vector<float> a = (*plain)->GetParams(), b = (*grouped)->GetParams();
    const double rel = RelativeToMovement(b, a, init);
    std::cout << "[ info ] group of one vs plain after 30 steps (" << (*grouped)->device()
              << "): relative difference " << rel << "\n";
    if (cublas) {
      EXPECT_TRUE(BitwiseEqual(a, b));
    } else {
      EXPECT_LE(rel, 1e-4);
    }
    const StepStats sa = (*plain)->last_stats(), sb = (*grouped)->last_stats();
    EXPECT_EQ(sa.step, 30);
    EXPECT_EQ(sb.step, 30);
    EXPECT_EQ(sa.guard, sb.guard);
    EXPECT_NEAR(sa.loss, sb.loss, 1e-5 * std::max(1.0f, std::fabs(sa.loss)));
  }
}

int DeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// Runs `body(rank, backend)` for both ranks of a group of two, rank r on
// device r, each in its own thread (NCCL's collectives need both at once).
template <typename Body>
void RunTwoRanks(const v1::TrainerConfig& c, Body body) {
  const std::string id = MustNewId();
  ASSERT_FALSE(id.empty());
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      v1::TrainerConfig rc = c;
      rc.mutable_distributed()->set_world_size(2);
      rc.mutable_distributed()->set_rank(r);
      rc.mutable_distributed()->set_rendezvous_address("in-process:0");
      DistributedGroup group{.world_size = 2, .rank = r, .nccl_unique_id = id};
      auto b = CreateCudaBackend(rc, &group);
      ASSERT_TRUE(b.ok()) << "rank " << r << ": " << b.status();
      ASSERT_TRUE((*b)->SyncGroup().ok());
      body(r, b->get());
    });
  }
  for (std::thread& t : ranks) t.join();
}

// Two ranks, different data: after 100 steps their weights are bitwise
// equal, and equal (within fp32 rounding) to one device stepping on the
// union batch. Uniform priorities (alpha 0) over replays of exactly B items
// make the stratified sampler take every item once per step, so both runs
// see the same items.
TEST(DistributedCuda, TwoRanksStayBitwiseEqualAndMatchTheUnionBatch) {
  QS_SKIP_WITHOUT_GPU();
  if (DeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices, " << DeviceCount() << " visible";
  constexpr int B = 64;
  constexpr int kSteps = 100;
  v1::TrainerConfig c = GroupConfig(B, B);
  c.mutable_replay()->set_alpha(0.0f);
  const TransitionColumns data = RandomTransitions(c, 2 * B, 5);
  std::vector<float> params[2];
  StepStats stats[2];
  std::vector<float> init;
  RunTwoRanks(c, [&](int rank, Backend* b) {
    if (rank == 0) init = b->GetParams();
    ASSERT_TRUE(b->Insert(Rows(data, rank * B, B)).ok());
    for (int step = 0; step < kSteps; ++step) ASSERT_TRUE(b->Step().ok());
    params[rank] = b->GetParams();
    stats[rank] = b->last_stats();
  });
  ASSERT_FALSE(params[0].empty());
  EXPECT_TRUE(BitwiseEqual(params[0], params[1])) << "ranks diverged";
  EXPECT_EQ(stats[0].step, kSteps);
  EXPECT_EQ(stats[1].step, kSteps);

  // One device, batch 2B over the union.
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const v1::TrainerConfig single = GroupConfig(2 * B, 2 * B);
  v1::TrainerConfig sc = single;
  sc.mutable_replay()->set_alpha(0.0f);
  auto one = CreateCudaBackend(sc);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_TRUE((*one)->Insert(data).ok());
  for (int step = 0; step < kSteps; ++step) ASSERT_TRUE((*one)->Step().ok());
  const std::vector<float> ref = (*one)->GetParams();
  const double rel = RelativeToMovement(params[0], ref, init);
  std::cout << "[ info ] 2 ranks x B=" << B << " vs 1 device x B=" << 2 * B << " after " << kSteps
            << " steps: relative difference " << rel << "\n";
  EXPECT_LE(rel, 1e-3);
}

// The guard decides on group values: one rank's poisoned batch makes every
// rank skip that step, so the weights stay equal (and unchanged).
TEST(DistributedCuda, OneRanksBadBatchTripsEveryRank) {
  QS_SKIP_WITHOUT_GPU();
  if (DeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices, " << DeviceCount() << " visible";
  const v1::TrainerConfig c = GroupConfig(32, 200);
  std::vector<float> before[2], after[2];
  StepStats stats[2];
  RunTwoRanks(c, [&](int rank, Backend* b) {
    TransitionColumns t = RandomTransitions(c, 200, 10 + rank);
    if (rank == 1) {
      for (float& r : t.rewards) r = std::numeric_limits<float>::quiet_NaN();
    }
    ASSERT_TRUE(b->Insert(t).ok());
    before[rank] = b->GetParams();
    for (int step = 0; step < 3; ++step) ASSERT_TRUE(b->Step().ok());
    after[rank] = b->GetParams();
    stats[rank] = b->last_stats();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(BitwiseEqual(before[r], after[r])) << "rank " << r << " applied an update";
    EXPECT_EQ(stats[r].guard, GuardReason::kNonFiniteLoss) << "rank " << r;
  }
  EXPECT_TRUE(BitwiseEqual(after[0], after[1]));
}

}  // namespace
}  // namespace qstream
