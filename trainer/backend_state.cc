#include "trainer/backend_state.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace qstream {

ReplayState ResizeReplayState(const ReplayState& state, int64_t capacity) {
  if (state.capacity == capacity) return state;
  ReplayState out;
  out.capacity = capacity;
  out.max_priority = state.max_priority;
  const int64_t keep = std::min(state.size, capacity);
  const int dim = state.rows.obs_dim;
  const int br = state.rows.num_branches;
  out.rows.obs_dim = dim;
  out.rows.num_branches = br;
  out.rows.Reserve(keep);
  // Oldest item: slot `cursor` once the ring is full, slot 0 before.
  const int64_t oldest = state.size == state.capacity ? state.cursor % std::max<int64_t>(1, state.size) : 0;
  for (int64_t k = state.size - keep; k < state.size; ++k) {
    const int64_t slot = (oldest + k) % state.size;
    const auto& r = state.rows;
    out.rows.obs.insert(out.rows.obs.end(), r.obs.begin() + slot * dim, r.obs.begin() + (slot + 1) * dim);
    out.rows.next_obs.insert(out.rows.next_obs.end(), r.next_obs.begin() + slot * dim,
                             r.next_obs.begin() + (slot + 1) * dim);
    out.rows.actions.insert(out.rows.actions.end(), r.actions.begin() + slot * br,
                            r.actions.begin() + (slot + 1) * br);
    out.rows.rewards.push_back(r.rewards[slot]);
    out.rows.discounts.push_back(r.discounts[slot]);
    out.priorities.push_back(state.priorities[slot]);
  }
  out.rows.n = keep;
  out.size = keep;
  out.cursor = keep % capacity;
  return out;
}

absl::Status CheckNetworkState(const BackendState& state, int64_t num_params) {
  for (const auto& [name, buf] : {std::pair<const char*, const std::vector<float>*>{"params", &state.params},
                                  {"target", &state.target},
                                  {"adam_m", &state.adam_m},
                                  {"adam_v", &state.adam_v}}) {
    if (static_cast<int64_t>(buf->size()) != num_params) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", buf->size(), " values, network has ", num_params));
    }
  }
  if (state.applied_updates < 0 || state.steps < 0) {
    return absl::InvalidArgumentError("steps/applied_updates: negative");
  }
  return absl::OkStatus();
}

absl::Status CheckReplayState(const ReplayState& state, const NetworkSpec& spec) {
  if (state.capacity < 1 || state.size < 0 || state.size > state.capacity || state.cursor < 0 ||
      state.cursor >= state.capacity || (state.size < state.capacity && state.cursor != state.size)) {
    return absl::InvalidArgumentError(absl::StrCat("replay: size ", state.size, " and cursor ", state.cursor,
                                                   " do not fit capacity ", state.capacity));
  }
  if (state.rows.n != state.size) {
    return absl::InvalidArgumentError(absl::StrCat("replay.rows: ", state.rows.n, " rows, size ", state.size));
  }
  if (auto st = CheckTransitionColumns(state.rows, spec.obs_dim, spec.num_branches(), spec.branch_actions); !st.ok()) {
    return st;
  }
  if (static_cast<int64_t>(state.priorities.size()) != state.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("replay.priorities: ", state.priorities.size(), " values, size ", state.size));
  }
  for (int64_t i = 0; i < state.size; ++i) {
    if (!std::isfinite(state.priorities[i]) || state.priorities[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("replay.priorities[", i, "]: ", state.priorities[i]));
    }
  }
  if (!std::isfinite(state.max_priority) || state.max_priority <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("replay.max_priority: ", state.max_priority));
  }
  return absl::OkStatus();
}

}  // namespace qstream
