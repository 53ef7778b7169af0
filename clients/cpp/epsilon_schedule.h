// Linearly decaying exploration rate: start at step 0, end after
// decay_steps environment steps, constant afterwards.
#pragma once

#include <algorithm>
#include <cstdint>

namespace qstream::actor {

struct EpsilonSchedule {
  double start = 1.0;
  double end = 0.01;
  int64_t decay_steps = 10000;

  double At(int64_t env_steps) const {
    if (decay_steps <= 0) return end;
    const double remaining =
        1.0 - std::min(1.0, static_cast<double>(env_steps) / static_cast<double>(decay_steps));
    return end + (start - end) * remaining;
  }
};

}  // namespace qstream::actor
