#include "trainer/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "common/step_constants.h"
#include "gtest/gtest.h"
#include "trainer/config.h"
#include "trainer/cpu/c51_loss.h"
#include "trainer/cpu/forward.h"
#include "trainer/cpu/replay.h"

namespace qstream {
namespace {

v1::TrainerConfig TestConfig() {
  v1::TrainerConfig c;
  auto* n = c.mutable_network();
  n->set_obs_dim(4);
  n->add_trunk_hidden(16);
  n->add_trunk_hidden(12);
  n->set_head_hidden(10);
  n->set_num_atoms(11);
  n->set_v_min(-5);
  n->set_v_max(5);
  n->add_branch_actions(3);
  n->add_branch_actions(2);
  c.mutable_replay()->set_capacity(128);
  c.mutable_replay()->set_batch_size(16);
  c.mutable_replay()->set_beta_anneal_steps(10);
  c.mutable_rate_limiter()->set_min_size_to_sample(1);
  c.set_seed(3);
  FillDefaults(&c);
  return c;
}

std::unique_ptr<Backend> Make(const v1::TrainerConfig& config) {
  auto backend = CreateCpuBackend(config);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return *std::move(backend);
}

// Random transitions: rewards in [-2, 2] (some beyond the support after
// bootstrapping), every fifth item terminal.
TransitionColumns RandomItems(const NetworkSpec& spec, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> obs(0, 1);
  std::uniform_real_distribution<float> u(-2, 2);
  TransitionColumns c;
  c.n = n;
  c.obs_dim = spec.obs_dim;
  c.num_branches = spec.num_branches();
  for (int i = 0; i < n; ++i) {
    for (int d = 0; d < spec.obs_dim; ++d) {
      c.obs.push_back(obs(rng));
      c.next_obs.push_back(obs(rng));
    }
    for (int br = 0; br < spec.num_branches(); ++br) c.actions.push_back(rng() % spec.branch_actions[br]);
    c.rewards.push_back(u(rng));
    c.discounts.push_back(i % 5 == 0 ? 0.0f : 0.970299f);
  }
  return c;
}

TEST(CpuBackendTest, StepNeedsData) {
  auto backend = Make(TestConfig());
  EXPECT_EQ(backend->name(), "cpu");
  EXPECT_EQ(backend->replay_capacity(), 128);
  EXPECT_EQ(backend->Step().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CpuBackendTest, InsertValidatesShapesAndActionRanges) {
  auto backend = Make(TestConfig());
  const NetworkSpec& spec = backend->spec();
  EXPECT_TRUE(backend->Insert(RandomItems(spec, 10, 1)).ok());
  EXPECT_EQ(backend->replay_size(), 10);
  auto bad = RandomItems(spec, 3, 2);
  bad.actions[3] = 2;  // item 1, branch 1 has 2 actions
  auto st = backend->Insert(bad);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("actions"), std::string::npos) << st;
  bad = RandomItems(spec, 3, 2);
  bad.discounts.pop_back();
  st = backend->Insert(bad);
  EXPECT_NE(st.message().find("discounts"), std::string::npos) << st;
  EXPECT_EQ(backend->replay_size(), 10);
}

TEST(CpuBackendTest, SetParamsReplacesTheOnlineParams) {
  auto backend = Make(TestConfig());
  const NetworkSpec& spec = backend->spec();
  auto params = backend->GetParams();
  ASSERT_EQ(static_cast<int64_t>(params.size()), spec.num_params);
  for (float& p : params) p *= 1.5f;
  ASSERT_TRUE(backend->SetParams(params).ok());
  EXPECT_EQ(backend->GetParams(), params);
  EXPECT_FALSE(backend->SetParams(std::vector<float>(3)).ok());
}

TEST(CpuBackendTest, StepTrainsAndReportsStatsAndTimes) {
  auto backend = Make(TestConfig());
  ASSERT_TRUE(backend->Insert(RandomItems(backend->spec(), 100, 4)).ok());
  const auto before = backend->GetParams();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(backend->Step().ok());
  EXPECT_EQ(backend->steps(), 3);
  EXPECT_NE(backend->GetParams(), before);
  const StepStats s = backend->last_stats();
  EXPECT_EQ(s.step, 3);
  EXPECT_EQ(s.guard, GuardReason::kNone);
  EXPECT_GT(s.loss, 0);
  EXPECT_GT(s.grad_norm, 0);
  EXPECT_LE(s.q_min, s.q_mean);
  EXPECT_LE(s.q_mean, s.q_max);
  EXPECT_GE(s.target_clip_fraction, 0);
  EXPECT_LE(s.target_clip_fraction, 1);
  std::vector<std::pair<double, int64_t>> times;
  backend->DrainStepTimes(&times);
  ASSERT_EQ(times.size(), 3u);
  for (const auto& [seconds, count] : times) {
    EXPECT_GT(seconds, 0);
    EXPECT_EQ(count, 1);
  }
  times.clear();
  backend->DrainStepTimes(&times);
  EXPECT_TRUE(times.empty());
  EXPECT_EQ(backend->guard_trips(), std::vector<int64_t>(kNumGuardReasons, 0));
}

TEST(CpuBackendTest, SameSeedAndDataGiveBitwiseEqualWeights) {
  const auto config = TestConfig();
  auto a = Make(config);
  auto b = Make(config);
  auto other_config = config;
  other_config.set_seed(4);
  auto c = Make(other_config);
  for (int round = 0; round < 5; ++round) {
    const auto items = RandomItems(a->spec(), 40, 100 + round);
    for (Backend* backend : {a.get(), b.get(), c.get()}) {
      ASSERT_TRUE(backend->Insert(items).ok());
      for (int i = 0; i < 6; ++i) ASSERT_TRUE(backend->Step().ok());
    }
  }
  EXPECT_EQ(a->GetParams(), b->GetParams());
  EXPECT_EQ(a->last_stats().loss, b->last_stats().loss);
  EXPECT_NE(a->GetParams(), c->GetParams());
}

// Steps 1-11 composed from the CPU pieces in double precision, with the
// backend's float step checked against them: sampling (seed, step, beta
// annealing), IS weights, loss options (label smoothing, the MSE blend's
// alpha schedule computed here in double), clip, Adam bias correction, target
// update, priority write-back of the CE feeding the next step's sampling.
void CheckAgainstReference(const v1::TrainerConfig& config, int steps) {
  auto backend = Make(config);
  const NetworkSpec spec = backend->spec();
  const auto items = RandomItems(spec, 60, 5);
  ASSERT_TRUE(backend->Insert(items).ok());

  const auto& rc = config.replay();
  const auto& oc = config.optimizer();
  cpu::PrioritizedReplay replay(rc.capacity(), spec.obs_dim, spec.num_branches());
  replay.Insert(items);
  std::vector<double> online, target, m(spec.num_params, 0), v(spec.num_params, 0);
  for (float x : InitParams(spec, config.seed())) online.push_back(x);
  target = online;
  const int B = rc.batch_size();
  cpu::C51Loss<double> loss(spec);
  cpu::LossBatch<double> batch;
  batch.Resize(spec, B);
  std::vector<int64_t> slots(B);
  std::vector<float> weights(B);
  for (int t = 0; t < steps; ++t) {
    const double beta =
        rc.beta_start() + (rc.beta_end() - rc.beta_start()) * std::min(1.0, double{1.0} * t / rc.beta_anneal_steps());
    replay.Sample(B, config.seed(), t, beta, slots.data(), weights.data());
    for (int b = 0; b < B; ++b) {
      for (int d = 0; d < spec.obs_dim; ++d) {
        batch.obs(d, b) = replay.obs(slots[b])[d];
        batch.obs(d, B + b) = replay.next_obs(slots[b])[d];
      }
      for (int br = 0; br < spec.num_branches(); ++br)
        batch.actions[b * spec.num_branches() + br] = replay.actions(slots[b])[br];
      batch.rewards[b] = replay.reward(slots[b]);
      batch.discounts[b] = replay.discount(slots[b]);
      batch.weights[b] = weights[b];
    }
    const auto& blend = config.loss().mse_blend();
    const double alpha =
        blend.start() + (double{blend.end()} - blend.start()) *
                            (blend.steps() == 0 ? 1.0 : std::min(1.0, double{1.0} * t / blend.steps()));
    cpu::LossResult<double> r;
    loss.Compute(online.data(), target.data(), batch, &r, {config.loss().label_smoothing(), alpha});
    double norm = 0;
    for (double g : r.grads) norm += g * g;
    norm = std::sqrt(norm);
    const double scale = std::min(1.0, oc.clip_grad_norm() / (norm + 1e-6));
    const double lr = oc.lr_decay_steps() == 0
                          ? double{oc.lr()}
                          : oc.lr() + (double{oc.lr_end()} - oc.lr()) *
                                          std::min(1.0, double{1.0} * t / oc.lr_decay_steps());
    for (int64_t i = 0; i < spec.num_params; ++i) {
      const double g = r.grads[i] * scale;
      m[i] = oc.beta1() * m[i] + (1 - oc.beta1()) * g;
      v[i] = oc.beta2() * v[i] + (1 - oc.beta2()) * g * g;
      online[i] -= lr * (m[i] / (1 - std::pow(oc.beta1(), t + 1))) /
                   (std::sqrt(v[i] / (1 - std::pow(oc.beta2(), t + 1))) + oc.epsilon());
    }
    if (oc.target_update_period() > 0) {
      if ((t + 1) % oc.target_update_period() == 0) target = online;
    } else {
      for (int64_t i = 0; i < spec.num_params; ++i) target[i] += oc.target_tau() * (online[i] - target[i]);
    }
    std::vector<float> item_ce(r.item_ce.begin(), r.item_ce.end());
    replay.UpdatePriorities(B, slots.data(), item_ce.data(), rc.priority_epsilon(), rc.alpha());

    ASSERT_TRUE(backend->Step().ok());
    const StepStats s = backend->last_stats();
    EXPECT_NEAR(s.loss, r.loss, 1e-5 * r.loss) << "step " << t;
    EXPECT_NEAR(s.grad_norm, norm, 1e-4 * norm) << "step " << t;
    EXPECT_NEAR(s.target_clip_fraction, r.target_clip_fraction, 1e-5) << "step " << t;
  }
  const auto params = backend->GetParams();
  double max_diff = 0;
  for (int64_t i = 0; i < spec.num_params; ++i) max_diff = std::max(max_diff, std::fabs(params[i] - online[i]));
  // Each Adam step moves a parameter by about lr; float vs double differ far less.
  EXPECT_LT(max_diff, 0.02 * oc.lr());
}

TEST(CpuBackendTest, StepMatchesDoublePrecisionReferenceWithEmaTarget) {
  auto config = TestConfig();
  config.mutable_optimizer()->set_target_tau(0.3f);  // large, so target errors show in the loss
  config.mutable_optimizer()->set_clip_grad_norm(0.05f);
  CheckAgainstReference(config, 6);
}

TEST(CpuBackendTest, StepMatchesDoublePrecisionReferenceWithPeriodicTarget) {
  auto config = TestConfig();
  config.mutable_optimizer()->set_target_update_period(2);
  config.mutable_optimizer()->set_lr(0.01f);
  config.mutable_replay()->set_beta_anneal_steps(0);
  CheckAgainstReference(config, 6);
}

TEST(CpuBackendTest, StepMatchesDoublePrecisionReferenceWithLossOptions) {
  auto config = TestConfig();
  config.mutable_loss()->set_label_smoothing(0.1f);
  config.mutable_loss()->mutable_mse_blend()->set_start(1.0f);
  config.mutable_loss()->mutable_mse_blend()->set_end(0.0f);
  config.mutable_loss()->mutable_mse_blend()->set_steps(4);
  CheckAgainstReference(config, 7);
}

TEST(CpuBackendTest, StepMatchesDoublePrecisionReferenceWithLrSchedule) {
  auto config = TestConfig();
  config.mutable_optimizer()->set_lr(0.01f);
  config.mutable_optimizer()->set_lr_end(0.001f);
  config.mutable_optimizer()->set_lr_decay_steps(4);
  CheckAgainstReference(config, 7);
}

// Step t under optimizer.lr_decay_steps is the step of a backend with the
// constant lr = LearningRate(t), bit for bit; a neighbouring lr is not.
TEST(CpuBackendTest, LearningRateFollowsTheScheduleStepByStep) {
  auto config = TestConfig();
  config.mutable_optimizer()->set_lr(0.02f);
  config.mutable_optimizer()->set_lr_end(0.002f);
  config.mutable_optimizer()->set_lr_decay_steps(5);
  auto scheduled = Make(config);
  ASSERT_TRUE(scheduled->Insert(RandomItems(scheduled->spec(), 60, 7)).ok());
  for (int64_t t = 0; t < 8; ++t) {
    BackendState before;
    ASSERT_TRUE(scheduled->SaveState(true, &before).ok());
    const float lr = step::LearningRate(0.02f, 0.002f, 5, t);
    EXPECT_NEAR(lr, 0.02 + (0.002 - 0.02) * std::min(1.0, t / 5.0), 1e-8) << "step " << t;
    auto fixed_config = config;
    fixed_config.mutable_optimizer()->set_lr(lr);
    fixed_config.mutable_optimizer()->set_lr_decay_steps(0);
    auto fixed = Make(fixed_config);
    ASSERT_TRUE(fixed->LoadState(before, StateParts::kAll).ok());
    ASSERT_TRUE(scheduled->Step().ok());
    ASSERT_TRUE(fixed->Step().ok());
    EXPECT_EQ(fixed->GetParams(), scheduled->GetParams()) << "step " << t << ", lr " << lr;
    auto other_config = fixed_config;
    other_config.mutable_optimizer()->set_lr(lr * 1.5f);
    auto other = Make(other_config);
    ASSERT_TRUE(other->LoadState(before, StateParts::kAll).ok());
    ASSERT_TRUE(other->Step().ok());
    EXPECT_NE(other->GetParams(), scheduled->GetParams()) << "step " << t;
  }
}

// Step t of a schedule is the step of a backend whose alpha is the constant
// alpha(t): the state before step t, loaded into a backend configured with
// mse_blend {start: a end: a} (a = alpha(t)), takes the same step bit for bit,
// and one configured with a neighbouring alpha does not.
TEST(CpuBackendTest, MseBlendFollowsTheScheduleStepByStep) {
  auto config = TestConfig();
  config.mutable_loss()->set_label_smoothing(0.05f);
  auto* blend = config.mutable_loss()->mutable_mse_blend();
  blend->set_start(0.9f);
  blend->set_end(0.1f);
  blend->set_steps(6);
  auto scheduled = Make(config);
  ASSERT_TRUE(scheduled->Insert(RandomItems(scheduled->spec(), 60, 5)).ok());
  for (int64_t t = 0; t < 9; ++t) {
    BackendState before;
    ASSERT_TRUE(scheduled->SaveState(true, &before).ok());
    const float alpha = step::MseBlendAlpha(0.9f, 0.1f, 6, t);
    EXPECT_NEAR(alpha, 0.9 + (0.1 - 0.9) * std::min(1.0, t / 6.0), 1e-6) << "step " << t;
    auto fixed_config = config;
    fixed_config.mutable_loss()->mutable_mse_blend()->set_start(alpha);
    fixed_config.mutable_loss()->mutable_mse_blend()->set_end(alpha);
    auto fixed = Make(fixed_config);
    ASSERT_TRUE(fixed->LoadState(before, StateParts::kAll).ok());
    ASSERT_TRUE(scheduled->Step().ok());
    ASSERT_TRUE(fixed->Step().ok());
    EXPECT_EQ(fixed->GetParams(), scheduled->GetParams()) << "step " << t << ", alpha " << alpha;
    EXPECT_EQ(fixed->last_stats().loss, scheduled->last_stats().loss) << "step " << t;
    // A neighbouring alpha gives another step: the comparison can fail.
    auto other_config = fixed_config;
    other_config.mutable_loss()->mutable_mse_blend()->set_start(alpha + 0.05f);
    other_config.mutable_loss()->mutable_mse_blend()->set_end(alpha + 0.05f);
    auto other = Make(other_config);
    ASSERT_TRUE(other->LoadState(before, StateParts::kAll).ok());
    ASSERT_TRUE(other->Step().ok());
    EXPECT_NE(other->last_stats().loss, scheduled->last_stats().loss) << "step " << t;
  }
}

// Guard: a poisoned step changes no weight (bitwise) and counts its reason.
void ExpectSkipped(const v1::TrainerConfig& config, const TransitionColumns& items, GuardReason reason) {
  auto backend = Make(config);
  ASSERT_TRUE(backend->Insert(items).ok());
  const auto before = backend->GetParams();
  ASSERT_TRUE(backend->Step().ok());
  EXPECT_EQ(backend->last_stats().guard, reason);
  EXPECT_EQ(backend->steps(), 1);
  const auto after = backend->GetParams();
  ASSERT_EQ(after.size(), before.size());
  EXPECT_EQ(0, std::memcmp(after.data(), before.data(), after.size() * sizeof(float)));
  auto expected = std::vector<int64_t>(kNumGuardReasons, 0);
  expected[static_cast<int>(reason)] = 1;
  EXPECT_EQ(backend->guard_trips(), expected);
}

TEST(CpuBackendGuardTest, NanObservationSkipsTheUpdate) {
  const auto config = TestConfig();
  auto items = RandomItems(*NetworkSpec::Create(config.network()), 8, 6);
  for (size_t i = 0; i < items.obs.size(); i += 4) items.obs[i] = std::nanf("");
  ExpectSkipped(config, items, GuardReason::kNonFiniteLoss);
}

TEST(CpuBackendGuardTest, NanNextObservationSkipsTheUpdate) {
  const auto config = TestConfig();
  auto items = RandomItems(*NetworkSpec::Create(config.network()), 8, 6);
  for (size_t i = 0; i < items.next_obs.size(); i += 4) items.next_obs[i] = std::nanf("");
  ExpectSkipped(config, items, GuardReason::kNonFiniteLoss);
}

TEST(CpuBackendGuardTest, NanRewardSkipsTheUpdate) {
  const auto config = TestConfig();
  auto items = RandomItems(*NetworkSpec::Create(config.network()), 8, 6);
  for (float& r : items.rewards) r = std::nanf("");
  ExpectSkipped(config, items, GuardReason::kNonFiniteLoss);
}

TEST(CpuBackendGuardTest, LargeGradientNormSkipsTheUpdate) {
  auto config = TestConfig();
  config.mutable_guard()->set_max_grad_norm(1e-6f);
  ExpectSkipped(config, RandomItems(*NetworkSpec::Create(config.network()), 8, 7), GuardReason::kGradNorm);
}

TEST(CpuBackendGuardTest, QOutOfRangeSkipsTheUpdate) {
  auto config = TestConfig();
  config.mutable_guard()->set_max_abs_q(1e-6f);
  ExpectSkipped(config, RandomItems(*NetworkSpec::Create(config.network()), 8, 8), GuardReason::kQRange);
}

// Adam's step count k counts applied updates only: a tripped step followed by
// a good one equals a single good step on a fresh backend.
TEST(CpuBackendGuardTest, TrippedStepDoesNotAdvanceAdam) {
  auto config = TestConfig();
  config.mutable_replay()->set_capacity(1);
  const NetworkSpec spec = *NetworkSpec::Create(config.network());
  auto poisoned = RandomItems(spec, 1, 9);
  poisoned.obs[0] = std::nanf("");
  const auto good = RandomItems(spec, 1, 10);

  auto tripped = Make(config);
  ASSERT_TRUE(tripped->Insert(poisoned).ok());
  ASSERT_TRUE(tripped->Step().ok());
  ASSERT_EQ(tripped->last_stats().guard, GuardReason::kNonFiniteLoss);
  ASSERT_TRUE(tripped->Insert(good).ok());
  ASSERT_TRUE(tripped->Step().ok());
  ASSERT_EQ(tripped->last_stats().guard, GuardReason::kNone);

  auto fresh = Make(config);
  ASSERT_TRUE(fresh->Insert(good).ok());
  ASSERT_TRUE(fresh->Step().ok());
  EXPECT_EQ(tripped->GetParams(), fresh->GetParams());
}

// Runs `steps` steps with an insert of fresh items every 7th, the same
// schedule for a given `first` step so two backends can be compared.
void RunSchedule(Backend* b, int64_t first, int steps) {
  for (int64_t t = first; t < first + steps; ++t) {
    if (t % 7 == 0) {
      ASSERT_TRUE(b->Insert(RandomItems(b->spec(), 9, 1000 + static_cast<uint32_t>(t))).ok());
    }
    ASSERT_TRUE(b->Step().ok());
  }
}

void ExpectSameState(const BackendState& a, const BackendState& b) {
  EXPECT_EQ(a.steps, b.steps);
  EXPECT_EQ(a.applied_updates, b.applied_updates);
  ASSERT_EQ(a.params.size(), b.params.size());
  EXPECT_EQ(0, std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.target.data(), b.target.data(), a.target.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.adam_m.data(), b.adam_m.data(), a.adam_m.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.adam_v.data(), b.adam_v.data(), a.adam_v.size() * sizeof(float)));
  EXPECT_EQ(a.guard_trips, b.guard_trips);
  EXPECT_EQ(a.replay.size, b.replay.size);
  EXPECT_EQ(a.replay.cursor, b.replay.cursor);
  EXPECT_EQ(a.replay.max_priority, b.replay.max_priority);
  EXPECT_EQ(a.replay.priorities, b.replay.priorities);
  EXPECT_EQ(a.replay.rows.obs, b.replay.rows.obs);
  EXPECT_EQ(a.replay.rows.actions, b.replay.rows.actions);
}

// The state saved after 100 steps, loaded into a fresh backend, takes the
// next 100 steps bit for bit as the uninterrupted backend does (the ring
// wraps in between: capacity 128, ~260 inserted items).
TEST(CpuBackendTest, SaveLoadStateContinuesBitwise) {
  const v1::TrainerConfig config = TestConfig();
  auto a = Make(config);
  ASSERT_TRUE(a->Insert(RandomItems(a->spec(), 100, 5)).ok());
  RunSchedule(a.get(), 0, 100);
  BackendState saved;
  ASSERT_TRUE(a->SaveState(/*include_replay=*/true, &saved).ok());
  EXPECT_EQ(saved.steps, 100);
  EXPECT_TRUE(saved.has_replay);

  auto b = Make(config);
  ASSERT_TRUE(b->LoadState(saved, StateParts::kAll).ok());
  EXPECT_EQ(b->steps(), 100);
  EXPECT_EQ(b->replay_size(), a->replay_size());
  RunSchedule(a.get(), 100, 100);
  RunSchedule(b.get(), 100, 100);
  BackendState sa, sb;
  ASSERT_TRUE(a->SaveState(true, &sa).ok());
  ASSERT_TRUE(b->SaveState(true, &sb).ok());
  ExpectSameState(sa, sb);
}

// The same with the loss options mid-schedule at the save: the restored
// backend continues the alpha schedule from the restored step count.
TEST(CpuBackendTest, SaveLoadStateContinuesBitwiseWithLossOptions) {
  v1::TrainerConfig config = TestConfig();
  config.mutable_loss()->set_label_smoothing(0.1f);
  config.mutable_loss()->mutable_mse_blend()->set_start(1.0f);
  config.mutable_loss()->mutable_mse_blend()->set_steps(150);
  auto a = Make(config);
  ASSERT_TRUE(a->Insert(RandomItems(a->spec(), 100, 5)).ok());
  RunSchedule(a.get(), 0, 100);
  BackendState saved;
  ASSERT_TRUE(a->SaveState(/*include_replay=*/true, &saved).ok());
  auto b = Make(config);
  ASSERT_TRUE(b->LoadState(saved, StateParts::kAll).ok());
  RunSchedule(a.get(), 100, 100);
  RunSchedule(b.get(), 100, 100);
  BackendState sa, sb;
  ASSERT_TRUE(a->SaveState(true, &sa).ok());
  ASSERT_TRUE(b->SaveState(true, &sb).ok());
  ExpectSameState(sa, sb);
}

TEST(CpuBackendTest, LoadStateRejectsWrongShapes) {
  auto a = Make(TestConfig());
  ASSERT_TRUE(a->Insert(RandomItems(a->spec(), 20, 5)).ok());
  BackendState s;
  ASSERT_TRUE(a->SaveState(true, &s).ok());
  BackendState bad = s;
  bad.adam_v.pop_back();
  auto st = a->LoadState(bad, StateParts::kAll);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("adam_v"), std::string::npos) << st;
  bad = s;
  bad.replay.rows.actions[1] = 7;  // branch 1 has 2 actions
  st = a->LoadState(bad, StateParts::kAll);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  bad = s;
  bad.replay.priorities[3] = std::nanf("");
  st = a->LoadState(bad, StateParts::kAll);
  EXPECT_NE(st.message().find("priorities[3]"), std::string::npos) << st;
}

// A replay saved with another capacity keeps its newest items, oldest first.
TEST(CpuBackendTest, LoadStateResizesTheReplay) {
  v1::TrainerConfig big = TestConfig();
  auto a = Make(big);
  TransitionColumns items = RandomItems(a->spec(), 150, 9);  // wraps the 128 ring
  ASSERT_TRUE(a->Insert(items).ok());
  BackendState s;
  ASSERT_TRUE(a->SaveState(true, &s).ok());
  v1::TrainerConfig small = big;
  small.mutable_replay()->set_capacity(50);
  auto b = Make(small);
  ASSERT_TRUE(b->LoadState(s, StateParts::kAll).ok());
  EXPECT_EQ(b->replay_size(), 50);
  BackendState t;
  ASSERT_TRUE(b->SaveState(true, &t).ok());
  for (int i = 0; i < 50; ++i) EXPECT_EQ(t.replay.rows.rewards[i], items.rewards[100 + i]) << i;
  EXPECT_EQ(t.replay.cursor, 0);
}

// kNetwork replaces weights and optimizer only: the replay and step count stay.
TEST(CpuBackendTest, LoadNetworkKeepsReplayAndSteps) {
  auto a = Make(TestConfig());
  ASSERT_TRUE(a->Insert(RandomItems(a->spec(), 40, 5)).ok());
  BackendState early;
  ASSERT_TRUE(a->SaveState(false, &early).ok());
  RunSchedule(a.get(), 0, 20);
  ASSERT_TRUE(a->LoadState(early, StateParts::kNetwork).ok());
  EXPECT_EQ(a->steps(), 20);
  EXPECT_EQ(a->replay_size(), 40 + 9 * 3);
  EXPECT_EQ(a->GetParams(), early.params);
}

}  // namespace
}  // namespace qstream
