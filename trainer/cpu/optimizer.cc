#include "trainer/cpu/optimizer.h"

#include <algorithm>
#include <cmath>

#include "Eigen/Core"

namespace qstream::cpu {

namespace {
using ConstArray = Eigen::Map<const Eigen::ArrayXf>;
using Array = Eigen::Map<Eigen::ArrayXf>;
// Keeps the clip ratio finite when the gradient is exactly zero.
constexpr float kClipNormEpsilon = 1e-6f;
}  // namespace

double GlobalNorm(const float* g, int64_t n) {
  return std::sqrt(ConstArray(g, n).cast<double>().square().sum());
}

float ClipScale(float norm, float clip) {
  return clip > 0 ? std::min(1.0f, clip / (norm + kClipNormEpsilon)) : 1.0f;
}

void AdamUpdate(const AdamHyper& h, int64_t k, float grad_scale, const float* g_in, float* m_io, float* v_io,
                float* theta_io, int64_t n) {
  const float bias1 = static_cast<float>(1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(k)));
  const float bias2 = static_cast<float>(1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(k)));
  const ConstArray g0(g_in, n);
  Array m(m_io, n), v(v_io, n), theta(theta_io, n);
  const auto g = g0 * grad_scale;
  m = h.beta1 * m + (1.0f - h.beta1) * g;
  v = h.beta2 * v + (1.0f - h.beta2) * g.square();
  theta -= h.lr * (m / bias1) / ((v / bias2).sqrt() + h.epsilon);
}

void EmaUpdate(float tau, const float* online, float* target, int64_t n) {
  Array t(target, n);
  t += tau * (ConstArray(online, n) - t);
}

}  // namespace qstream::cpu
