#include "clients/cpp/mountain_car.h"

#include <algorithm>
#include <cmath>

namespace qstream::actor {

MountainCar::MountainCar(uint64_t seed) : rng_(seed) {}

void MountainCar::WriteObs(std::span<float> obs) const {
  obs[0] = static_cast<float>(state_.position);
  obs[1] = static_cast<float>(state_.velocity);
}

void MountainCar::Reset(std::span<float> obs) {
  std::uniform_real_distribution<double> u(kResetLow, kResetHigh);
  state_.position = u(rng_);
  state_.velocity = 0;
  elapsed_steps_ = 0;
  WriteObs(obs);
}

StepResult MountainCar::Step(int action, std::span<float> obs) {
  double v = state_.velocity + (action - 1) * kForce + std::cos(3 * state_.position) * (-kGravity);
  v = std::clamp(v, -kMaxSpeed, kMaxSpeed);
  double p = std::clamp(state_.position + v, kMinPosition, kMaxPosition);
  // The left wall is inelastic.
  if (p == kMinPosition && v < 0) {
    v = 0;
  }
  state_.position = p;
  state_.velocity = v;
  ++elapsed_steps_;
  WriteObs(obs);

  StepResult r;
  r.reward = -1.0f;
  r.terminated = p >= kGoalPosition && v >= kGoalVelocity;
  r.truncated = elapsed_steps_ >= kMaxEpisodeSteps;
  return r;
}

}  // namespace qstream::actor
