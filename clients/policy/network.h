// Network: the forward pass of the C51 dueling, action-branching network that
// PolicyService publishes (weight layout and formulas in policy.proto), for
// acting: Q-values and greedy actions per branch for a batch of observations.
// Depends on the wire API and Eigen only, so clients link it without the
// trainer; the learner's Evaluate uses it too.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "qstream/v1/policy.pb.h"

namespace qstream::policy {

class Network {
 public:
  // Checks `arch` (errors name the field, as the daemon's config check does)
  // and lays out the flat weight array.
  static absl::StatusOr<Network> Create(const v1::Architecture& arch);

  int obs_dim() const { return obs_dim_; }
  int num_branches() const { return static_cast<int>(branch_actions_.size()); }
  const std::vector<int>& branch_actions() const { return branch_actions_; }
  // Sum of branch_actions: the width of one row of Q-values.
  int total_actions() const { return total_actions_; }
  // Floats in the weight array of policy.proto's layout.
  int64_t num_weights() const { return num_weights_; }

  // obs: count x obs_dim row-major; q: count x total_actions row-major,
  // branches concatenated, Q[a] = sum_z softmax(l[a])[z] * atom(z).
  // InvalidArgument when a size does not fit (count = obs.size() / obs_dim).
  absl::Status QValues(std::span<const float> weights, std::span<const float> obs, std::span<float> q) const;
  // actions: count x num_branches, the argmax of each branch's Q-values
  // (ties: lowest index). q as QValues writes it.
  absl::Status GreedyActions(std::span<const float> q, std::span<int32_t> actions) const;

 private:
  // One Linear: W[out][in] row-major at `offset`, then b[out].
  struct Layer {
    int in = 0;
    int out = 0;
    int64_t offset = 0;
  };

  Network() = default;

  int obs_dim_ = 0;
  int num_atoms_ = 0;
  std::vector<int> branch_actions_;
  int total_actions_ = 0;
  std::vector<float> support_;  // atom values v_min + z * (v_max - v_min) / (num_atoms - 1)
  std::vector<Layer> trunk_;
  Layer value_hidden_, value_out_, adv_hidden_, adv_out_;
  int64_t num_weights_ = 0;
};

// A published snapshot: its version, network and weights.
struct Policy {
  int64_t version = 0;
  Network network;
  std::vector<float> weights;  // network.num_weights() floats

  // Checks the architecture and that the weight count matches it.
  static absl::StatusOr<Policy> FromProto(const v1::Policy& proto);
};

}  // namespace qstream::policy
