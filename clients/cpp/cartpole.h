// CartPole: the classic-control cart-pole balancing task with the physics,
// constants, start distribution and termination rule of gymnasium's
// CartPole-v1 (Euler integration, reward 1 per step including the terminal
// one, time limit 500 steps).
#pragma once

#include <cstdint>
#include <random>

#include "clients/cpp/env.h"

namespace qstream::actor {

class CartPole final : public Env {
 public:
  struct State {
    double x = 0;
    double x_dot = 0;
    double theta = 0;
    double theta_dot = 0;
  };

  static constexpr double kGravity = 9.8;
  static constexpr double kMassCart = 1.0;
  static constexpr double kMassPole = 0.1;
  static constexpr double kTotalMass = kMassCart + kMassPole;
  static constexpr double kHalfPoleLength = 0.5;
  static constexpr double kPoleMassLength = kMassPole * kHalfPoleLength;
  static constexpr double kForceMag = 10.0;
  static constexpr double kTau = 0.02;  // seconds per step
  static constexpr double kThetaThresholdRadians = 12 * 2 * 3.14159265358979323846 / 360;
  static constexpr double kXThreshold = 2.4;
  static constexpr double kResetBound = 0.05;  // start state ~ U(-0.05, 0.05)^4
  static constexpr int kMaxEpisodeSteps = 500;

  explicit CartPole(uint64_t seed);

  std::string name() const override { return "CartPole"; }
  int obs_dim() const override { return 4; }
  int num_actions() const override { return 2; }
  int max_episode_steps() const override { return kMaxEpisodeSteps; }
  void Reset(std::span<float> obs) override;
  StepResult Step(int action, std::span<float> obs) override;

  const State& state() const { return state_; }
  // For tests: continue the current episode from `state`.
  void set_state(const State& state) { state_ = state; }
  int elapsed_steps() const { return elapsed_steps_; }

 private:
  void WriteObs(std::span<float> obs) const;

  std::mt19937_64 rng_;
  State state_;
  int elapsed_steps_ = 0;
};

}  // namespace qstream::actor
