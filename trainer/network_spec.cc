#include "trainer/network_spec.h"

#include <cmath>
#include <numeric>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace qstream {

int NetworkSpec::total_actions() const {
  return std::accumulate(branch_actions.begin(), branch_actions.end(), 0);
}

int NetworkSpec::branch_offset(int branch) const {
  return std::accumulate(branch_actions.begin(), branch_actions.begin() + branch, 0);
}

std::vector<float> NetworkSpec::atoms() const {
  std::vector<float> z(num_atoms);
  for (int i = 0; i < num_atoms; ++i) z[i] = atom(i);
  return z;
}

std::vector<LinearView> NetworkSpec::layers() const {
  std::vector<LinearView> all = trunk;
  all.push_back(value_hidden);
  all.push_back(value_out);
  all.push_back(adv_hidden);
  all.push_back(adv_out);
  return all;
}

namespace {
constexpr int kMaxWidth = 1 << 16;
}  // namespace

absl::StatusOr<NetworkSpec> NetworkSpec::Create(const v1::NetworkConfig& config) {
  NetworkSpec s;
  s.obs_dim = config.obs_dim();
  s.trunk_hidden.assign(config.trunk_hidden().begin(), config.trunk_hidden().end());
  if (s.trunk_hidden.empty()) s.trunk_hidden = {64, 64};
  s.head_hidden = config.head_hidden();
  s.num_atoms = config.num_atoms();
  s.v_min = config.v_min();
  s.v_max = config.v_max();
  s.branch_actions.assign(config.branch_actions().begin(), config.branch_actions().end());
  if (s.branch_actions.empty()) s.branch_actions = {2};

  auto bad = [](const std::string& field, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("network.", field, ": ", why));
  };
  if (s.obs_dim <= 0 || s.obs_dim > kMaxWidth) return bad("obs_dim", "must be in [1, 65536]");
  for (size_t i = 0; i < s.trunk_hidden.size(); ++i) {
    if (s.trunk_hidden[i] <= 0 || s.trunk_hidden[i] > kMaxWidth)
      return bad(absl::StrCat("trunk_hidden[", i, "]"), "must be in [1, 65536]");
  }
  if (s.head_hidden <= 0 || s.head_hidden > kMaxWidth) return bad("head_hidden", "must be in [1, 65536]");
  if (s.num_atoms < 2 || s.num_atoms > 1024) return bad("num_atoms", "must be in [2, 1024]");
  if (!std::isfinite(s.v_min) || !std::isfinite(s.v_max) || !(s.v_min < s.v_max))
    return bad("v_min", "need finite v_min < v_max");
  for (size_t i = 0; i < s.branch_actions.size(); ++i) {
    if (s.branch_actions[i] < 1 || s.branch_actions[i] > 4096)
      return bad(absl::StrCat("branch_actions[", i, "]"), "must be in [1, 4096]");
  }
  if (s.branch_actions.size() > 64) return bad("branch_actions", "at most 64 branches");

  int64_t offset = 0;
  auto make = [&offset](int in, int out) {
    LinearView v;
    v.in = in;
    v.out = out;
    v.w_offset = offset;
    v.b_offset = offset + int64_t{in} * out;
    offset = v.b_offset + out;
    return v;
  };
  int width = s.obs_dim;
  for (int h : s.trunk_hidden) {
    s.trunk.push_back(make(width, h));
    width = h;
  }
  s.value_hidden = make(width, s.head_hidden);
  s.value_out = make(s.head_hidden, s.num_atoms);
  s.adv_hidden = make(width, s.head_hidden);
  s.adv_out = make(s.head_hidden, s.total_actions() * s.num_atoms);
  s.num_params = offset;
  return s;
}

absl::StatusOr<NetworkSpec> NetworkSpec::FromArchitecture(const v1::Architecture& arch) {
  v1::NetworkConfig c;
  c.set_obs_dim(arch.obs_dim());
  for (int h : arch.trunk_hidden()) c.add_trunk_hidden(h);
  c.set_head_hidden(arch.head_hidden());
  c.set_num_atoms(arch.num_atoms());
  c.set_v_min(arch.v_min());
  c.set_v_max(arch.v_max());
  for (int a : arch.branch_actions()) c.add_branch_actions(a);
  return Create(c);
}

v1::Architecture NetworkSpec::ToArchitecture() const {
  v1::Architecture a;
  a.set_obs_dim(obs_dim);
  for (int h : trunk_hidden) a.add_trunk_hidden(h);
  a.set_head_hidden(head_hidden);
  a.set_num_atoms(num_atoms);
  a.set_v_min(v_min);
  a.set_v_max(v_max);
  for (int b : branch_actions) a.add_branch_actions(b);
  return a;
}

std::string NetworkSpec::DebugString() const {
  return absl::StrCat("obs=", obs_dim, " trunk=[", absl::StrJoin(trunk_hidden, ","), "] head=", head_hidden,
                      " atoms=", num_atoms, " support=[", v_min, ",", v_max, "] branches=[",
                      absl::StrJoin(branch_actions, ","), "] params=", num_params);
}

std::vector<float> InitParams(const NetworkSpec& spec, uint64_t seed) {
  std::vector<float> params(spec.num_params);
  std::mt19937_64 rng(seed);
  for (const LinearView& l : spec.layers()) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(l.in));
    std::uniform_real_distribution<float> u(-bound, bound);
    for (int64_t i = 0; i < l.num_params(); ++i) params[l.w_offset + i] = u(rng);
  }
  return params;
}

}  // namespace qstream
