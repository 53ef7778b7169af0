// Episode returns of all environments of an actor: running totals and
// lengths per env and the mean of the last `window` finished episodes.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

namespace qstream::actor {

class ReturnTracker {
 public:
  ReturnTracker(int num_envs, int window) : running_(num_envs, 0.0), steps_(num_envs, 0), window_(window) {}

  // One step of `env`'s episode.
  void AddReward(int env, double reward) {
    running_[env] += reward;
    ++steps_[env];
  }
  // Steps of `env`'s running episode so far.
  int64_t steps(int env) const { return steps_[env]; }

  // Closes the episode of `env` and returns its total.
  double EndEpisode(int env) {
    const double total = running_[env];
    running_[env] = 0;
    steps_[env] = 0;
    recent_.push_back(total);
    if (static_cast<int>(recent_.size()) > window_) recent_.pop_front();
    ++episodes_;
    return total;
  }

  int64_t episodes() const { return episodes_; }
  // True once `window` episodes have finished.
  bool full() const { return static_cast<int>(recent_.size()) == window_; }
  double mean() const {
    if (recent_.empty()) return 0;
    double s = 0;
    for (double r : recent_) s += r;
    return s / static_cast<double>(recent_.size());
  }

 private:
  std::vector<double> running_;
  std::vector<int64_t> steps_;
  std::deque<double> recent_;
  int window_;
  int64_t episodes_ = 0;
};

}  // namespace qstream::actor
