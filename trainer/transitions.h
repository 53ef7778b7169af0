// Columnar n-step transitions as they enter the replay.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

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

// Checks a batch against the network shape: column lengths, obs_dim, branch
// count and, when branch_actions is not empty (one entry per branch), every
// action in range. The error names the column ("transitions.actions: ...").
absl::Status CheckTransitionColumns(const TransitionColumns& batch, int obs_dim, int num_branches,
                                    const std::vector<int>& branch_actions = {});

}  // namespace qstream
