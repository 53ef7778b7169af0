#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/step_constants.h"
#include "gtest/gtest.h"
#include "trainer/cpu/c51_loss.h"
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

TEST(SmoothDistributionTest, MixesInTheUniformSpreadOfTheMass) {
  std::vector<double> m = {0.1, 0.2, 0.3, 0.25, 0.15};
  SmoothDistribution<double>(m.data(), 5, 0.2);
  const std::vector<double> expected = {0.12, 0.2, 0.28, 0.24, 0.16};  // 0.8 m + 0.2 / 5
  for (int z = 0; z < 5; ++z) EXPECT_NEAR(m[z], expected[z], 1e-15) << "atom " << z;
  // The spread is of the mass actually there (not assumed 1).
  std::vector<double> half = {0.5, 0.0, 0.0, 0.0, 0.0};
  SmoothDistribution<double>(half.data(), 5, 0.5);
  EXPECT_NEAR(half[0], 0.3, 1e-15);
  EXPECT_NEAR(half[1], 0.05, 1e-15);
  // eps = 0 leaves m bit for bit.
  std::vector<float> f = {0.1f, 0.2f, 0.3f, 0.25f, 0.15f};
  const std::vector<float> before = f;
  SmoothDistribution<float>(f.data(), 5, 0.0f);
  EXPECT_EQ(f, before);
}

TEST(SmoothDistributionTest, NanTargetStaysNan) {
  std::vector<float> m(5, std::nanf(""));
  SmoothDistribution<float>(m.data(), 5, 0.1f);
  for (float x : m) EXPECT_TRUE(std::isnan(x));
}

TEST(ExpectedValueMseTest, ValueAndGradientMatchFiniteDifferences) {
  const NetworkSpec spec = MakeSpec(1, {2}, 2, 11, -3, 7, {2});
  const int atoms = spec.num_atoms;
  std::mt19937 rng(17);
  std::normal_distribution<double> n(0, 2);
  std::vector<double> logits(atoms), m(atoms), d(atoms), base(atoms);
  double mass = 0;
  for (int z = 0; z < atoms; ++z) {
    logits[z] = n(rng);
    m[z] = std::fabs(n(rng));
    mass += m[z];
    base[z] = d[z] = n(rng);  // the CE gradient already there: the MSE adds to it
  }
  for (double& x : m) x /= mass;
  const double scale = 0.29;
  const double mse = ExpectedValueMse<double>(spec, logits.data(), m.data(), scale, d.data());

  double sum = 0, q = 0, y = 0;
  for (double l : logits) sum += std::exp(l);
  for (int z = 0; z < atoms; ++z) {
    q += std::exp(logits[z]) / sum * spec.atom(z);
    y += m[z] * spec.atom(z);
  }
  EXPECT_NEAR(mse, 0.5 * (q - y) * (q - y) / 100.0, 1e-14) << "1/2 (Q - y)^2 / (v_max - v_min)^2";
  EXPECT_GT(mse, 1e-4) << "the case must have Q far from y";

  // Fourth-order central differences; errors relative to the largest component.
  const double h = 1e-3;
  double max_err = 0, max_grad = 0;
  for (int z = 0; z < atoms; ++z) {
    auto at = [&](double delta) {
      auto l = logits;
      l[z] += delta;
      return ExpectedValueMse<double>(spec, l.data(), m.data(), 0, nullptr);
    };
    const double fd = scale * (8 * (at(h) - at(-h)) - (at(2 * h) - at(-2 * h))) / (12 * h);
    const double added = d[z] - base[z];
    max_err = std::max(max_err, std::fabs(fd - added));
    max_grad = std::max(max_grad, std::fabs(added));
  }
  std::printf("expected-value MSE gradient: max error vs central differences %.3g of the largest component\n",
              max_err / max_grad);
  EXPECT_LT(max_err, 1e-8 * max_grad);
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

// The analytic gradient of the whole loss (with `options`) against
// fourth-order central differences of the loss, parameter by parameter.
void ExpectGradientMatchesCentralDifferences(const LossOptions<double>& options) {
  GradientCase c;
  C51Loss<double> loss(c.spec);
  LossResult<double> result;
  loss.Compute(c.online.data(), c.target.data(), c.batch, &result, options);
  ASSERT_TRUE(std::isfinite(result.loss));
  ASSERT_GT(result.target_clip_fraction, 0.0);
  const auto grads = result.grads;

  auto loss_at = [&](const std::vector<double>& params) {
    C51Loss<double> l(c.spec);
    LossResult<double> r;
    l.Compute(params.data(), c.target.data(), c.batch, &r, options);
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
    // Floor 1e-6: below it the difference quotient's rounding (~1e-13) dominates.
    const double rel = std::fabs(fd - grads[i]) / std::max(scale, 1e-6);
    EXPECT_LT(rel, 1e-6) << "param " << i << " analytic " << grads[i] << " numeric " << fd;
    max_rel = std::max(max_rel, rel);
  }
  std::printf(
      "full-network gradient (eps %g, alpha %g): %d of %lld params nonzero, max relative error %.3g (%d "
      "zero)\n",
      options.label_smoothing, options.mse_alpha, checked, static_cast<long long>(c.spec.num_params), max_rel,
      zero);
  EXPECT_GT(checked, c.spec.num_params * 3 / 4);
}

TEST(C51LossGradientTest, FullNetworkGradientMatchesCentralDifferences) {
  ExpectGradientMatchesCentralDifferences({});
}

class C51LossOptionsGradientTest : public ::testing::TestWithParam<LossOptions<double>> {};

TEST_P(C51LossOptionsGradientTest, FullNetworkGradientMatchesCentralDifferences) {
  ExpectGradientMatchesCentralDifferences(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Options, C51LossOptionsGradientTest,
                         ::testing::Values(LossOptions<double>{0.1, 0.0}, LossOptions<double>{0.0, 1.0},
                                           LossOptions<double>{0.1, 0.4}, LossOptions<double>{0.5, 0.9}),
                         [](const auto& info) {
                           return "eps" + std::to_string(static_cast<int>(100 * info.param.label_smoothing)) +
                                  "_alpha" + std::to_string(static_cast<int>(100 * info.param.mse_alpha));
                         });

// Independent references in double for the options, from the forward pass's
// own distributions: m = the projection of p_target(s', a*), m' its smoothing,
// Q and log p of the online (s, a) distribution.
TEST(C51LossOptionsTest, ItemLossesMatchDirectComputation) {
  GradientCase c;
  const int B = c.batch.size, branches = c.spec.num_branches(), atoms = c.spec.num_atoms;
  const double eps = 0.1, alpha = 0.3;
  const double width = c.spec.v_max - c.spec.v_min;
  C51Loss<double> loss(c.spec);
  LossResult<double> result;
  loss.Compute(c.online.data(), c.target.data(), c.batch, &result, {eps, alpha});
  double expected_loss = 0;
  for (int b = 0; b < B; ++b) {
    double ce = 0, mse = 0;
    for (int br = 0; br < branches; ++br) {
      const int next = c.spec.branch_offset(br) + loss.next_actions()[b * branches + br];
      std::vector<double> m(atoms, 0.0);
      ProjectDistribution<double>(c.spec,
                                  loss.target_probs().col(b).data() + static_cast<ptrdiff_t>(next) * atoms,
                                  c.batch.rewards[b], c.batch.discounts[b], m.data());
      const int taken = c.spec.branch_offset(br) + c.batch.actions[b * branches + br];
      const double* p = loss.online_probs().col(b).data() + static_cast<ptrdiff_t>(taken) * atoms;
      double y = 0, mass = 0;
      for (int z = 0; z < atoms; ++z) {
        y += m[z] * c.spec.atom(z);
        mass += m[z];
      }
      for (int z = 0; z < atoms; ++z) ce -= ((1 - eps) * m[z] + eps * mass / atoms) * std::log(p[z]);
      const double q = loss.online_q()(taken, b);
      mse += 0.5 * (q - y) * (q - y) / (width * width);
    }
    EXPECT_NEAR(result.item_ce[b], ce / branches, 1e-12) << "item " << b;
    EXPECT_NEAR(result.item_loss[b], (1 - alpha) * ce / branches + alpha * mse / branches, 1e-12)
        << "item " << b;
    expected_loss += c.batch.weights[b] * result.item_loss[b];
  }
  EXPECT_NEAR(result.loss, expected_loss / B, 1e-12);
}

// The loss and its gradient are linear in alpha, the CE (the priority
// signal) does not depend on it, and smoothing leaves the clip fraction.
TEST(C51LossOptionsTest, BlendIsLinearInAlpha) {
  GradientCase c;
  LossResult<double> r[3];
  const double alphas[3] = {0.0, 1.0, 0.35};
  for (int i = 0; i < 3; ++i) {
    C51Loss<double> loss(c.spec);
    loss.Compute(c.online.data(), c.target.data(), c.batch, &r[i], {0.1, alphas[i]});
  }
  EXPECT_NEAR(r[2].loss, 0.65 * r[0].loss + 0.35 * r[1].loss, 1e-12);
  for (size_t i = 0; i < r[2].grads.size(); ++i)
    EXPECT_NEAR(r[2].grads[i], 0.65 * r[0].grads[i] + 0.35 * r[1].grads[i], 1e-12) << i;
  for (int b = 0; b < c.batch.size; ++b) {
    EXPECT_NEAR(r[2].item_loss[b], 0.65 * r[0].item_loss[b] + 0.35 * r[1].item_loss[b], 1e-12);
    EXPECT_EQ(r[2].item_ce[b], r[0].item_ce[b]);
    EXPECT_EQ(r[1].item_ce[b], r[0].item_ce[b]);
  }
  EXPECT_NE(r[0].loss, r[1].loss);
  C51Loss<double> plain(c.spec);
  LossResult<double> rp;
  plain.Compute(c.online.data(), c.target.data(), c.batch, &rp);
  EXPECT_EQ(rp.target_clip_fraction, r[2].target_clip_fraction) << "computed on the unsmoothed projection";
  EXPECT_GT(std::fabs(rp.loss - r[0].loss), 1e-3) << "smoothing moves the CE";
}

TEST(C51LossOptionsTest, NanRewardStillPoisonsTheLoss) {
  GradientCase c;
  c.batch.rewards[4] = std::nan("");
  for (const LossOptions<double> options :
       {LossOptions<double>{0.1, 0.0}, LossOptions<double>{0.0, 1.0}, LossOptions<double>{0.1, 0.5}}) {
    C51Loss<double> loss(c.spec);
    LossResult<double> r;
    loss.Compute(c.online.data(), c.target.data(), c.batch, &r, options);
    EXPECT_TRUE(std::isnan(r.loss)) << options.label_smoothing << " " << options.mse_alpha;
    EXPECT_TRUE(std::isnan(r.item_ce[4]));
  }
}

TEST(MseBlendAlphaTest, FollowsTheSchedule) {
  // start 1, end 0 over 10 steps: 1 - t / 10, then exactly 0.
  for (int64_t t = 0; t <= 12; ++t) {
    const float alpha = step::MseBlendAlpha(1.0f, 0.0f, 10, t);
    EXPECT_NEAR(alpha, std::max(0.0, 1.0 - t / 10.0), 1e-7) << "t " << t;
  }
  EXPECT_EQ(step::MseBlendAlpha(1.0f, 0.0f, 10, 0), 1.0f);
  EXPECT_EQ(step::MseBlendAlpha(1.0f, 0.0f, 10, 10), 0.0f);
  EXPECT_EQ(step::MseBlendAlpha(1.0f, 0.0f, 10, int64_t{1} << 40), 0.0f);
  // Rising, and awkward values end exactly at `end`.
  EXPECT_NEAR(step::MseBlendAlpha(0.2f, 0.9f, 1000, 777), 0.2 + 0.7 * 0.777, 1e-6);
  EXPECT_EQ(step::MseBlendAlpha(0.7f, 0.3f, 3, 3), 0.3f);
  EXPECT_EQ(step::MseBlendAlpha(0.7f, 0.3f, 3, 0), 0.7f);
  // steps 0: end from the first step; the defaults: 0.
  EXPECT_EQ(step::MseBlendAlpha(1.0f, 0.25f, 0, 0), 0.25f);
  EXPECT_EQ(step::MseBlendAlpha(0.0f, 0.0f, 0, 5), 0.0f);
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
