#include "trainer/cpu/cpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/step_constants.h"
#include "trainer/config.h"
#include "trainer/cpu/c51_loss.h"
#include "trainer/cpu/forward.h"
#include "trainer/cpu/optimizer.h"
#include "trainer/cpu/replay.h"

namespace qstream {
namespace {

// Step times kept for DrainStepTimes when nobody drains (bench, tests).
constexpr size_t kMaxUndrainedStepTimes = size_t{1} << 16;

cpu::AlignedVector<float> ToAligned(const std::vector<float>& v) {
  return cpu::AlignedVector<float>(v.begin(), v.end());
}

class CpuBackend : public Backend {
 public:
  CpuBackend(const v1::TrainerConfig& config, NetworkSpec spec)
      : config_(config),
        spec_(std::move(spec)),
        batch_size_(config.replay().batch_size()),
        q_bound_(step::QBound(config.guard().max_abs_q(), spec_.v_min, spec_.v_max)),
        replay_(config.replay().capacity(), spec_.obs_dim, spec_.num_branches()),
        params_(ToAligned(InitParams(spec_, config.seed()))),
        target_(params_),
        adam_m_(spec_.num_params, 0.0f),
        adam_v_(spec_.num_params, 0.0f),
        loss_(spec_),
        slots_(batch_size_),
        guard_trips_(kNumGuardReasons, 0) {
    batch_.Resize(spec_, batch_size_);
  }

  std::string name() const override { return "cpu"; }
  std::string device() const override { return "cpu (Eigen, 1 thread)"; }
  const NetworkSpec& spec() const override { return spec_; }

  absl::Status Insert(const TransitionColumns& batch) override {
    absl::MutexLock lock(&mu_);
    if (auto st = CheckTransitionColumns(batch, spec_.obs_dim, spec_.num_branches(), spec_.branch_actions); !st.ok()) return st;
    replay_.Insert(batch);
    return absl::OkStatus();
  }

  int64_t replay_size() const override {
    absl::MutexLock lock(&mu_);
    return replay_.size();
  }
  int64_t replay_capacity() const override { return config_.replay().capacity(); }
  int64_t steps() const override {
    absl::MutexLock lock(&mu_);
    return steps_;
  }

  absl::Status Step() override;

  StepStats last_stats() override {
    absl::MutexLock lock(&stats_mu_);
    return last_stats_;
  }
  std::vector<int64_t> guard_trips() override {
    absl::MutexLock lock(&stats_mu_);
    return guard_trips_;
  }
  void DrainStepTimes(std::vector<std::pair<double, int64_t>>* out) override {
    absl::MutexLock lock(&stats_mu_);
    out->insert(out->end(), step_times_.begin(), step_times_.end());
    step_times_.clear();
  }

  std::vector<float> GetParams() override {
    absl::MutexLock lock(&mu_);
    return std::vector<float>(params_.begin(), params_.end());
  }
  // Sets the online and the target network (a restore starts from equal
  // networks); the Adam moments are kept.
  absl::Status SetParams(const std::vector<float>& params) override {
    if (static_cast<int64_t>(params.size()) != spec_.num_params) {
      return absl::InvalidArgumentError(
          absl::StrCat("params: ", params.size(), " values, network has ", spec_.num_params));
    }
    absl::MutexLock lock(&mu_);
    params_ = ToAligned(params);
    target_ = params_;
    return absl::OkStatus();
  }
  absl::Status SaveState(bool include_replay, BackendState* out) override;
  absl::Status LoadState(const BackendState& state, StateParts parts) override;

 private:
  double Beta(int64_t t) const;
  cpu::LossOptions<float> LossOptions(int64_t t) const;
  void Gather() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  GuardReason CheckGuard(float loss, float grad_norm) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateTarget(int64_t t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordStats(int64_t t, float grad_norm, GuardReason guard, double seconds) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const v1::TrainerConfig config_;
  const NetworkSpec spec_;
  const int batch_size_;
  const float q_bound_;

  // Learner state: touched by Step() and the accessors above.
  mutable absl::Mutex mu_;
  cpu::PrioritizedReplay replay_ ABSL_GUARDED_BY(mu_);
  cpu::AlignedVector<float> params_ ABSL_GUARDED_BY(mu_);  // online, flat layout of NetworkSpec
  cpu::AlignedVector<float> target_ ABSL_GUARDED_BY(mu_);
  cpu::AlignedVector<float> adam_m_ ABSL_GUARDED_BY(mu_);
  cpu::AlignedVector<float> adam_v_ ABSL_GUARDED_BY(mu_);
  int64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t applied_updates_ ABSL_GUARDED_BY(mu_) = 0;
  cpu::C51Loss<float> loss_ ABSL_GUARDED_BY(mu_);
  cpu::LossBatch<float> batch_ ABSL_GUARDED_BY(mu_);
  cpu::LossResult<float> result_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> slots_ ABSL_GUARDED_BY(mu_);

  // Read by other threads (metrics) while a step runs.
  absl::Mutex stats_mu_;
  StepStats last_stats_ ABSL_GUARDED_BY(stats_mu_);
  std::vector<int64_t> guard_trips_ ABSL_GUARDED_BY(stats_mu_);  // index = GuardReason; [kNone] stays 0
  int64_t consecutive_trips_ ABSL_GUARDED_BY(stats_mu_) = 0;
  std::vector<std::pair<double, int64_t>> step_times_ ABSL_GUARDED_BY(stats_mu_);
};

// The learner step of trainer/backend.h, one line per stage of DESIGN.md.
absl::Status CpuBackend::Step() {
  const auto start = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  if (replay_.size() == 0) return absl::FailedPreconditionError("cpu backend: replay is empty");
  const int64_t t = steps_;
  const auto& opt = config_.optimizer();
  const auto& rep = config_.replay();

  // 1. Sample B slots stratified over priorities^alpha; IS weights with annealed beta.
  replay_.Sample(batch_size_, config_.seed(), t, Beta(t), slots_.data(), batch_.weights.data());
  // 2. Gather s, a, R, discount, s'.
  Gather();
  // 3-8. Forward online(s, s') and target(s'), dueling softmax, double DQN,
  //      projection (+ label smoothing), IS-weighted CE (blended with the MSE
  //      term by this step's alpha), backward (trainer/cpu/c51_loss.h).
  loss_.Compute(params_.data(), target_.data(), batch_, &result_, LossOptions(t));
  // 9. Guard: non-finite loss or gradient, gradient norm, Q range.
  const float grad_norm = static_cast<float>(cpu::GlobalNorm(result_.grads.data(), spec_.num_params));
  const GuardReason guard = CheckGuard(result_.loss, grad_norm);
  // 10. Clip by global norm and Adam (skipped on a trip); target update every step.
  if (guard == GuardReason::kNone) {
    ++applied_updates_;
    cpu::AdamUpdate({step::LearningRate(opt.lr(), opt.lr_end(), opt.lr_decay_steps(), t), opt.beta1(),
                     opt.beta2(), opt.epsilon()},
                    applied_updates_, cpu::ClipScale(grad_norm, opt.clip_grad_norm()), result_.grads.data(),
                    adam_m_.data(), adam_v_.data(), params_.data(), spec_.num_params);
  }
  UpdateTarget(t);
  // 11. Write new priorities (CE_b + eps)^alpha back (skipped on a trip).
  if (guard == GuardReason::kNone) {
    replay_.UpdatePriorities(batch_size_, slots_.data(), result_.item_ce.data(), rep.priority_epsilon(),
                             rep.alpha());
  }
  steps_ = t + 1;
  RecordStats(t, grad_norm, guard,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return absl::OkStatus();
}

cpu::LossOptions<float> CpuBackend::LossOptions(int64_t t) const {
  const auto& loss = config_.loss();
  const auto& blend = loss.mse_blend();
  cpu::LossOptions<float> options;
  options.label_smoothing = loss.label_smoothing();
  options.mse_alpha = step::MseBlendAlpha(blend.start(), blend.end(), blend.steps(), t);
  return options;
}

double CpuBackend::Beta(int64_t t) const {
  const auto& r = config_.replay();
  if (r.beta_anneal_steps() == 0) return r.beta_end();
  const double progress = std::min(1.0, static_cast<double>(t) / static_cast<double>(r.beta_anneal_steps()));
  return r.beta_start() + (r.beta_end() - r.beta_start()) * progress;
}

void CpuBackend::Gather() {
  const int B = batch_size_;
  const int dim = spec_.obs_dim;
  const int branches = spec_.num_branches();
  for (int b = 0; b < B; ++b) {
    const int64_t slot = slots_[b];
    std::copy_n(replay_.obs(slot), dim, batch_.obs.col(b).data());
    std::copy_n(replay_.next_obs(slot), dim, batch_.obs.col(B + b).data());
    std::copy_n(replay_.actions(slot), branches, &batch_.actions[b * branches]);
    batch_.rewards[b] = replay_.reward(slot);
    batch_.discounts[b] = replay_.discount(slot);
  }
}

GuardReason CpuBackend::CheckGuard(float loss, float grad_norm) const {
  if (!std::isfinite(loss)) return GuardReason::kNonFiniteLoss;
  if (!std::isfinite(grad_norm)) return GuardReason::kNonFiniteGrad;
  const float max_norm = config_.guard().max_grad_norm();
  if (max_norm > 0 && grad_norm > max_norm) return GuardReason::kGradNorm;
  const auto q = loss_.online_q().leftCols(batch_size_);
  if (!q.allFinite() || q.cwiseAbs().maxCoeff() > q_bound_) return GuardReason::kQRange;
  return GuardReason::kNone;
}

void CpuBackend::UpdateTarget(int64_t t) {
  const int period = config_.optimizer().target_update_period();
  if (period > 0) {
    if ((t + 1) % period == 0) target_ = params_;
  } else {
    cpu::EmaUpdate(config_.optimizer().target_tau(), params_.data(), target_.data(), spec_.num_params);
  }
}

void CpuBackend::RecordStats(int64_t t, float grad_norm, GuardReason guard, double seconds) {
  const auto q = loss_.online_q().leftCols(batch_size_);
  StepStats s;
  s.step = t + 1;
  s.loss = result_.loss;
  s.grad_norm = grad_norm;
  s.q_min = q.minCoeff();
  s.q_mean = q.mean();
  s.q_max = q.maxCoeff();
  s.target_clip_fraction = result_.target_clip_fraction;
  s.guard = guard;
  absl::MutexLock lock(&stats_mu_);
  if (guard != GuardReason::kNone) {
    ++guard_trips_[static_cast<int>(guard)];
    ++consecutive_trips_;
  } else {
    consecutive_trips_ = 0;
  }
  s.consecutive_trips = consecutive_trips_;
  last_stats_ = s;
  if (step_times_.size() < kMaxUndrainedStepTimes) step_times_.emplace_back(seconds, 1);
}

absl::Status CpuBackend::SaveState(bool include_replay, BackendState* out) {
  absl::MutexLock lock(&mu_);
  out->steps = steps_;
  out->applied_updates = applied_updates_;
  out->params.assign(params_.begin(), params_.end());
  out->target.assign(target_.begin(), target_.end());
  out->adam_m.assign(adam_m_.begin(), adam_m_.end());
  out->adam_v.assign(adam_v_.begin(), adam_v_.end());
  {
    absl::MutexLock stats_lock(&stats_mu_);
    out->guard_trips = guard_trips_;
    out->consecutive_trips = consecutive_trips_;
  }
  out->has_replay = include_replay;
  out->replay = ReplayState{};
  if (include_replay) replay_.Save(&out->replay);
  return absl::OkStatus();
}

absl::Status CpuBackend::LoadState(const BackendState& state, StateParts parts) {
  if (absl::Status st = CheckNetworkState(state, spec_.num_params); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  if (parts == StateParts::kAll) {
    if (state.has_replay) {
      const ReplayState resized = ResizeReplayState(state.replay, replay_.capacity());
      if (auto st = CheckReplayState(resized, spec_); !st.ok()) return st;
      if (auto st = replay_.Load(resized); !st.ok()) return st;
    } else {
      ReplayState empty;
      empty.capacity = replay_.capacity();
      empty.rows.obs_dim = spec_.obs_dim;
      empty.rows.num_branches = spec_.num_branches();
      if (auto st = replay_.Load(empty); !st.ok()) return st;
    }
    steps_ = state.steps;
    absl::MutexLock stats_lock(&stats_mu_);
    guard_trips_ = state.guard_trips;
    guard_trips_.resize(kNumGuardReasons, 0);
    consecutive_trips_ = state.consecutive_trips;
    last_stats_ = StepStats{};
    last_stats_.step = state.steps;
    last_stats_.consecutive_trips = state.consecutive_trips;
  } else {
    absl::MutexLock stats_lock(&stats_mu_);
    consecutive_trips_ = 0;
  }
  params_ = ToAligned(state.params);
  target_ = ToAligned(state.target);
  adam_m_ = ToAligned(state.adam_m);
  adam_v_ = ToAligned(state.adam_v);
  applied_updates_ = state.applied_updates;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const v1::TrainerConfig& config) {
  if (auto st = ValidateConfig(config); !st.ok()) return st;
  auto spec = NetworkSpec::Create(config.network());
  if (!spec.ok()) return spec.status();
  return std::unique_ptr<Backend>(new CpuBackend(config, *std::move(spec)));
}

}  // namespace qstream
