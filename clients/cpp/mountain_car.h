// MountainCar: gymnasium's MountainCar-v0 (discrete push left / none / right,
// reward -1 per step, terminal at the flag, time limit 200 steps).
#pragma once

#include <cstdint>
#include <random>

#include "clients/cpp/env.h"

namespace qstream::actor {

class MountainCar final : public Env {
 public:
  struct State {
    double position = 0;
    double velocity = 0;
  };

  static constexpr double kMinPosition = -1.2;
  static constexpr double kMaxPosition = 0.6;
  static constexpr double kMaxSpeed = 0.07;
  static constexpr double kGoalPosition = 0.5;
  static constexpr double kGoalVelocity = 0;
  static constexpr double kForce = 0.001;
  static constexpr double kGravity = 0.0025;
  static constexpr double kResetLow = -0.6;  // start position ~ U(-0.6, -0.4), velocity 0
  static constexpr double kResetHigh = -0.4;
  static constexpr int kMaxEpisodeSteps = 200;

  explicit MountainCar(uint64_t seed);

  std::string name() const override { return "MountainCar"; }
  int obs_dim() const override { return 2; }
  int num_actions() const override { return 3; }
  int max_episode_steps() const override { return kMaxEpisodeSteps; }
  void Reset(std::span<float> obs) override;
  StepResult Step(int action, std::span<float> obs) override;

  const State& state() const { return state_; }
  void set_state(const State& state) { state_ = state; }
  int elapsed_steps() const { return elapsed_steps_; }

 private:
  void WriteObs(std::span<float> obs) const;

  std::mt19937_64 rng_;
  State state_;
  int elapsed_steps_ = 0;
};

}  // namespace qstream::actor
