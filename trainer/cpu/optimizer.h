// Flat-buffer parameter updates of the CPU backend (step 10 of the learner
// step): global-norm clip, Adam with bias correction, EMA or hard-copy target.
// Every function acts on whole flat buffers of `n` floats.
#pragma once

#include <cstdint>

namespace qstream::cpu {

struct AdamHyper {
  float lr = 0;
  float beta1 = 0;
  float beta2 = 0;
  float epsilon = 0;
};

// sqrt(sum g^2), accumulated in double.
double GlobalNorm(const float* g, int64_t n);

// clip > 0 ? min(1, clip / (norm + 1e-6)) : 1.
float ClipScale(float norm, float clip);

// One Adam update on g * grad_scale, k = number of this update (1-based):
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
//   theta -= lr * (m / (1 - b1^k)) / (sqrt(v / (1 - b2^k)) + eps).
void AdamUpdate(const AdamHyper& hyper, int64_t k, float grad_scale, const float* g, float* m, float* v,
                float* theta, int64_t n);

// target += tau * (online - target).
void EmaUpdate(float tau, const float* online, float* target, int64_t n);

}  // namespace qstream::cpu
