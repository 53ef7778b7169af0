// Columnar n-step transitions as they enter the replay.
#pragma once

#include <cstdint>
#include <vector>

namespace qstream {

// n transitions; every column has n rows. The bootstrap factor `discount` is
// gamma^k * (1 - terminal) for a k-step return, so the target support is
// Tz = reward + discount * z.
struct TransitionColumns {
  int64_t n = 0;
  int obs_dim = 0;
  int num_branches = 0;
  std::vector<float> obs;        // n x obs_dim
  std::vector<float> next_obs;   // n x obs_dim
  std::vector<int32_t> actions;  // n x num_branches
  std::vector<float> rewards;    // n
  std::vector<float> discounts;  // n

  void Reserve(int64_t rows) {
    obs.reserve(rows * obs_dim);
    next_obs.reserve(rows * obs_dim);
    actions.reserve(rows * num_branches);
    rewards.reserve(rows);
    discounts.reserve(rows);
  }
};

}  // namespace qstream
