// The C51 loss of a sampled batch and its gradient: steps 3-8 of the learner
// step (trainer/backend.h). Templated on the scalar: the backend runs float32,
// the gradient tests run the identical code in double.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "trainer/cpu/network.h"
#include "trainer/network_spec.h"

namespace qstream::cpu {

// Step 6 for one (item, branch): projects the target distribution p, shifted
// to Tz_j = reward + discount * atom(j), onto the fixed support. Adds into m
// (num_atoms, zeroed by the caller) and returns the mass whose Tz fell outside
// [v_min, v_max]. A non-finite Tz poisons m with NaN so the guard sees it.
template <typename T>
T ProjectDistribution(const NetworkSpec& spec, const T* p, T reward, T discount, T* m) {
  const int atoms = spec.num_atoms;
  const T v_min = static_cast<T>(spec.v_min);
  const T v_max = static_cast<T>(spec.v_max);
  const T dz = static_cast<T>(spec.delta_z());
  const T last = static_cast<T>(atoms - 1);
  T clipped = 0;
  for (int j = 0; j < atoms; ++j) {
    T tz = reward + discount * static_cast<T>(spec.atom(j));
    if (tz < v_min || tz > v_max) clipped += p[j];
    // Written with comparisons (not fmin/fmax) so that NaN propagates.
    tz = tz < v_min ? v_min : (tz > v_max ? v_max : tz);
    T b = (tz - v_min) / dz;
    b = b < T(0) ? T(0) : (b > last ? last : b);
    if (!std::isfinite(b)) {
      for (int z = 0; z < atoms; ++z) m[z] = std::numeric_limits<T>::quiet_NaN();
      return clipped;
    }
    const T lower = std::floor(b);
    const T upper = std::ceil(b);
    const int l = static_cast<int>(lower);
    const int u = static_cast<int>(upper);
    if (l == u) {
      m[l] += p[j];
    } else {
      m[l] += p[j] * (upper - b);
      m[u] += p[j] * (b - lower);
    }
  }
  return clipped;
}

// Label smoothing (config.proto LossConfig) of one projected distribution, in
// place: m' = (1 - epsilon) m + epsilon sum(m) / atoms. A NaN-poisoned m stays
// NaN, so the guard still sees a non-finite target.
template <typename T>
void SmoothDistribution(T* m, int atoms, T epsilon) {
  T mass = 0;
  for (int z = 0; z < atoms; ++z) mass += m[z];
  const T spread = epsilon * mass / static_cast<T>(atoms);
  for (int z = 0; z < atoms; ++z) m[z] = (T(1) - epsilon) * m[z] + spread;
}

// The MSE term of the loss blend for one (item, branch): with p =
// softmax(logits), Q = sum_z p_z atom(z) and y = sum_z m_z atom(z) (the
// expected value of the unsmoothed projected target), returns
// 1/2 (Q - y)^2 / (v_max - v_min)^2. When d_logits is set, ADDS
// scale * dMSE/dlogits = scale (Q - y) / (v_max - v_min)^2 p_z (atom(z) - Q).
template <typename T>
T ExpectedValueMse(const NetworkSpec& spec, const T* logits, const T* m, T scale, T* d_logits) {
  const int atoms = spec.num_atoms;
  T max = logits[0];
  for (int z = 1; z < atoms; ++z) max = logits[z] > max ? logits[z] : max;
  T sum_exp = 0;
  T q = 0;  // sum_z exp(l_z - max) atom(z) until divided by sum_exp
  T y = 0;
  for (int z = 0; z < atoms; ++z) {
    const T e = std::exp(logits[z] - max);
    const T atom = static_cast<T>(spec.atom(z));
    sum_exp += e;
    q += e * atom;
    y += m[z] * atom;
  }
  q /= sum_exp;
  const T width = static_cast<T>(spec.v_max) - static_cast<T>(spec.v_min);
  const T inv_width_sq = T(1) / (width * width);
  if (d_logits != nullptr) {
    const T g = scale * (q - y) * inv_width_sq;
    for (int z = 0; z < atoms; ++z) {
      d_logits[z] += g * (std::exp(logits[z] - max) / sum_exp) * (static_cast<T>(spec.atom(z)) - q);
    }
  }
  return T(0.5) * (q - y) * (q - y) * inv_width_sq;
}

// Step 7 for one (item, branch): returns -sum_z m[z] log_softmax(logits)[z].
// When d_logits is set, writes scale * dCE/dlogits = scale * (softmax * sum(m) - m).
template <typename T>
T SoftmaxCrossEntropy(const T* logits, const T* m, int atoms, T scale, T* d_logits) {
  T max = logits[0];
  for (int z = 1; z < atoms; ++z) max = logits[z] > max ? logits[z] : max;
  T sum_exp = 0;
  T mass = 0;
  for (int z = 0; z < atoms; ++z) {
    const T e = std::exp(logits[z] - max);
    if (d_logits != nullptr) d_logits[z] = e;  // kept for the gradient: one exp per atom
    sum_exp += e;
    mass += m[z];
  }
  const T log_sum = std::log(sum_exp);
  T ce = 0;
  for (int z = 0; z < atoms; ++z) ce -= m[z] * (logits[z] - max - log_sum);
  if (d_logits != nullptr) {
    for (int z = 0; z < atoms; ++z) d_logits[z] = scale * (d_logits[z] / sum_exp * mass - m[z]);
  }
  return ce;
}

// A gathered batch of B items.
template <typename T>
struct LossBatch {
  int size = 0;
  Matrix<T> obs;                  // obs_dim x 2B: s in columns [0, B), s' in [B, 2B)
  std::vector<int32_t> actions;   // B x branches
  std::vector<T> rewards;         // B
  std::vector<T> discounts;       // B: gamma^n (1 - done)
  std::vector<T> weights;         // B: importance-sampling weights

  void Resize(const NetworkSpec& spec, int batch) {
    size = batch;
    obs.resize(spec.obs_dim, 2 * batch);
    actions.resize(static_cast<size_t>(batch) * spec.num_branches());
    rewards.resize(batch);
    discounts.resize(batch);
    weights.resize(batch);
  }
};

// The loss options of one step (config.proto LossConfig); the defaults give
// the plain C51 cross-entropy, computed exactly as without options.
template <typename T>
struct LossOptions {
  T label_smoothing = 0;  // epsilon of SmoothDistribution, in [0, 1)
  T mse_alpha = 0;        // weight of the MSE term this step: step::MseBlendAlpha
};

template <typename T>
struct LossResult {
  T loss = 0;  // (1/B) sum_b w_b L_b
  // L_b = (1 - alpha) CE_b + alpha MSE_b (unweighted), B; CE_b when alpha = 0.
  std::vector<T> item_loss;
  std::vector<T> item_ce;  // CE_b (unweighted), B: the priority signal
  T target_clip_fraction = 0;
  AlignedVector<T> grads;         // dloss/dparams, num_params
};

template <typename T>
class C51Loss {
 public:
  explicit C51Loss(const NetworkSpec& spec) : spec_(spec) {}

  // Steps 3-8: loss and gradient w.r.t. `online` (target held constant).
  void Compute(const T* online, const T* target, const LossBatch<T>& batch, LossResult<T>* out,
               const LossOptions<T>& options = {}) {
    const int B = batch.size;
    // 3-4. Online forward on [s | s'] (one GEMM chain over 2B columns), target
    //      forward on s'; each ends in the dueling combine and softmax.
    online_.input = batch.obs;
    Forward(spec_, online, &online_);
    target_.input = batch.obs.rightCols(B);
    Forward(spec_, target, &target_);
    // 5. Double DQN: a* = argmax_a Q_online(s').
    SelectNextActions(B);
    // 6. Project the target distributions p_target(s', a*) onto the support;
    //    label smoothing of a copy (the clip fraction and the MSE target use m).
    const T clip_mass = ProjectTargets(batch);
    out->target_clip_fraction = clip_mass / static_cast<T>(B * spec_.num_branches());
    if (options.label_smoothing > 0) SmoothTargets(options.label_smoothing);
    // 7. CE (and the MSE term when alpha > 0) per item averaged over branches;
    //    IS-weighted mean; dloss/dlogits.
    out->loss = ItemLosses(batch, options, out);
    // 8. Backward through heads and trunk.
    out->grads.resize(spec_.num_params);
    Backward(spec_, online, online_, d_logits_, out->grads.data(), &scratch_);
  }

  // Q_online of the last Compute: total_actions x 2B, s in the first B columns.
  const Matrix<T>& online_q() const { return online_.q; }
  const Matrix<T>& online_probs() const { return online_.probs; }
  const Matrix<T>& target_probs() const { return target_.probs; }
  // a* per (item, branch) of the last Compute.
  const std::vector<int32_t>& next_actions() const { return next_actions_; }

 private:
  void SelectNextActions(int B) {
    const int branches = spec_.num_branches();
    next_actions_.resize(static_cast<size_t>(B) * branches);
    for (int b = 0; b < B; ++b) {
      for (int br = 0; br < branches; ++br) {
        const int first = spec_.branch_offset(br);
        int best = 0;
        for (int a = 1; a < spec_.branch_actions[br]; ++a) {
          if (online_.q(first + a, B + b) > online_.q(first + best, B + b)) best = a;
        }
        next_actions_[b * branches + br] = best;
      }
    }
  }

  T ProjectTargets(const LossBatch<T>& batch) {
    const int B = batch.size;
    const int atoms = spec_.num_atoms;
    const int branches = spec_.num_branches();
    projected_.setZero(atoms, B * branches);
    T clip_mass = 0;
    for (int b = 0; b < B; ++b) {
      for (int br = 0; br < branches; ++br) {
        const int action = spec_.branch_offset(br) + next_actions_[b * branches + br];
        const T* p = target_.probs.col(b).data() + action * atoms;
        clip_mass += ProjectDistribution(spec_, p, batch.rewards[b], batch.discounts[b],
                                         projected_.col(b * branches + br).data());
      }
    }
    return clip_mass;
  }

  void SmoothTargets(T epsilon) {
    smoothed_ = projected_;
    for (Eigen::Index c = 0; c < smoothed_.cols(); ++c) {
      SmoothDistribution(smoothed_.col(c).data(), spec_.num_atoms, epsilon);
    }
  }

  // L_b = (1 - alpha) CE_b + alpha MSE_b, each averaged over branches; the
  // gradient of (1/B) sum_b w_b L_b w.r.t. the logits into d_logits_.
  T ItemLosses(const LossBatch<T>& batch, const LossOptions<T>& options, LossResult<T>* out) {
    const int B = batch.size;
    const int atoms = spec_.num_atoms;
    const int branches = spec_.num_branches();
    const T alpha = options.mse_alpha;
    const bool blend = alpha > 0;
    const Matrix<T>& ce_targets = options.label_smoothing > 0 ? smoothed_ : projected_;
    out->item_loss.resize(B);
    out->item_ce.resize(B);
    d_logits_.setZero(online_.logits.rows(), B);
    double loss = 0;
    for (int b = 0; b < B; ++b) {
      const T scale = batch.weights[b] / static_cast<T>(B * branches);
      const T ce_scale = blend ? (T(1) - alpha) * scale : scale;
      T ce = 0;
      T mse = 0;
      for (int br = 0; br < branches; ++br) {
        const int offset = (spec_.branch_offset(br) + batch.actions[b * branches + br]) * atoms;
        const T* logits = online_.logits.col(b).data() + offset;
        T* d_logits = d_logits_.col(b).data() + offset;
        ce +=
            SoftmaxCrossEntropy(logits, ce_targets.col(b * branches + br).data(), atoms, ce_scale, d_logits);
        if (blend) {
          mse += ExpectedValueMse(spec_, logits, projected_.col(b * branches + br).data(), alpha * scale,
                                  d_logits);
        }
      }
      const T item_ce = ce / static_cast<T>(branches);
      out->item_ce[b] = item_ce;
      out->item_loss[b] =
          blend ? (T(1) - alpha) * item_ce + alpha * (mse / static_cast<T>(branches)) : item_ce;
      loss += static_cast<double>(batch.weights[b]) * static_cast<double>(out->item_loss[b]);
    }
    return static_cast<T>(loss / B);
  }

  const NetworkSpec spec_;
  Activations<T> online_;
  Activations<T> target_;
  std::vector<int32_t> next_actions_;
  Matrix<T> projected_;  // atoms x (B * branches): m of each (item, branch)
  Matrix<T> smoothed_;   // the same after label smoothing (when on)
  Matrix<T> d_logits_;   // (total_actions * atoms) x B
  BackwardScratch<T> scratch_;
};

}  // namespace qstream::cpu
