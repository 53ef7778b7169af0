// The whole CUDA step against the CPU backend (the oracle) on the same
// inserted data, bitwise reproducibility, the in-graph guard, asynchronous
// statistics and step times.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "tests/cuda/gpu_test_util.h"
#include "trainer/config.h"
#include "trainer/cpu/cpu_backend.h"
#include "trainer/cpu/forward.h"
#include "trainer/cuda/cuda_backend.h"

namespace qstream {
namespace {

using testing::RandomTransitions;
using testing::RelError;

using Precision = v1::TrainerConfig::MatmulPrecision;

v1::TrainerConfig TestConfig(Precision precision) {
  v1::TrainerConfig c = testing::SmallNetworkConfig();
  c.mutable_replay()->set_capacity(1000);
  c.mutable_replay()->set_batch_size(32);
  c.mutable_replay()->set_beta_anneal_steps(100);
  c.set_seed(7);
  c.set_matmul_precision(precision);
  return c;
}

std::unique_ptr<Backend> MustCreate(const v1::TrainerConfig& c, bool cuda) {
  auto b = cuda ? CreateCudaBackend(c) : CreateCpuBackend(c);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

// Inserts 1300 items into a 1000-slot ring (so it wraps) in two batches.
void Fill(Backend* b, const v1::TrainerConfig& c) {
  ASSERT_TRUE(b->Insert(RandomTransitions(c, 700, 1)).ok());
  ASSERT_TRUE(b->Insert(RandomTransitions(c, 600, 2)).ok());
}

// Waits for the device (GetParams synchronizes) so the stats copy landed.
StepStats SyncedStats(Backend* b) {
  b->GetParams();
  return b->last_stats();
}

void ExpectStatsNear(const StepStats& got, const StepStats& want, double tol, int step) {
  EXPECT_EQ(got.step, want.step) << "step " << step;
  EXPECT_EQ(got.guard, want.guard) << "step " << step;
  auto near = [&](float g, float w, const char* what) {
    EXPECT_LE(std::fabs(double(g) - w), tol * std::max(1.0, std::fabs(double(w))))
        << what << " step " << step;
  };
  near(got.loss, want.loss, "loss");
  near(got.grad_norm, want.grad_norm, "grad_norm");
  near(got.q_min, want.q_min, "q_min");
  near(got.q_mean, want.q_mean, "q_mean");
  near(got.q_max, want.q_max, "q_max");
  near(got.target_clip_fraction, want.target_clip_fraction, "target_clip_fraction");
}

// Selects the network path for the backends created in its scope.
class ScopedPath {
 public:
  explicit ScopedPath(bool cublas) : set_(cublas) {
    if (set_) setenv("QSTREAM_CUDA_PATH", "cublas", 1);
  }
  ~ScopedPath() {
    if (set_) unsetenv("QSTREAM_CUDA_PATH");
  }

 private:
  const bool set_;
};

// Tolerance on the parameters after 20 steps against the fp32 CPU oracle.
double StepTolerance(Precision p) {
  switch (p) {
    case v1::TrainerConfig::FP32: return 1e-5;
    case v1::TrainerConfig::TF32: return 3e-3;
    default: return 3e-2;
  }
}

// Twenty steps of `c` on the CUDA backend (the path `cublas` selects) and
// on the CPU backend from the same data: stats and parameters after every
// step, the guard counters and the trained Q-values. The backends come back
// in *gpu_out and *cpu_out for more checks.
void ExpectTwentyStepsMatchCpu(const v1::TrainerConfig& c, bool cublas, std::unique_ptr<Backend>* gpu_out,
                               std::unique_ptr<Backend>* cpu_out) {
  const Precision precision = MatmulPrecision(c);
  const double tol = StepTolerance(precision);
  const ScopedPath path(cublas);
  auto gpu = MustCreate(c, true);
  ASSERT_TRUE(gpu);
  if (getenv("QSTREAM_CUDA_PATH") == nullptr) {
    EXPECT_NE(gpu->device().find(cublas ? "[cublaslt" : "[fused"), std::string::npos) << gpu->device();
  }
  auto cpu = MustCreate(c, false);
  ASSERT_TRUE(gpu && cpu);
  EXPECT_EQ(gpu->GetParams(), cpu->GetParams()) << "same seed, same init";
  Fill(gpu.get(), c);
  Fill(cpu.get(), c);
  EXPECT_EQ(gpu->replay_size(), 1000);
  double worst = 0;
  for (int step = 0; step < 20; ++step) {
    ASSERT_TRUE(gpu->Step().ok());
    ASSERT_TRUE(cpu->Step().ok());
    ExpectStatsNear(SyncedStats(gpu.get()), cpu->last_stats(), 10 * tol, step);
    const double err = RelError(gpu->GetParams(), cpu->GetParams());
    worst = std::max(worst, err);
    EXPECT_LE(err, tol) << "params after step " << step;
  }
  std::cout << "[ info ] worst params rel error over 20 steps ("
            << v1::TrainerConfig::MatmulPrecision_Name(precision) << ", " << gpu->device() << "): " << worst
            << "\n";
  EXPECT_EQ(gpu->steps(), 20);
  EXPECT_EQ(gpu->guard_trips(), cpu->guard_trips());
  // The trained networks give the same Q-values.
  const TransitionColumns probe = RandomTransitions(c, 77, 3);
  const std::vector<float> p_gpu = gpu->GetParams(), p_cpu = cpu->GetParams();
  std::vector<float> q_gpu(size_t(probe.n) * gpu->spec().total_actions()), q_cpu(q_gpu.size());
  ComputeQValues(gpu->spec(), p_gpu.data(), probe.obs.data(), probe.n, q_gpu.data());
  ComputeQValues(cpu->spec(), p_cpu.data(), probe.obs.data(), probe.n, q_cpu.data());
  EXPECT_LE(RelError(q_gpu, q_cpu), tol);
  *gpu_out = std::move(gpu);
  *cpu_out = std::move(cpu);
}

class StepVsCpuTest : public ::testing::TestWithParam<std::tuple<Precision, bool>> {};

TEST_P(StepVsCpuTest, TwentyStepsMatchCpuBackend) {
  QS_SKIP_WITHOUT_GPU();
  std::unique_ptr<Backend> gpu, cpu;
  ExpectTwentyStepsMatchCpu(TestConfig(std::get<0>(GetParam())), std::get<1>(GetParam()), &gpu, &cpu);
}

// optimizer.lr_decay_steps: the Adam kernel computes each step's learning
// rate from the device's step counter; parameters after every step match the
// CPU oracle while lr falls tenfold over the first 10 of the 20 steps.
TEST_P(StepVsCpuTest, TwentyStepsWithLrScheduleMatchCpuBackend) {
  QS_SKIP_WITHOUT_GPU();
  v1::TrainerConfig c = TestConfig(std::get<0>(GetParam()));
  c.mutable_optimizer()->set_lr_end(c.optimizer().lr() / 10);
  c.mutable_optimizer()->set_lr_decay_steps(10);
  std::unique_ptr<Backend> gpu, cpu;
  ExpectTwentyStepsMatchCpu(c, std::get<1>(GetParam()), &gpu, &cpu);
}

// Label smoothing and the MSE blend with alpha going from 1 to 0 over the
// first 10 of the 20 steps (the device computes alpha from its own step
// counter inside the graph): loss, parameters after every step and the
// priorities written back match the CPU oracle.
TEST_P(StepVsCpuTest, TwentyStepsWithLossOptionsMatchCpuBackend) {
  QS_SKIP_WITHOUT_GPU();
  v1::TrainerConfig c = TestConfig(std::get<0>(GetParam()));
  c.mutable_loss()->set_label_smoothing(0.1f);
  c.mutable_loss()->mutable_mse_blend()->set_start(1.0f);
  c.mutable_loss()->mutable_mse_blend()->set_end(0.0f);
  c.mutable_loss()->mutable_mse_blend()->set_steps(10);
  std::unique_ptr<Backend> gpu, cpu;
  ExpectTwentyStepsMatchCpu(c, std::get<1>(GetParam()), &gpu, &cpu);
  ASSERT_TRUE(gpu && cpu);
  BackendState gpu_state, cpu_state;
  ASSERT_TRUE(gpu->SaveState(true, &gpu_state).ok());
  ASSERT_TRUE(cpu->SaveState(true, &cpu_state).ok());
  EXPECT_LE(RelError(gpu_state.replay.priorities, cpu_state.replay.priorities),
            10 * StepTolerance(std::get<0>(GetParam())));
  EXPECT_NEAR(gpu_state.replay.max_priority, cpu_state.replay.max_priority,
              10 * StepTolerance(std::get<0>(GetParam())) * cpu_state.replay.max_priority);
}

INSTANTIATE_TEST_SUITE_P(Precision, StepVsCpuTest,
                         ::testing::Combine(::testing::Values(v1::TrainerConfig::FP32,
                                                              v1::TrainerConfig::TF32,
                                                              v1::TrainerConfig::BF16),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return v1::TrainerConfig::MatmulPrecision_Name(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_Cublas" : "_Fused");
                         });

// A checkpointed state moves between backends: the CPU state after 10 steps
// loaded into a fresh CUDA backend, and the CUDA state saved and loaded into
// another CUDA backend, both continue like the CPU backend (fp32 tolerance);
// the CUDA copy continues bitwise like its original. The saved replay
// (rows, priorities, cursor, max priority) equals the CPU's exactly.
TEST(CudaBackend, SaveLoadStateContinuesLikeCpu) {
  QS_SKIP_WITHOUT_GPU();
  const double tol = 1e-5;
  const v1::TrainerConfig c = TestConfig(v1::TrainerConfig::FP32);
  auto cpu = MustCreate(c, false);
  auto gpu = MustCreate(c, true);
  ASSERT_TRUE(cpu && gpu);
  Fill(cpu.get(), c);
  Fill(gpu.get(), c);
  for (int step = 0; step < 10; ++step) {
    ASSERT_TRUE(cpu->Step().ok());
    ASSERT_TRUE(gpu->Step().ok());
  }
  BackendState cpu_state, gpu_state;
  ASSERT_TRUE(cpu->SaveState(true, &cpu_state).ok());
  ASSERT_TRUE(gpu->SaveState(true, &gpu_state).ok());
  EXPECT_EQ(gpu_state.steps, 10);
  EXPECT_EQ(gpu_state.applied_updates, cpu_state.applied_updates);
  EXPECT_EQ(gpu_state.replay.size, cpu_state.replay.size);
  EXPECT_EQ(gpu_state.replay.cursor, cpu_state.replay.cursor);
  EXPECT_EQ(gpu_state.replay.rows.obs, cpu_state.replay.rows.obs);
  EXPECT_EQ(gpu_state.replay.rows.actions, cpu_state.replay.rows.actions);
  EXPECT_LE(RelError(gpu_state.replay.priorities, cpu_state.replay.priorities), 10 * tol);
  EXPECT_LE(RelError(gpu_state.adam_v, cpu_state.adam_v), 10 * tol);

  auto from_cpu = MustCreate(c, true);
  auto from_gpu = MustCreate(c, true);
  ASSERT_TRUE(from_cpu->LoadState(cpu_state, StateParts::kAll).ok());
  ASSERT_TRUE(from_gpu->LoadState(gpu_state, StateParts::kAll).ok());
  EXPECT_EQ(from_cpu->steps(), 10);
  EXPECT_EQ(from_gpu->replay_size(), gpu->replay_size());
  for (int step = 0; step < 10; ++step) {
    for (Backend* b : {cpu.get(), gpu.get(), from_cpu.get(), from_gpu.get()}) ASSERT_TRUE(b->Step().ok());
  }
  const std::vector<float> want = cpu->GetParams();
  EXPECT_LE(RelError(from_cpu->GetParams(), want), tol);
  EXPECT_LE(RelError(from_gpu->GetParams(), want), tol);
  EXPECT_EQ(from_gpu->GetParams(), gpu->GetParams()) << "same device, same state: bitwise";
  EXPECT_EQ(SyncedStats(from_gpu.get()).step, 20);
}

TEST(CudaBackend, TwoRunsBitwiseEqual) {
  QS_SKIP_WITHOUT_GPU();
  for (Precision precision : {v1::TrainerConfig::FP32, v1::TrainerConfig::TF32, v1::TrainerConfig::BF16}) {
    for (bool loss_options : {false, true}) {
      SCOPED_TRACE(v1::TrainerConfig::MatmulPrecision_Name(precision) +
                   (loss_options ? " with loss options" : ""));
      v1::TrainerConfig c = TestConfig(precision);
      if (loss_options) {
        c.mutable_loss()->set_label_smoothing(0.1f);
        c.mutable_loss()->mutable_mse_blend()->set_start(1.0f);
        c.mutable_loss()->mutable_mse_blend()->set_steps(10);
      }
      std::vector<float> params[2];
      StepStats stats[2];
      for (int run = 0; run < 2; ++run) {
        auto b = MustCreate(c, true);
        ASSERT_TRUE(b);
        Fill(b.get(), c);
        for (int step = 0; step < 20; ++step) ASSERT_TRUE(b->Step().ok());
        params[run] = b->GetParams();
        stats[run] = b->last_stats();
      }
      ASSERT_EQ(params[0].size(), params[1].size());
      EXPECT_EQ(std::memcmp(params[0].data(), params[1].data(), params[0].size() * sizeof(float)), 0);
      EXPECT_EQ(std::bit_cast<uint32_t>(stats[0].loss), std::bit_cast<uint32_t>(stats[1].loss));
      EXPECT_EQ(stats[0].step, 20);
    }
  }
}

TEST(CudaBackend, GuardSkipsPoisonedStepInGraph) {
  QS_SKIP_WITHOUT_GPU();
  const v1::TrainerConfig c = TestConfig(v1::TrainerConfig::TF32);
  auto b = MustCreate(c, true);
  ASSERT_TRUE(b);
  TransitionColumns t = RandomTransitions(c, 200, 4);
  for (float& r : t.rewards) r = std::numeric_limits<float>::quiet_NaN();
  ASSERT_TRUE(b->Insert(t).ok());
  const std::vector<float> before = b->GetParams();
  for (int step = 0; step < 3; ++step) ASSERT_TRUE(b->Step().ok());
  EXPECT_EQ(b->GetParams(), before);
  const StepStats s = b->last_stats();
  EXPECT_EQ(s.guard, GuardReason::kNonFiniteLoss);
  EXPECT_EQ(s.step, 3);
  EXPECT_EQ(b->guard_trips()[static_cast<int>(GuardReason::kNonFiniteLoss)], 3);
}

TEST(CudaBackend, StatsAndStepTimesArriveWithoutBlocking) {
  QS_SKIP_WITHOUT_GPU();
  v1::TrainerConfig c = TestConfig(v1::TrainerConfig::TF32);
  c.mutable_server()->set_stats_every(5);
  auto b = MustCreate(c, true);
  ASSERT_TRUE(b);
  Fill(b.get(), c);
  for (int step = 0; step < 20; ++step) ASSERT_TRUE(b->Step().ok());
  const StepStats s = SyncedStats(b.get());
  EXPECT_EQ(s.step, 20);
  EXPECT_TRUE(std::isfinite(s.loss) && s.loss > 0);
  EXPECT_TRUE(std::isfinite(s.grad_norm) && s.grad_norm > 0);
  EXPECT_LE(s.q_min, s.q_mean);
  EXPECT_LE(s.q_mean, s.q_max);
  std::vector<std::pair<double, int64_t>> times;
  b->DrainStepTimes(&times);
  // Every step is timed on its own (issue: a window mean hid the tail steps).
  ASSERT_EQ(times.size(), 20u);
  for (const auto& [seconds, n] : times) {
    EXPECT_GT(seconds, 0.0);
    EXPECT_LT(seconds, 1.0);
    EXPECT_EQ(n, 1);
  }
  // The backend's memory is read once it is set up.
  const DeviceMemory mem = b->device_memory();
  EXPECT_GT(mem.used_bytes, 0);
  EXPECT_GE(mem.total_bytes, mem.used_bytes);
}

TEST(CudaBackend, RejectsEmptyReplayAndBadBatches) {
  QS_SKIP_WITHOUT_GPU();
  const v1::TrainerConfig c = TestConfig(v1::TrainerConfig::TF32);
  auto b = MustCreate(c, true);
  ASSERT_TRUE(b);
  EXPECT_EQ(b->Step().code(), absl::StatusCode::kFailedPrecondition);
  TransitionColumns t = RandomTransitions(c, 10, 5);
  t.actions[3] = 9;
  EXPECT_EQ(b->Insert(t).code(), absl::StatusCode::kInvalidArgument);
  t = RandomTransitions(c, 10, 5);
  t.rewards.pop_back();
  EXPECT_EQ(b->Insert(t).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b->replay_size(), 0);
}

// Batches handed over together (the learner's insert rounds) are packed into
// the staging buffers across batch boundaries: the ring ends up exactly as
// after inserting them one by one on the CPU backend, an invalid batch in
// the middle is left out with its own error, and a batch larger than the
// ring keeps its last `capacity` rows.
TEST(CudaBackend, InsertManyPacksBatchesLikeOneByOneInserts) {
  QS_SKIP_WITHOUT_GPU();
  const v1::TrainerConfig c = TestConfig(v1::TrainerConfig::FP32);
  std::mt19937_64 rng(std::random_device{}());
  for (int round = 0; round < 3; ++round) {
    auto cpu = MustCreate(c, false);
    auto gpu = MustCreate(c, true);
    ASSERT_TRUE(cpu && gpu);
    std::vector<TransitionColumns> batches;
    for (int i = 0; i < 12; ++i) {
      const int64_t n = i == 5 ? 1700 : 1 + static_cast<int64_t>(rng() % (i % 3 == 0 ? 400 : 20));
      batches.push_back(RandomTransitions(c, n, rng()));
    }
    batches[7].actions[0] = 9;  // out of range for branch 0
    std::vector<const TransitionColumns*> ptrs;
    ptrs.reserve(batches.size());
    for (const TransitionColumns& b : batches) ptrs.push_back(&b);
    std::vector<absl::Status> statuses;
    gpu->InsertMany(ptrs, &statuses);
    ASSERT_EQ(statuses.size(), batches.size());
    for (size_t i = 0; i < batches.size(); ++i) {
      const absl::Status want = cpu->Insert(batches[i]);
      EXPECT_EQ(statuses[i].code(), want.code()) << i << ": " << statuses[i];
    }
    EXPECT_EQ(statuses[7].code(), absl::StatusCode::kInvalidArgument);
    BackendState cpu_state, gpu_state;
    ASSERT_TRUE(cpu->SaveState(true, &cpu_state).ok());
    ASSERT_TRUE(gpu->SaveState(true, &gpu_state).ok());
    EXPECT_EQ(gpu_state.replay.size, cpu_state.replay.size);
    EXPECT_EQ(gpu_state.replay.cursor, cpu_state.replay.cursor);
    EXPECT_EQ(gpu_state.replay.rows.obs, cpu_state.replay.rows.obs);
    EXPECT_EQ(gpu_state.replay.rows.next_obs, cpu_state.replay.rows.next_obs);
    EXPECT_EQ(gpu_state.replay.rows.actions, cpu_state.replay.rows.actions);
    EXPECT_EQ(gpu_state.replay.rows.rewards, cpu_state.replay.rows.rewards);
    EXPECT_EQ(gpu_state.replay.rows.discounts, cpu_state.replay.rows.discounts);
    EXPECT_EQ(gpu_state.replay.priorities, cpu_state.replay.priorities);
  }
}

// The h200 network (256-wide, where the automatic choice is cuBLASLt) on
// both paths in exact fp32: the same 5 steps to fp32 rounding.
TEST(CudaBackend, H200FusedAndCublasPathsAgree) {
  QS_SKIP_WITHOUT_GPU();
  auto c = BenchConfig("h200");
  ASSERT_TRUE(c.ok());
  c->mutable_replay()->set_batch_size(256);
  c->mutable_replay()->set_capacity(4096);
  c->mutable_rate_limiter()->set_min_size_to_sample(1);
  c->set_matmul_precision(v1::TrainerConfig::FP32);
  std::vector<float> params[2];
  for (int path = 0; path < 2; ++path) {
    setenv("QSTREAM_CUDA_PATH", path == 0 ? "fused" : "cublas", 1);
    auto b = MustCreate(*c, true);
    unsetenv("QSTREAM_CUDA_PATH");
    ASSERT_TRUE(b);
    EXPECT_NE(b->device().find(path == 0 ? "[fused fp32]" : "[cublaslt fp32"), std::string::npos)
        << b->device();
    ASSERT_TRUE(b->Insert(RandomTransitions(*c, 3000, 8)).ok());
    for (int step = 0; step < 5; ++step) ASSERT_TRUE(b->Step().ok());
    params[path] = b->GetParams();
    EXPECT_EQ(SyncedStats(b.get()).guard, GuardReason::kNone);
  }
  const double err = RelError(params[0], params[1]);
  std::cout << "[ info ] h200 fp32 fused vs cublaslt params rel error after 5 steps: " << err << "\n";
  EXPECT_LE(err, 1e-5);
}

// Programmatic dependent launch (kernels/launch.h) changes when a kernel's
// blocks start, never what they compute: 20 steps with it off, with the
// default kernels and with every step kernel as a dependent are bitwise
// equal on both network paths and all three precisions, for the test network
// at B = 32 and the h200 network at B = 1024.
TEST(CudaBackend, DependentLaunchChangesNoBit) {
  QS_SKIP_WITHOUT_GPU();
  int dev = 0, major = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), cudaSuccess);
  if (major < 9) GTEST_SKIP() << "programmatic dependent launch needs compute capability 9.0";
  auto h200 = BenchConfig("h200");
  ASSERT_TRUE(h200.ok());
  h200->mutable_replay()->set_batch_size(1024);
  h200->mutable_replay()->set_capacity(8192);
  h200->mutable_rate_limiter()->set_min_size_to_sample(1);
  h200->mutable_server()->set_stats_every(1);
  const char* const kModes[] = {"0", nullptr, "0x1ff"};  // off, the default, all
  for (bool big : {false, true}) {
    for (Precision precision : {v1::TrainerConfig::FP32, v1::TrainerConfig::TF32, v1::TrainerConfig::BF16}) {
      for (const char* path : {"fused", "cublas"}) {
        v1::TrainerConfig c = big ? *h200 : TestConfig(precision);
        c.set_matmul_precision(precision);
        SCOPED_TRACE(std::string(big ? "h200/1024 " : "test network/32 ") +
                     v1::TrainerConfig::MatmulPrecision_Name(precision) + " " + path);
        std::vector<float> params[3];
        StepStats stats[3];
        for (int mode = 0; mode < 3; ++mode) {
          setenv("QSTREAM_CUDA_PATH", path, 1);
          if (kModes[mode] != nullptr) setenv("QSTREAM_CUDA_PDL", kModes[mode], 1);
          auto b = MustCreate(c, true);
          unsetenv("QSTREAM_CUDA_PATH");
          unsetenv("QSTREAM_CUDA_PDL");
          ASSERT_TRUE(b);
          EXPECT_EQ(b->device().find("[dependent launch]") != std::string::npos, mode != 0) << b->device();
          if (big) {
            ASSERT_TRUE(b->Insert(RandomTransitions(c, 3000, 11)).ok());
          } else {
            Fill(b.get(), c);
          }
          for (int step = 0; step < 20; ++step) ASSERT_TRUE(b->Step().ok());
          params[mode] = b->GetParams();
          stats[mode] = b->last_stats();
        }
        for (int mode = 1; mode < 3; ++mode) {
          SCOPED_TRACE(kModes[mode] != nullptr ? kModes[mode] : "default");
          ASSERT_EQ(params[0].size(), params[mode].size());
          EXPECT_EQ(std::memcmp(params[0].data(), params[mode].data(), params[0].size() * sizeof(float)), 0);
          EXPECT_EQ(std::bit_cast<uint32_t>(stats[0].loss), std::bit_cast<uint32_t>(stats[mode].loss));
          EXPECT_EQ(std::bit_cast<uint32_t>(stats[0].grad_norm),
                    std::bit_cast<uint32_t>(stats[mode].grad_norm));
          EXPECT_EQ(stats[mode].step, 20);
        }
        EXPECT_EQ(stats[0].step, 20);
      }
    }
  }
}

TEST(CudaBackend, RejectsABadDependentLaunchSetting) {
  QS_SKIP_WITHOUT_GPU();
  for (const char* bad : {"yes", "0x400", "1x", ""}) {
    setenv("QSTREAM_CUDA_PDL", bad, 1);
    auto b = CreateCudaBackend(TestConfig(v1::TrainerConfig::TF32));
    unsetenv("QSTREAM_CUDA_PDL");
    ASSERT_FALSE(b.ok()) << "'" << bad << "'";
    EXPECT_NE(b.status().message().find("QSTREAM_CUDA_PDL"), std::string::npos) << b.status();
  }
}

TEST(CudaBackend, BenchConfigH200Runs) {
  QS_SKIP_WITHOUT_GPU();
  auto c = BenchConfig("h200");
  ASSERT_TRUE(c.ok());
  c->mutable_replay()->set_batch_size(256);
  auto b = MustCreate(*c, true);
  ASSERT_TRUE(b);
  ASSERT_TRUE(b->Insert(RandomTransitions(*c, 5000, 6)).ok());
  for (int step = 0; step < 10; ++step) ASSERT_TRUE(b->Step().ok());
  const StepStats s = SyncedStats(b.get());
  EXPECT_EQ(s.step, 10);
  EXPECT_TRUE(std::isfinite(s.loss));
  EXPECT_EQ(s.guard, GuardReason::kNone);
}

}  // namespace
}  // namespace qstream
