// Batched forward and backward passes of the C51 dueling, branching network
// (layout: trainer/network_spec.h) with Eigen. Templated on the scalar so the
// backend runs float32 and the gradient tests run the same code in double.
//
// Activations are column-major with one column per sample, so the row-major
// obs block (n x obs_dim) is directly an obs_dim x n matrix and every layer is
// one GEMM over the whole batch: Y = W X + b.
#pragma once

#include <cstdint>
#include <vector>

#include "Eigen/Core"
#include "trainer/network_spec.h"

namespace qstream::cpu {

template <typename T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
template <typename T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;
// Flat buffers (parameters, gradients, Adam moments) start at Eigen's packet
// alignment: Eigen peels unaligned heads off vectorized loops and reductions,
// so a buffer whose alignment varied between runs would vary the rounding.
template <typename T>
using AlignedVector = std::vector<T, Eigen::aligned_allocator<T>>;
template <typename T>
using WeightMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
template <typename T>
using WeightGradMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
template <typename T>
using BiasMap = Eigen::Map<const Vector<T>>;
template <typename T>
using BiasGradMap = Eigen::Map<Vector<T>>;

// Everything one forward pass produces; the backward pass reads it.
template <typename T>
struct Activations {
  Matrix<T> input;                // obs_dim x n
  std::vector<Matrix<T>> trunk;   // trunk_hidden[k] x n, after ReLU
  Matrix<T> value_hidden;         // head_hidden x n, after ReLU
  Matrix<T> adv_hidden;           // head_hidden x n, after ReLU
  Matrix<T> value;                // atoms x n
  Matrix<T> adv;                  // (total_actions * atoms) x n, [branch][action][atom]
  Matrix<T> logits;               // same shape as adv: dueling logits
  Matrix<T> probs;                // softmax over atoms of each (sample, action)
  Matrix<T> q;                    // total_actions x n
  int cols() const { return static_cast<int>(input.cols()); }
};

// y = W x + b, then ReLU when `relu`. The bias is the GEMM's initial value
// (saves a pass over y). Eigen's max(y, 0) follows std::max(y, 0), which keeps
// a NaN y: a poisoned input must reach the guard, not turn into 0.
template <typename T, typename In>
void LinearForward(const LinearView& layer, const T* params, const Eigen::MatrixBase<In>& x, bool relu,
                   Matrix<T>* y) {
  const WeightMap<T> w(params + layer.w_offset, layer.out, layer.in);
  const BiasMap<T> b(params + layer.b_offset, layer.out);
  y->resize(layer.out, x.cols());
  for (Eigen::Index j = 0; j < x.cols(); ++j) y->col(j) = b;
  y->noalias() += w * x;
  if (relu) y->array() = y->array().cwiseMax(T(0));
}

// Per sample and branch: l[a][z] = V[z] + A[a][z] - mean_a A[a][z].
template <typename T>
void DuelingLogits(const NetworkSpec& spec, const Matrix<T>& value, const Matrix<T>& adv, Matrix<T>* logits) {
  const int atoms = spec.num_atoms;
  const int total = spec.total_actions();
  logits->resize(adv.rows(), adv.cols());
  Vector<T> shift(atoms);
  for (Eigen::Index n = 0; n < adv.cols(); ++n) {
    Eigen::Map<const Matrix<T>> a(adv.col(n).data(), atoms, total);
    Eigen::Map<Matrix<T>> l(logits->col(n).data(), atoms, total);
    for (int br = 0; br < spec.num_branches(); ++br) {
      const int first = spec.branch_offset(br);
      const int count = spec.branch_actions[br];
      shift = value.col(n) - a.middleCols(first, count).rowwise().sum() / T(count);
      l.middleCols(first, count) = a.middleCols(first, count).colwise() + shift;
    }
  }
}

// probs = softmax over atoms of every (sample, action) logit block;
// q[a] = sum_z probs[a][z] * atom(z).
template <typename T>
void SoftmaxAndQ(const NetworkSpec& spec, const Matrix<T>& logits, Matrix<T>* probs, Matrix<T>* q) {
  const int atoms = spec.num_atoms;
  const Eigen::Index blocks = logits.size() / atoms;
  probs->resize(logits.rows(), logits.cols());
  Eigen::Map<const Matrix<T>> l(logits.data(), atoms, blocks);
  Eigen::Map<Matrix<T>> p(probs->data(), atoms, blocks);
  p = l.rowwise() - l.colwise().maxCoeff();
  p.array() = p.array().exp();  // in place: Eigen vectorizes exp only on a plain array
  p.array().rowwise() /= p.colwise().sum().array();
  Vector<T> support(atoms);
  for (int z = 0; z < atoms; ++z) support[z] = static_cast<T>(spec.atom(z));
  q->resize(spec.total_actions(), logits.cols());
  Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(q->data(), blocks).noalias() = support.transpose() * p;
}

// Forward pass over acts->input (obs_dim x n): fills every other field.
template <typename T>
void Forward(const NetworkSpec& spec, const T* params, Activations<T>* acts) {
  acts->trunk.resize(spec.trunk.size());
  const Matrix<T>* x = &acts->input;
  for (size_t k = 0; k < spec.trunk.size(); ++k) {
    LinearForward(spec.trunk[k], params, *x, /*relu=*/true, &acts->trunk[k]);
    x = &acts->trunk[k];
  }
  LinearForward(spec.value_hidden, params, *x, /*relu=*/true, &acts->value_hidden);
  LinearForward(spec.value_out, params, acts->value_hidden, /*relu=*/false, &acts->value);
  LinearForward(spec.adv_hidden, params, *x, /*relu=*/true, &acts->adv_hidden);
  LinearForward(spec.adv_out, params, acts->adv_hidden, /*relu=*/false, &acts->adv);
  DuelingLogits(spec, acts->value, acts->adv, &acts->logits);
  SoftmaxAndQ(spec, acts->logits, &acts->probs, &acts->q);
}

// Scratch space of Backward, kept between calls to avoid reallocation.
template <typename T>
struct BackwardScratch {
  Matrix<T> d_value, d_adv, d_value_hidden, d_adv_hidden;
  std::vector<Matrix<T>> d_trunk;
};

// dY -> dW (+)= dY X^T, db (+)= sum over columns of dY; written into grads.
template <typename T, typename DY, typename X>
void LinearBackwardParams(const LinearView& layer, const Eigen::MatrixBase<DY>& dy, const Eigen::MatrixBase<X>& x,
                          T* grads) {
  WeightGradMap<T> dw(grads + layer.w_offset, layer.out, layer.in);
  BiasGradMap<T> db(grads + layer.b_offset, layer.out);
  dw.noalias() = dy * x.transpose();
  db = dy.rowwise().sum();
}

// dX = (W^T dY) masked by the ReLU that produced the layer input h.
template <typename T, typename DY, typename H>
void LinearBackwardInput(const LinearView& layer, const T* params, const Eigen::MatrixBase<DY>& dy,
                         const Eigen::MatrixBase<H>& h, Matrix<T>* dx) {
  const WeightMap<T> w(params + layer.w_offset, layer.out, layer.in);
  dx->resize(layer.in, dy.cols());
  dx->noalias() = w.transpose() * dy;
  *dx = (h.array() > T(0)).select(dx->array(), T(0)).matrix();
}

// Gradient of the loss w.r.t. every parameter, given dL/dlogits for the first
// d_logits.cols() columns of `acts`. Overwrites all of grads[0, num_params).
template <typename T>
void Backward(const NetworkSpec& spec, const T* params, const Activations<T>& acts, const Matrix<T>& d_logits,
              T* grads, BackwardScratch<T>* s) {
  const int atoms = spec.num_atoms;
  const int total = spec.total_actions();
  const Eigen::Index n = d_logits.cols();
  // Dueling combine: dV = sum over all actions of dl; dA = dl - mean_a dl per branch.
  s->d_value.resize(atoms, n);
  s->d_adv.resize(d_logits.rows(), n);
  for (Eigen::Index j = 0; j < n; ++j) {
    Eigen::Map<const Matrix<T>> dl(d_logits.col(j).data(), atoms, total);
    Eigen::Map<Matrix<T>> da(s->d_adv.col(j).data(), atoms, total);
    s->d_value.col(j) = dl.rowwise().sum();
    for (int br = 0; br < spec.num_branches(); ++br) {
      const int first = spec.branch_offset(br);
      const int count = spec.branch_actions[br];
      const Vector<T> mean = dl.middleCols(first, count).rowwise().sum() / T(count);
      da.middleCols(first, count) = dl.middleCols(first, count).colwise() - mean;
    }
  }
  const int k_last = static_cast<int>(spec.trunk.size()) - 1;
  const auto trunk_out = acts.trunk[k_last].leftCols(n);
  const auto value_hidden = acts.value_hidden.leftCols(n);
  const auto adv_hidden = acts.adv_hidden.leftCols(n);

  LinearBackwardParams(spec.value_out, s->d_value, value_hidden, grads);
  LinearBackwardInput(spec.value_out, params, s->d_value, value_hidden, &s->d_value_hidden);
  LinearBackwardParams(spec.value_hidden, s->d_value_hidden, trunk_out, grads);
  LinearBackwardParams(spec.adv_out, s->d_adv, adv_hidden, grads);
  LinearBackwardInput(spec.adv_out, params, s->d_adv, adv_hidden, &s->d_adv_hidden);
  LinearBackwardParams(spec.adv_hidden, s->d_adv_hidden, trunk_out, grads);

  s->d_trunk.resize(spec.trunk.size());
  // Both heads feed the trunk output: dH = W_vh^T dVh + W_ah^T dAh, ReLU-masked.
  {
    const WeightMap<T> wv(params + spec.value_hidden.w_offset, spec.value_hidden.out, spec.value_hidden.in);
    const WeightMap<T> wa(params + spec.adv_hidden.w_offset, spec.adv_hidden.out, spec.adv_hidden.in);
    Matrix<T>& d = s->d_trunk[k_last];
    d.resize(spec.trunk_out(), n);
    d.noalias() = wv.transpose() * s->d_value_hidden;
    d.noalias() += wa.transpose() * s->d_adv_hidden;
    d = (trunk_out.array() > T(0)).select(d.array(), T(0)).matrix();
  }
  for (int k = k_last; k >= 0; --k) {
    if (k > 0) {
      const auto below = acts.trunk[k - 1].leftCols(n);
      LinearBackwardParams(spec.trunk[k], s->d_trunk[k], below, grads);
      LinearBackwardInput(spec.trunk[k], params, s->d_trunk[k], below, &s->d_trunk[k - 1]);
    } else {
      LinearBackwardParams(spec.trunk[k], s->d_trunk[k], acts.input.leftCols(n), grads);
    }
  }
}

}  // namespace qstream::cpu
