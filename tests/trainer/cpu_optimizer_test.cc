#include "trainer/cpu/optimizer.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace qstream::cpu {
namespace {

std::vector<float> Random(int n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0, scale);
  std::vector<float> x(n);
  for (float& v : x) v = d(rng);
  return x;
}

TEST(OptimizerTest, GlobalNormAndClipScale) {
  const std::vector<float> g = {3, 0, -4, 0, 12};
  EXPECT_DOUBLE_EQ(GlobalNorm(g.data(), 5), 13.0);
  EXPECT_FLOAT_EQ(ClipScale(13.0f, 10.0f), 10.0f / (13.0f + 1e-6f));
  EXPECT_FLOAT_EQ(ClipScale(5.0f, 10.0f), 1.0f);
  EXPECT_FLOAT_EQ(ClipScale(500.0f, 0.0f), 1.0f);  // clipping disabled
  EXPECT_FLOAT_EQ(ClipScale(0.0f, 10.0f), 1.0f);
}

TEST(OptimizerTest, AdamMatchesTheDirectFormulaOverSeveralUpdates) {
  constexpr int kN = 1001;  // odd: exercises the vectorized tail
  const AdamHyper h{1e-3f, 0.9f, 0.999f, 1e-8f};
  auto theta = Random(kN, 1, 1.0f);
  std::vector<float> m(kN, 0), v(kN, 0);
  std::vector<double> rt(theta.begin(), theta.end()), rm(kN, 0), rv(kN, 0);
  for (int k = 1; k <= 5; ++k) {
    const auto g = Random(kN, 100 + k, 0.1f * k);
    const float scale = k == 3 ? 0.25f : 1.0f;
    AdamUpdate(h, k, scale, g.data(), m.data(), v.data(), theta.data(), kN);
    for (int i = 0; i < kN; ++i) {
      const double gi = double{g[i]} * scale;
      rm[i] = 0.9 * rm[i] + 0.1 * gi;
      rv[i] = 0.999 * rv[i] + 0.001 * gi * gi;
      const double mhat = rm[i] / (1 - std::pow(0.9, k));
      const double vhat = rv[i] / (1 - std::pow(0.999, k));
      rt[i] -= 1e-3 * mhat / (std::sqrt(vhat) + 1e-8);
    }
  }
  for (int i = 0; i < kN; ++i) {
    EXPECT_NEAR(m[i], rm[i], 1e-6 * (1 + std::fabs(rm[i])));
    EXPECT_NEAR(v[i], rv[i], 1e-6 * (1 + std::fabs(rv[i])));
    EXPECT_NEAR(theta[i], rt[i], 1e-6 * (1 + std::fabs(rt[i])));
  }
}

TEST(OptimizerTest, FirstAdamStepMovesEveryParameterByAboutLr) {
  // With bias correction the first update is lr * g / (|g| + eps).
  std::vector<float> theta = {1, 1, 1}, m(3, 0), v(3, 0);
  const std::vector<float> g = {0.5f, -2.0f, 1e-3f};
  AdamUpdate({0.01f, 0.9f, 0.999f, 1e-8f}, 1, 1.0f, g.data(), m.data(), v.data(), theta.data(), 3);
  EXPECT_NEAR(theta[0], 0.99f, 1e-6);
  EXPECT_NEAR(theta[1], 1.01f, 1e-6);
  EXPECT_NEAR(theta[2], 0.99f, 1e-5);
}

TEST(OptimizerTest, EmaMatchesTheDirectFormula) {
  constexpr int kN = 37;
  const auto online = Random(kN, 3, 1.0f);
  auto target = Random(kN, 4, 1.0f);
  const auto before = target;
  EmaUpdate(0.005f, online.data(), target.data(), kN);
  for (int i = 0; i < kN; ++i) {
    EXPECT_NEAR(target[i], before[i] + 0.005 * (double{online[i]} - before[i]), 1e-7);
  }
  EmaUpdate(1.0f, online.data(), target.data(), kN);
  for (int i = 0; i < kN; ++i) EXPECT_NEAR(target[i], online[i], 1e-6);
}

}  // namespace
}  // namespace qstream::cpu
