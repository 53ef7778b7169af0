// NetworkSpec: the shape of the C51 dueling, branching network and the layout
// of its one flat float32 parameter buffer (shared by every backend, the
// checkpoint format and the PolicyService wire format).
//
// Each Linear layer is W[out][in] row-major followed by b[out]. Order:
//   trunk[0..k-1], value_hidden, value_out, adv_hidden, adv_out.
// adv_out produces total_actions * atoms outputs ordered [branch][action][atom].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "qstream/v1/config.pb.h"
#include "qstream/v1/policy.pb.h"

namespace qstream {

struct LinearView {
  int in = 0;
  int out = 0;
  int64_t w_offset = 0;  // W[out][in] starts here in the flat buffer
  int64_t b_offset = 0;  // b[out] starts here
  int64_t num_params() const { return int64_t{in} * out + out; }
};

struct NetworkSpec {
  int obs_dim = 0;
  std::vector<int> trunk_hidden;
  int head_hidden = 0;
  int num_atoms = 0;
  float v_min = 0;
  float v_max = 0;
  std::vector<int> branch_actions;

  std::vector<LinearView> trunk;
  LinearView value_hidden, value_out, adv_hidden, adv_out;
  int64_t num_params = 0;

  int num_branches() const { return static_cast<int>(branch_actions.size()); }
  int total_actions() const;            // sum of branch_actions
  int branch_offset(int branch) const;  // first action index of a branch
  int trunk_out() const { return trunk_hidden.back(); }
  float delta_z() const { return (v_max - v_min) / (num_atoms - 1); }
  float atom(int z) const { return v_min + z * delta_z(); }
  std::vector<float> atoms() const;

  // All layers in buffer order (trunk..., value_hidden, value_out, adv_hidden, adv_out).
  std::vector<LinearView> layers() const;

  // Validates the config (positive sizes, v_min < v_max, atoms >= 2, ...) and
  // computes offsets. Errors name the offending field.
  static absl::StatusOr<NetworkSpec> Create(const v1::NetworkConfig& config);
  static absl::StatusOr<NetworkSpec> FromArchitecture(const v1::Architecture& arch);
  v1::Architecture ToArchitecture() const;
  std::string DebugString() const;
};

// Deterministic init from `seed`: every W and b ~ U(-1/sqrt(in), 1/sqrt(in))
// (PyTorch's nn.Linear default), drawn in buffer order from a mt19937_64.
std::vector<float> InitParams(const NetworkSpec& spec, uint64_t seed);

}  // namespace qstream
