#include "trainer/cpu/forward.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "trainer/cpu/network.h"
#include "trainer/network_spec.h"

namespace qstream {
namespace {

NetworkSpec BranchedSpec() {
  v1::NetworkConfig c;
  c.set_obs_dim(5);
  c.add_trunk_hidden(16);
  c.add_trunk_hidden(12);
  c.add_trunk_hidden(8);
  c.set_head_hidden(10);
  c.set_num_atoms(11);
  c.set_v_min(-4);
  c.set_v_max(6);
  c.add_branch_actions(3);
  c.add_branch_actions(1);
  c.add_branch_actions(4);
  auto spec = NetworkSpec::Create(c);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

std::vector<float> RandomObs(int64_t n, int dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0, 1.5f);
  std::vector<float> obs(n * dim);
  for (float& x : obs) x = d(rng);
  return obs;
}

// The documented formula (policy.proto) written out sample by sample in
// double: what the Python SDK's numpy forward computes.
std::vector<double> ReferenceQ(const NetworkSpec& spec, const std::vector<float>& params, const float* obs) {
  auto linear = [&](const LinearView& l, const std::vector<double>& x, bool relu) {
    std::vector<double> y(l.out);
    for (int o = 0; o < l.out; ++o) {
      double acc = params[l.b_offset + o];
      for (int i = 0; i < l.in; ++i) acc += double{params[l.w_offset + int64_t{o} * l.in + i]} * x[i];
      y[o] = relu ? std::max(acc, 0.0) : acc;
    }
    return y;
  };
  std::vector<double> h(obs, obs + spec.obs_dim);
  for (const auto& l : spec.trunk) h = linear(l, h, true);
  const auto v = linear(spec.value_out, linear(spec.value_hidden, h, true), false);
  const auto a = linear(spec.adv_out, linear(spec.adv_hidden, h, true), false);
  const int atoms = spec.num_atoms;
  std::vector<double> q;
  for (int br = 0; br < spec.num_branches(); ++br) {
    const int first = spec.branch_offset(br);
    const int count = spec.branch_actions[br];
    for (int act = 0; act < count; ++act) {
      std::vector<double> l(atoms);
      double max = -1e300;
      for (int z = 0; z < atoms; ++z) {
        double mean = 0;
        for (int k = 0; k < count; ++k) mean += a[(first + k) * atoms + z];
        l[z] = v[z] + a[(first + act) * atoms + z] - mean / count;
        max = std::max(max, l[z]);
      }
      double sum = 0, qa = 0;
      for (int z = 0; z < atoms; ++z) sum += std::exp(l[z] - max);
      for (int z = 0; z < atoms; ++z) qa += std::exp(l[z] - max) / sum * spec.atom(z);
      q.push_back(qa);
    }
  }
  return q;
}

TEST(ForwardTest, ShapesOfDuelingBranchedNetwork) {
  const NetworkSpec spec = BranchedSpec();
  const auto params = InitParams(spec, 5);
  constexpr int kN = 7;
  const auto obs = RandomObs(kN, spec.obs_dim, 1);
  cpu::Activations<float> acts;
  acts.input = Eigen::Map<const cpu::Matrix<float>>(obs.data(), spec.obs_dim, kN);
  cpu::Forward(spec, params.data(), &acts);
  ASSERT_EQ(acts.trunk.size(), 3u);
  EXPECT_EQ(acts.trunk[2].rows(), 8);
  EXPECT_EQ(acts.value.rows(), 11);
  EXPECT_EQ(acts.value.cols(), kN);
  EXPECT_EQ(acts.adv.rows(), 8 * 11);
  EXPECT_EQ(acts.logits.rows(), 8 * 11);
  EXPECT_EQ(acts.probs.cols(), kN);
  EXPECT_EQ(acts.q.rows(), 8);
  EXPECT_EQ(acts.q.cols(), kN);
  for (int n = 0; n < kN; ++n) {
    for (int act = 0; act < 8; ++act) {
      EXPECT_NEAR(acts.probs.col(n).segment(act * 11, 11).sum(), 1.0f, 1e-5);
      EXPECT_GE(acts.q(act, n), spec.v_min);
      EXPECT_LE(acts.q(act, n), spec.v_max);
    }
    // Dueling at logit level: the mean over a branch's actions of the logits is V.
    for (int br = 0; br < 3; ++br) {
      const int first = spec.branch_offset(br);
      const int count = spec.branch_actions[br];
      for (int z = 0; z < 11; ++z) {
        float mean = 0;
        for (int act = 0; act < count; ++act) mean += acts.logits((first + act) * 11 + z, n);
        EXPECT_NEAR(mean / count, acts.value(z, n), 1e-5);
      }
    }
  }
  // A branch with one action has logits equal to V whatever its advantage.
  for (int z = 0; z < 11; ++z) EXPECT_NEAR(acts.logits(3 * 11 + z, 0), acts.value(z, 0), 1e-5);
}

TEST(ForwardTest, ComputeQValuesMatchesTheDocumentedFormula) {
  const NetworkSpec spec = BranchedSpec();
  const auto params = InitParams(spec, 9);
  constexpr int kN = 33;
  const auto obs = RandomObs(kN, spec.obs_dim, 2);
  std::vector<float> q(kN * spec.total_actions());
  ComputeQValues(spec, params.data(), obs.data(), kN, q.data());
  for (int n = 0; n < kN; ++n) {
    const auto ref = ReferenceQ(spec, params, &obs[n * spec.obs_dim]);
    for (int a = 0; a < spec.total_actions(); ++a) {
      EXPECT_NEAR(q[n * spec.total_actions() + a], ref[a], 1e-5) << "sample " << n << " action " << a;
    }
  }
}

TEST(ForwardTest, ComputeQValuesIsPerSample) {
  const NetworkSpec spec = BranchedSpec();
  const auto params = InitParams(spec, 9);
  const auto obs = RandomObs(10, spec.obs_dim, 3);
  std::vector<float> all(10 * spec.total_actions()), one(spec.total_actions());
  ComputeQValues(spec, params.data(), obs.data(), 10, all.data());
  ComputeQValues(spec, params.data(), &obs[4 * spec.obs_dim], 1, one.data());
  for (int a = 0; a < spec.total_actions(); ++a) EXPECT_NEAR(one[a], all[4 * spec.total_actions() + a], 1e-6);
}

TEST(ForwardTest, NanObservationGivesNanQ) {
  const NetworkSpec spec = BranchedSpec();
  const auto params = InitParams(spec, 9);
  auto obs = RandomObs(1, spec.obs_dim, 4);
  obs[2] = std::nanf("");
  std::vector<float> q(spec.total_actions());
  ComputeQValues(spec, params.data(), obs.data(), 1, q.data());
  for (float x : q) EXPECT_TRUE(std::isnan(x));
}

TEST(GreedyActionsTest, ArgmaxPerBranchWithLowestIndexOnTies) {
  const NetworkSpec spec = BranchedSpec();  // branches 3, 1, 4
  const std::vector<float> q = {
      0.1f, 0.5f, 0.5f, 9.0f, -1.0f, -3.0f, -0.5f, -0.5f,  // ties -> 1 and 2 of the last branch
      2.0f, 1.0f, 0.0f, 0.0f, 0.0f,  0.0f,  0.0f,  0.0f,   // all equal in the last branch -> 0
  };
  std::vector<int32_t> actions(2 * 3);
  GreedyActions(spec, q.data(), 2, actions.data());
  EXPECT_EQ(actions, (std::vector<int32_t>{1, 0, 2, 0, 0, 0}));
}

}  // namespace
}  // namespace qstream
