#include "trainer/cpu/c51_loss.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "trainer/network_spec.h"

namespace qstream::cpu {
namespace {

NetworkSpec MakeSpec(int obs_dim, std::vector<int> trunk, int head, int atoms, float v_min, float v_max,
                     std::vector<int> branches) {
  v1::NetworkConfig c;
  c.set_obs_dim(obs_dim);
  for (int h : trunk) c.add_trunk_hidden(h);
  c.set_head_hidden(head);
  c.set_num_atoms(atoms);
  c.set_v_min(v_min);
  c.set_v_max(v_max);
  for (int a : branches) c.add_branch_actions(a);
  auto spec = NetworkSpec::Create(c);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

// Five atoms at -2, -1, 0, 1, 2 (dz = 1) so every expected mass is exact.
class ProjectionTest : public ::testing::Test {
 protected:
  NetworkSpec spec_ = MakeSpec(1, {2}, 2, 5, -2, 2, {2});
  std::vector<float> p_ = {0.1f, 0.2f, 0.3f, 0.25f, 0.15f};

  std::vector<float> Project(float reward, float discount, float* clipped) {
    std::vector<float> m(5, 0.0f);
    *clipped = ProjectDistribution(spec_, p_.data(), reward, discount, m.data());
    return m;
  }
};

TEST_F(ProjectionTest, SplitsMassBetweenNeighboursAndClipsTheTop) {
  float clipped = 0;
  // Tz = -1.5, -0.5, 0.5, 1.5, 2.5 -> the last atom is clipped to v_max = 2 (l == u).
  const auto m = Project(0.5f, 1.0f, &clipped);
  const std::vector<float> expected = {0.05f, 0.15f, 0.25f, 0.275f, 0.275f};
  for (int z = 0; z < 5; ++z) EXPECT_NEAR(m[z], expected[z], 1e-7) << "atom " << z;
  EXPECT_NEAR(clipped, 0.15f, 1e-7);
}

TEST_F(ProjectionTest, TargetsOnAtomsUseTheLEqualsUCase) {
  float clipped = 0;
  // Tz = 0, 0.5, 1, 1.5, 2: three land exactly on atoms, 2 is on v_max (not outside).
  const auto m = Project(1.0f, 0.5f, &clipped);
  const std::vector<float> expected = {0.0f, 0.0f, 0.2f, 0.525f, 0.275f};
  for (int z = 0; z < 5; ++z) EXPECT_NEAR(m[z], expected[z], 1e-7) << "atom " << z;
  EXPECT_EQ(clipped, 0.0f);
}

TEST_F(ProjectionTest, TerminalItemPutsAllMassAtTheReward) {
  float clipped = 0;
  // discount 0: every Tz = 0.3 -> bj = 2.3.
  const auto m = Project(0.3f, 0.0f, &clipped);
  EXPECT_NEAR(m[2], 0.7f, 1e-6);
  EXPECT_NEAR(m[3], 0.3f, 1e-6);
  EXPECT_EQ(m[0] + m[1] + m[4], 0.0f);
  EXPECT_EQ(clipped, 0.0f);
}

TEST_F(ProjectionTest, RewardsOutsideTheSupportLandOnTheEdges) {
  float clipped = 0;
  auto m = Project(-5.0f, 0.0f, &clipped);
  EXPECT_FLOAT_EQ(m[0], 1.0f);
  EXPECT_FLOAT_EQ(clipped, 1.0f);
  m = Project(7.0f, 0.99f, &clipped);
  EXPECT_FLOAT_EQ(m[4], 1.0f);
  EXPECT_FLOAT_EQ(clipped, 1.0f);
  EXPECT_EQ(m[0] + m[1] + m[2] + m[3], 0.0f);
}

TEST_F(ProjectionTest, NanRewardPoisonsTheTarget) {
  float clipped = 0;
  const auto m = Project(std::nanf(""), 0.9f, &clipped);
  for (float x : m) EXPECT_TRUE(std::isnan(x));
}

TEST_F(ProjectionTest, PreservesMassOnTheDefaultSupport) {
  const NetworkSpec spec = MakeSpec(1, {2}, 2, 51, -10, 10, {2});
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<double> p(51);
  for (int trial = 0; trial < 100; ++trial) {
    double sum = 0;
    for (double& x : p) sum += (x = u(rng));
    for (double& x : p) x /= sum;
    std::vector<double> m(51, 0.0);
    ProjectDistribution<double>(spec, p.data(), 30 * u(rng) - 15, u(rng), m.data());
    double total = 0;
    for (double x : m) total += x;
    EXPECT_NEAR(total, 1.0, 1e-12);
  }
}

TEST(SoftmaxCrossEntropyTest, ValueAndGradientMatchFiniteDifferences) {
  constexpr int kAtoms = 11;
  std::mt19937 rng(7);
  std::normal_distribution<double> n(0, 2);
  std::vector<double> logits(kAtoms), m(kAtoms), d(kAtoms);
  double mass = 0;
  for (int z = 0; z < kAtoms; ++z) {
    logits[z] = n(rng);
    m[z] = std::fabs(n(rng));
    mass += m[z];
  }
  for (double& x : m) x /= mass;
  const double scale = 0.37;
  const double ce = SoftmaxCrossEntropy<double>(logits.data(), m.data(), kAtoms, scale, d.data());

  double log_sum = 0;
  for (double l : logits) log_sum += std::exp(l);
  log_sum = std::log(log_sum);
  double direct = 0;
  for (int z = 0; z < kAtoms; ++z) direct -= m[z] * (logits[z] - log_sum);
  EXPECT_NEAR(ce, direct, 1e-12);

  const double h = 1e-6;
  double max_rel = 0;
  for (int z = 0; z < kAtoms; ++z) {
    auto plus = logits, minus = logits;
    plus[z] += h;
    minus[z] -= h;
    const double fd = scale *
                      (SoftmaxCrossEntropy<double>(plus.data(), m.data(), kAtoms, 0, nullptr) -
                       SoftmaxCrossEntropy<double>(minus.data(), m.data(), kAtoms, 0, nullptr)) /
                      (2 * h);
    max_rel = std::max(max_rel, std::fabs(fd - d[z]) / std::max(std::fabs(fd), std::fabs(d[z])));
  }
  std::printf("softmax-CE gradient: max relative error vs central differences %.3g\n", max_rel);
  EXPECT_LT(max_rel, 1e-6);
}

// A batch with two branches, a terminal item, rewards beyond the support and
// non-uniform IS weights, in double precision.
struct GradientCase {
  NetworkSpec spec = MakeSpec(3, {6, 5}, 7, 9, -3, 4, {3, 2});
  LossBatch<double> batch;
  std::vector<double> online, target;

  GradientCase() {
    constexpr int kBatch = 12;
    std::mt19937 rng(11);
    std::normal_distribution<double> n(0, 1);
    std::uniform_real_distribution<double> u(0, 1);
    // Positive biases keep most ReLU units alive on the batch so that
    // nearly every parameter has a gradient worth checking.
    online.assign(spec.num_params, 0.0);
    for (const LinearView& l : spec.layers()) {
      for (int64_t i = 0; i < int64_t{l.in} * l.out; ++i) online[l.w_offset + i] = n(rng) / std::sqrt(l.in);
      for (int i = 0; i < l.out; ++i) online[l.b_offset + i] = 0.5 * u(rng);
    }
    for (float x : InitParams(spec, 22)) target.push_back(x);
    batch.Resize(spec, kBatch);
    for (Eigen::Index i = 0; i < batch.obs.size(); ++i) batch.obs.data()[i] = 2 * n(rng);
    for (int b = 0; b < kBatch; ++b) {
      batch.actions[2 * b] = static_cast<int32_t>(rng() % 3);
      batch.actions[2 * b + 1] = static_cast<int32_t>(rng() % 2);
      batch.rewards[b] = 6 * u(rng) - 3;
      batch.discounts[b] = b == 0 ? 0.0 : 0.970299;
      batch.weights[b] = 0.2 + 0.8 * u(rng);
    }
    batch.rewards[1] = 9.0;  // beyond v_max
  }
};

TEST(C51LossGradientTest, FullNetworkGradientMatchesCentralDifferences) {
  GradientCase c;
  C51Loss<double> loss(c.spec);
  LossResult<double> result;
  loss.Compute(c.online.data(), c.target.data(), c.batch, &result);
  ASSERT_TRUE(std::isfinite(result.loss));
  ASSERT_GT(result.target_clip_fraction, 0.0);
  const auto grads = result.grads;

  auto loss_at = [&](const std::vector<double>& params) {
    C51Loss<double> l(c.spec);
    LossResult<double> r;
    l.Compute(params.data(), c.target.data(), c.batch, &r);
    return r.loss;
  };
  // Fourth-order central differences: truncation O(h^4), rounding ~1e-16 / h.
  const double h = 1e-4;
  double max_rel = 0;
  int checked = 0;
  int zero = 0;
  for (int64_t i = 0; i < c.spec.num_params; ++i) {
    auto at = [&](double delta) {
      auto p = c.online;
      p[i] += delta;
      return loss_at(p);
    };
    const double fd = (8 * (at(h) - at(-h)) - (at(2 * h) - at(-2 * h))) / (12 * h);
    const double scale = std::max(std::fabs(fd), std::fabs(grads[i]));
    if (scale < 1e-9) {
      // Parameters behind ReLU units dead on the whole batch: both must be zero.
      EXPECT_LT(std::fabs(fd - grads[i]), 1e-11) << "param " << i;
      ++zero;
      continue;
    }
    ++checked;
    const double rel = std::fabs(fd - grads[i]) / scale;
    EXPECT_LT(rel, 1e-6) << "param " << i << " analytic " << grads[i] << " numeric " << fd;
    max_rel = std::max(max_rel, rel);
  }
  std::printf("full-network gradient: %d of %lld params nonzero, max relative error %.3g (%d zero)\n", checked,
              static_cast<long long>(c.spec.num_params), max_rel, zero);
  EXPECT_GT(checked, c.spec.num_params * 3 / 4);
}

TEST(C51LossGradientTest, LossIsTheWeightedMeanOfItemLosses) {
  GradientCase c;
  C51Loss<double> loss(c.spec);
  LossResult<double> result;
  loss.Compute(c.online.data(), c.target.data(), c.batch, &result);
  double expected = 0;
  for (int b = 0; b < c.batch.size; ++b) expected += c.batch.weights[b] * result.item_loss[b];
  EXPECT_NEAR(result.loss, expected / c.batch.size, 1e-12);

  // Doubling every weight doubles loss and gradient (a mean, never normalized away).
  LossBatch<double> doubled = c.batch;
  for (double& w : doubled.weights) w *= 2;
  LossResult<double> r2;
  C51Loss<double> loss2(c.spec);
  loss2.Compute(c.online.data(), c.target.data(), doubled, &r2);
  EXPECT_NEAR(r2.loss, 2 * result.loss, 1e-12);
  for (size_t i = 0; i < result.grads.size(); ++i) EXPECT_NEAR(r2.grads[i], 2 * result.grads[i], 1e-12);
}

TEST(C51LossGradientTest, DoubleDqnUsesTheOnlineArgmaxOnNextObs) {
  GradientCase c;
  C51Loss<double> loss(c.spec);
  LossResult<double> result;
  loss.Compute(c.online.data(), c.target.data(), c.batch, &result);
  const int B = c.batch.size;
  const auto& q = loss.online_q();
  ASSERT_EQ(q.cols(), 2 * B);
  for (int b = 0; b < B; ++b) {
    for (int br = 0; br < 2; ++br) {
      const int first = c.spec.branch_offset(br);
      int best = 0;
      for (int a = 1; a < c.spec.branch_actions[br]; ++a) {
        if (q(first + a, B + b) > q(first + best, B + b)) best = a;
      }
      EXPECT_EQ(loss.next_actions()[b * 2 + br], best);
    }
  }
}

TEST(C51LossGradientTest, FloatMatchesDouble) {
  GradientCase c;
  LossBatch<float> fb;
  fb.Resize(c.spec, c.batch.size);
  fb.obs = c.batch.obs.cast<float>();
  fb.actions = c.batch.actions;
  for (int b = 0; b < c.batch.size; ++b) {
    fb.rewards[b] = static_cast<float>(c.batch.rewards[b]);
    fb.discounts[b] = static_cast<float>(c.batch.discounts[b]);
    fb.weights[b] = static_cast<float>(c.batch.weights[b]);
  }
  std::vector<float> online(c.online.begin(), c.online.end()), target(c.target.begin(), c.target.end());
  C51Loss<float> lf(c.spec);
  LossResult<float> rf;
  lf.Compute(online.data(), target.data(), fb, &rf);
  C51Loss<double> ld(c.spec);
  LossResult<double> rd;
  ld.Compute(c.online.data(), c.target.data(), c.batch, &rd);
  EXPECT_NEAR(rf.loss, rd.loss, 1e-5 * std::fabs(rd.loss));
  double max_grad = 0;
  for (double g : rd.grads) max_grad = std::max(max_grad, std::fabs(g));
  for (size_t i = 0; i < rd.grads.size(); ++i) EXPECT_NEAR(rf.grads[i], rd.grads[i], 1e-5 * max_grad) << i;
}

}  // namespace
}  // namespace qstream::cpu
