// The forward-only policy library against the CPU backend's forward pass
// (trainer/cpu/forward.h, the oracle) on fresh random weights and inputs, and
// its checks of architectures and sizes.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "clients/policy/network.h"
#include "gtest/gtest.h"
#include "trainer/cpu/forward.h"
#include "trainer/network_spec.h"

namespace qstream::policy {
namespace {

// Float32 GEMMs and a softmax in the same order as the oracle: agreement to
// a few ulps of the largest |Q| (v_max = 10).
constexpr float kTolerance = 1e-5f;

v1::Architecture Arch(int obs_dim, const std::vector<int>& trunk, int head, int atoms,
                      const std::vector<int>& branches) {
  v1::Architecture a;
  a.set_obs_dim(obs_dim);
  for (int h : trunk) a.add_trunk_hidden(h);
  a.set_head_hidden(head);
  a.set_num_atoms(atoms);
  a.set_v_min(-10);
  a.set_v_max(10);
  for (int b : branches) a.add_branch_actions(b);
  return a;
}

struct Case {
  std::string name;
  v1::Architecture arch;
  int count;
};

class PolicyNetworkOracleTest : public ::testing::TestWithParam<Case> {};

TEST_P(PolicyNetworkOracleTest, QValuesAndGreedyActionsMatchTheCpuBackend) {
  const Case& c = GetParam();
  auto spec = NetworkSpec::FromArchitecture(c.arch);
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto net = Network::Create(c.arch);
  ASSERT_TRUE(net.ok()) << net.status();
  ASSERT_EQ(net->num_weights(), spec->num_params);
  ASSERT_EQ(net->total_actions(), spec->total_actions());

  for (uint64_t seed = 1; seed <= 3; ++seed) {
    // The init's weight scale, then stretched so the atoms' softmax is far from uniform.
    std::vector<float> weights = InitParams(*spec, seed);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> stretch(0.0f, 1.5f);
    for (float& w : weights) w *= 1.0f + std::fabs(stretch(rng));
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<float> obs(static_cast<size_t>(c.count) * c.arch.obs_dim());
    for (float& x : obs) x = normal(rng);

    std::vector<float> want(static_cast<size_t>(c.count) * spec->total_actions());
    ComputeQValues(*spec, weights.data(), obs.data(), c.count, want.data());
    std::vector<float> got(want.size());
    ASSERT_TRUE(net->QValues(weights, obs, got).ok());
    float spread = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], kTolerance * (1 + std::fabs(want[i]))) << "q[" << i << "] seed " << seed;
      spread = std::max(spread, std::fabs(want[i] - want[0]));
    }
    // Q-values that all sat at the same value would make the comparison vacuous.
    EXPECT_GT(spread, 0.1f) << "seed " << seed;

    std::vector<int32_t> want_actions(static_cast<size_t>(c.count) * spec->num_branches());
    GreedyActions(*spec, want.data(), c.count, want_actions.data());
    std::vector<int32_t> got_actions(want_actions.size());
    ASSERT_TRUE(net->GreedyActions(want, got_actions).ok());
    EXPECT_EQ(got_actions, want_actions) << "seed " << seed;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PolicyNetworkOracleTest,
                         ::testing::Values(Case{"CartPoleLike", Arch(4, {64, 64}, 32, 51, {2}), 37},
                                           Case{"OneObservation", Arch(4, {16}, 8, 11, {3}), 1},
                                           Case{"ThreeBranchesDeepTrunk",
                                                Arch(48, {128, 96, 64}, 64, 21, {3, 5, 2}), 64},
                                           Case{"TwoAtoms", Arch(7, {9}, 5, 2, {4, 1}), 13}),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(PolicyNetworkTest, NoObservationsGiveNoQValues) {
  auto net = Network::Create(Arch(4, {8}, 4, 5, {2}));
  ASSERT_TRUE(net.ok());
  std::vector<float> weights(net->num_weights(), 0.1f);
  EXPECT_TRUE(net->QValues(weights, {}, {}).ok());
}

TEST(PolicyNetworkTest, CreateNamesTheBadField) {
  struct Bad {
    v1::Architecture arch;
    std::string field;
  };
  std::vector<Bad> bad = {
      {Arch(0, {8}, 4, 5, {2}), "obs_dim"},
      {Arch(4, {}, 4, 5, {2}), "trunk_hidden"},
      {Arch(4, {8, 0}, 4, 5, {2}), "trunk_hidden[1]"},
      {Arch(4, {8}, 0, 5, {2}), "head_hidden"},
      {Arch(4, {8}, 4, 1, {2}), "num_atoms"},
      {Arch(4, {8}, 4, 5, {}), "branch_actions"},
      {Arch(4, {8}, 4, 5, {2, 0}), "branch_actions[1]"},
  };
  v1::Architecture flat = Arch(4, {8}, 4, 5, {2});
  flat.set_v_max(flat.v_min());
  bad.push_back({flat, "v_min"});
  for (const Bad& b : bad) {
    auto net = Network::Create(b.arch);
    ASSERT_FALSE(net.ok()) << b.field;
    EXPECT_EQ(net.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(net.status().message().find("architecture." + b.field + ":"), std::string::npos)
        << net.status();
  }
}

TEST(PolicyNetworkTest, QValuesRefusesSizesThatDoNotFit) {
  auto net = Network::Create(Arch(4, {8}, 4, 5, {2, 3}));
  ASSERT_TRUE(net.ok());
  std::vector<float> weights(net->num_weights(), 0.1f);
  std::vector<float> obs(8);  // two observations
  std::vector<float> q(10);   // two rows of 5 actions
  EXPECT_TRUE(net->QValues(weights, obs, q).ok());

  std::vector<float> short_weights(weights.size() - 1);
  EXPECT_NE(net->QValues(short_weights, obs, q).message().find("weights"), std::string::npos);
  std::vector<float> ragged_obs(7);
  EXPECT_NE(net->QValues(weights, ragged_obs, q).message().find("obs"), std::string::npos);
  std::vector<float> small_q(9);
  EXPECT_NE(net->QValues(weights, obs, small_q).message().find("q:"), std::string::npos);
  std::vector<int32_t> actions(3);  // two rows need 2 x 2
  EXPECT_NE(net->GreedyActions(q, actions).message().find("actions"), std::string::npos);
}

TEST(PolicyTest, FromProtoChecksTheWeightCount) {
  v1::Policy proto;
  proto.set_version(7);
  *proto.mutable_architecture() = Arch(4, {8}, 4, 5, {2});
  auto net = Network::Create(proto.architecture());
  ASSERT_TRUE(net.ok());
  for (int64_t i = 0; i < net->num_weights(); ++i) proto.add_weights(0.01f * static_cast<float>(i));
  auto policy = Policy::FromProto(proto);
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_EQ(policy->version, 7);
  EXPECT_EQ(policy->weights.size(), static_cast<size_t>(net->num_weights()));
  EXPECT_EQ(policy->weights[3], 0.03f);

  proto.add_weights(0);
  auto extra = Policy::FromProto(proto);
  ASSERT_FALSE(extra.ok());
  EXPECT_NE(extra.status().message().find("weights"), std::string::npos) << extra.status();
}

}  // namespace
}  // namespace qstream::policy
