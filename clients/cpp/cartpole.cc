#include "clients/cpp/cartpole.h"

#include <cmath>

namespace qstream::actor {

CartPole::CartPole(uint64_t seed) : rng_(seed) {}

void CartPole::WriteObs(std::span<float> obs) const {
  obs[0] = static_cast<float>(state_.x);
  obs[1] = static_cast<float>(state_.x_dot);
  obs[2] = static_cast<float>(state_.theta);
  obs[3] = static_cast<float>(state_.theta_dot);
}

void CartPole::Reset(std::span<float> obs) {
  std::uniform_real_distribution<double> u(-kResetBound, kResetBound);
  state_.x = u(rng_);
  state_.x_dot = u(rng_);
  state_.theta = u(rng_);
  state_.theta_dot = u(rng_);
  elapsed_steps_ = 0;
  WriteObs(obs);
}

StepResult CartPole::Step(int action, std::span<float> obs) {
  const double force = action == 1 ? kForceMag : -kForceMag;
  const double cos_theta = std::cos(state_.theta);
  const double sin_theta = std::sin(state_.theta);
  // Equations of motion as in gymnasium (Florian 2007, with its sign convention).
  const double temp =
      (force + kPoleMassLength * state_.theta_dot * state_.theta_dot * sin_theta) / kTotalMass;
  const double theta_acc = (kGravity * sin_theta - cos_theta * temp) /
                           (kHalfPoleLength * (4.0 / 3.0 - kMassPole * cos_theta * cos_theta / kTotalMass));
  const double x_acc = temp - kPoleMassLength * theta_acc * cos_theta / kTotalMass;

  state_.x += kTau * state_.x_dot;
  state_.x_dot += kTau * x_acc;
  state_.theta += kTau * state_.theta_dot;
  state_.theta_dot += kTau * theta_acc;
  ++elapsed_steps_;
  WriteObs(obs);

  StepResult r;
  r.reward = 1.0f;
  r.terminated = state_.x < -kXThreshold || state_.x > kXThreshold ||
                 state_.theta < -kThetaThresholdRadians || state_.theta > kThetaThresholdRadians;
  r.truncated = elapsed_steps_ >= kMaxEpisodeSteps;
  return r;
}

}  // namespace qstream::actor
