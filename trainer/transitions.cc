#include "trainer/transitions.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace qstream {

absl::Status CheckTransitionColumns(const TransitionColumns& batch, int obs_dim, int num_branches,
                                    const std::vector<int>& branch_actions) {
  auto bad = [](const std::string& field, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("transitions.", field, ": ", why));
  };
  if (batch.n < 0) return bad("n", "must be >= 0");
  if (batch.obs_dim != obs_dim) return bad("obs_dim", absl::StrCat("is ", batch.obs_dim, ", network has ", obs_dim));
  if (batch.num_branches != num_branches) {
    return bad("num_branches", absl::StrCat("is ", batch.num_branches, ", network has ", num_branches));
  }
  const auto n = static_cast<size_t>(batch.n);
  if (batch.obs.size() != n * obs_dim) return bad("obs", "length must be n * obs_dim");
  if (batch.next_obs.size() != n * obs_dim) return bad("next_obs", "length must be n * obs_dim");
  if (batch.actions.size() != n * num_branches) return bad("actions", "length must be n * num_branches");
  if (batch.rewards.size() != n) return bad("rewards", "length must be n");
  if (batch.discounts.size() != n) return bad("discounts", "length must be n");
  if (branch_actions.empty()) return absl::OkStatus();
  for (size_t i = 0; i < n; ++i) {
    for (int br = 0; br < num_branches; ++br) {
      const int32_t a = batch.actions[i * num_branches + br];
      if (a < 0 || a >= branch_actions[br]) {
        return bad("actions", absl::StrCat("item ", i, " branch ", br, " action ", a, " outside [0, ",
                                           branch_actions[br], ")"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace qstream
