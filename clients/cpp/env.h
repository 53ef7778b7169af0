// Env: a single-agent environment with a float observation and one discrete
// action branch, stepped by the actor. Episodes end by termination (a
// terminal state: no bootstrap) or truncation (time limit: bootstrap from
// the last observation); the two are reported separately.
#pragma once

#include <span>
#include <string>

namespace qstream::actor {

struct StepResult {
  float reward = 0;
  bool terminated = false;
  bool truncated = false;
};

class Env {
 public:
  virtual ~Env() = default;

  virtual std::string name() const = 0;
  virtual int obs_dim() const = 0;
  virtual int num_actions() const = 0;
  // Time limit; the step that reaches it reports truncated.
  virtual int max_episode_steps() const = 0;

  // Starts a new episode and writes its first observation (obs_dim floats).
  virtual void Reset(std::span<float> obs) = 0;
  // Applies `action` (0 <= action < num_actions) and writes the next
  // observation. Stepping after an episode ended without Reset is undefined.
  virtual StepResult Step(int action, std::span<float> obs) = 0;
};

}  // namespace qstream::actor
