#include "clients/policy/network.h"

#include <cmath>
#include <numeric>
#include <string>

#include "Eigen/Core"
#include "absl/strings/str_cat.h"

namespace qstream::policy {
namespace {

// The daemon's own limits on the shape (trainer/network_spec.cc), so a policy
// it publishes always fits.
constexpr int kMaxWidth = 65536;
constexpr int kMaxAtoms = 1024;
constexpr int kMaxBranchActions = 4096;
constexpr int kMaxBranches = 64;

// Activations: one column per observation, so a row-major count x obs_dim
// block is directly an obs_dim x count matrix and each layer is one GEMM.
using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic>;
using Vector = Eigen::Matrix<float, Eigen::Dynamic, 1>;
using WeightMap = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

absl::Status Bad(const std::string& field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("architecture.", field, ": ", why));
}

}  // namespace

absl::StatusOr<Network> Network::Create(const v1::Architecture& arch) {
  Network net;
  if (arch.obs_dim() <= 0 || arch.obs_dim() > kMaxWidth) return Bad("obs_dim", "must be in [1, 65536]");
  if (arch.trunk_hidden_size() == 0) return Bad("trunk_hidden", "needs at least one layer");
  for (int i = 0; i < arch.trunk_hidden_size(); ++i) {
    if (arch.trunk_hidden(i) <= 0 || arch.trunk_hidden(i) > kMaxWidth) {
      return Bad(absl::StrCat("trunk_hidden[", i, "]"), "must be in [1, 65536]");
    }
  }
  if (arch.head_hidden() <= 0 || arch.head_hidden() > kMaxWidth)
    return Bad("head_hidden", "must be in [1, 65536]");
  if (arch.num_atoms() < 2 || arch.num_atoms() > kMaxAtoms) return Bad("num_atoms", "must be in [2, 1024]");
  if (!std::isfinite(arch.v_min()) || !std::isfinite(arch.v_max()) || !(arch.v_min() < arch.v_max())) {
    return Bad("v_min", "need finite v_min < v_max");
  }
  if (arch.branch_actions_size() == 0) return Bad("branch_actions", "needs at least one branch");
  if (arch.branch_actions_size() > kMaxBranches) return Bad("branch_actions", "at most 64 branches");
  for (int i = 0; i < arch.branch_actions_size(); ++i) {
    if (arch.branch_actions(i) <= 0 || arch.branch_actions(i) > kMaxBranchActions) {
      return Bad(absl::StrCat("branch_actions[", i, "]"), "must be in [1, 4096]");
    }
  }

  net.obs_dim_ = arch.obs_dim();
  net.num_atoms_ = arch.num_atoms();
  net.branch_actions_.assign(arch.branch_actions().begin(), arch.branch_actions().end());
  net.total_actions_ = std::accumulate(net.branch_actions_.begin(), net.branch_actions_.end(), 0);
  const float delta_z = (arch.v_max() - arch.v_min()) / static_cast<float>(arch.num_atoms() - 1);
  net.support_.resize(arch.num_atoms());
  for (int z = 0; z < arch.num_atoms(); ++z) net.support_[z] = arch.v_min() + static_cast<float>(z) * delta_z;

  int64_t offset = 0;
  auto layer = [&offset](int in, int out) {
    const Layer l{in, out, offset};
    offset += int64_t{in} * out + out;
    return l;
  };
  int width = arch.obs_dim();
  for (int h : arch.trunk_hidden()) {
    net.trunk_.push_back(layer(width, h));
    width = h;
  }
  net.value_hidden_ = layer(width, arch.head_hidden());
  net.value_out_ = layer(arch.head_hidden(), arch.num_atoms());
  net.adv_hidden_ = layer(width, arch.head_hidden());
  net.adv_out_ = layer(arch.head_hidden(), net.total_actions_ * arch.num_atoms());
  net.num_weights_ = offset;
  return net;
}

namespace {

// y = W x + b, ReLU when `relu`. The bias is the GEMM's initial value, as in
// the CPU backend, so the two round alike; max(y, 0) keeps a NaN.
template <typename Layer, typename In>
void Linear(const Layer& layer, const float* weights, const Eigen::MatrixBase<In>& x, bool relu, Matrix* y) {
  const WeightMap w(weights + layer.offset, layer.out, layer.in);
  const Eigen::Map<const Vector> b(weights + layer.offset + int64_t{layer.in} * layer.out, layer.out);
  y->resize(layer.out, x.cols());
  for (Eigen::Index j = 0; j < x.cols(); ++j) y->col(j) = b;
  y->noalias() += w * x;
  if (relu) y->array() = y->array().cwiseMax(0.0f);
}

}  // namespace

absl::Status Network::QValues(std::span<const float> weights, std::span<const float> obs,
                              std::span<float> q) const {
  if (static_cast<int64_t>(weights.size()) != num_weights_) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights: ", weights.size(), " floats, the architecture needs ", num_weights_));
  }
  if (obs.size() % static_cast<size_t>(obs_dim_) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("obs: ", obs.size(), " floats is not a multiple of obs_dim ", obs_dim_));
  }
  const Eigen::Index count = static_cast<Eigen::Index>(obs.size() / obs_dim_);
  if (static_cast<int64_t>(q.size()) != int64_t{count} * total_actions_) {
    return absl::InvalidArgumentError(absl::StrCat("q: room for ", q.size(), " floats, ", count,
                                                   " observations need ", int64_t{count} * total_actions_));
  }
  if (count == 0) return absl::OkStatus();

  const float* w = weights.data();
  Matrix h;
  Matrix next;
  Linear(trunk_[0], w, Eigen::Map<const Matrix>(obs.data(), obs_dim_, count), /*relu=*/true, &h);
  for (size_t k = 1; k < trunk_.size(); ++k) {
    Linear(trunk_[k], w, h, /*relu=*/true, &next);
    h.swap(next);
  }
  Matrix value_hidden, value, adv_hidden, adv;
  Linear(value_hidden_, w, h, /*relu=*/true, &value_hidden);
  Linear(value_out_, w, value_hidden, /*relu=*/false, &value);
  Linear(adv_hidden_, w, h, /*relu=*/true, &adv_hidden);
  Linear(adv_out_, w, adv_hidden, /*relu=*/false, &adv);

  // Per observation and branch: l[a][z] = V[z] + A[a][z] - mean_a A[a][z];
  // p = softmax_z l[a]; Q[a] = support . p. q is total_actions x count
  // column-major, i.e. count x total_actions row-major.
  const int atoms = num_atoms_;
  const Eigen::Map<const Vector> support(support_.data(), atoms);
  Eigen::Map<Matrix> q_out(q.data(), total_actions_, count);
  Matrix logits(atoms, total_actions_);
  Vector shift(atoms);
  Eigen::RowVectorXf col_max(total_actions_);
  Eigen::RowVectorXf col_sum(total_actions_);
  for (Eigen::Index j = 0; j < count; ++j) {
    const Eigen::Map<const Matrix> a(adv.col(j).data(), atoms, total_actions_);
    int first = 0;
    for (int count_b : branch_actions_) {
      shift = value.col(j) - a.middleCols(first, count_b).rowwise().sum() / static_cast<float>(count_b);
      logits.middleCols(first, count_b) = a.middleCols(first, count_b).colwise() + shift;
      first += count_b;
    }
    col_max = logits.colwise().maxCoeff();
    logits.rowwise() -= col_max;
    logits.array() = logits.array().exp();  // in place: Eigen vectorizes exp only on a plain array
    col_sum = logits.colwise().sum();
    logits.array().rowwise() /= col_sum.array();
    q_out.col(j).noalias() = (support.transpose() * logits).transpose();
  }
  return absl::OkStatus();
}

absl::Status Network::GreedyActions(std::span<const float> q, std::span<int32_t> actions) const {
  if (q.size() % static_cast<size_t>(total_actions_) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("q: ", q.size(), " floats is not a multiple of total_actions ", total_actions_));
  }
  const size_t count = q.size() / total_actions_;
  if (actions.size() != count * branch_actions_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("actions: room for ", actions.size(), ", ", count,
                                                   " rows need ", count * branch_actions_.size()));
  }
  for (size_t i = 0; i < count; ++i) {
    const float* row = q.data() + i * total_actions_;
    int first = 0;
    for (size_t br = 0; br < branch_actions_.size(); ++br) {
      int best = 0;
      for (int a = 1; a < branch_actions_[br]; ++a) {
        if (row[first + a] > row[first + best]) best = a;
      }
      actions[i * branch_actions_.size() + br] = best;
      first += branch_actions_[br];
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Policy> Policy::FromProto(const v1::Policy& proto) {
  absl::StatusOr<Network> network = Network::Create(proto.architecture());
  if (!network.ok()) return network.status();
  if (proto.weights_size() != network->num_weights()) {
    return absl::InvalidArgumentError(absl::StrCat("policy version ", proto.version(), " has ",
                                                   proto.weights_size(), " weights; its architecture needs ",
                                                   network->num_weights()));
  }
  return Policy{proto.version(), *std::move(network),
                std::vector<float>(proto.weights().begin(), proto.weights().end())};
}

}  // namespace qstream::policy
