#include "kernels/optimizer.h"

#include "kernels/warp_reduce.cuh"

namespace qstream::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kFinalizeThreads = 1024;

__global__ void __launch_bounds__(kThreads) GradSumSquaresKernel(const float* __restrict__ g, int64_t n,
                                                                 float* __restrict__ partials) {
  __shared__ float scratch[kThreads / 32];
  const int64_t chunk = (n + gridDim.x - 1) / gridDim.x;
  const int64_t begin = blockIdx.x * chunk;
  const int64_t end = begin + chunk < n ? begin + chunk : n;
  float s = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) s += g[i] * g[i];
  s = BlockSum(s, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kFinalizeThreads) FinalizeKernel(FinalizeArgs a) {
  extern __shared__ int32_t sh_idx[];  // B
  __shared__ float scratch[kFinalizeThreads / 32];
  __shared__ int32_t sh_apply;
  for (int b = threadIdx.x; b < a.batch; b += blockDim.x) sh_idx[b] = a.indices[b];
  float norm_sq = 0.0f;
  for (int i = threadIdx.x; i < kNormBlocks; i += blockDim.x) norm_sq += a.norm_partials[i];
  norm_sq = BlockSum(norm_sq, scratch);
  float wce = 0.0f, clip = 0.0f, qsum = 0.0f, qmin = INFINITY, qmax = -INFINITY, bad = 0.0f;
  for (int b = threadIdx.x; b < a.batch; b += blockDim.x) {
    wce += a.weights[b] * a.ce[b];
    clip += a.clip_mass[b];
    qsum += a.q_sum[b];
    qmin = fminf(qmin, a.q_min[b]);
    qmax = fmaxf(qmax, a.q_max[b]);
    if (a.q_bad[b] != 0) bad = 1.0f;
  }
  wce = BlockSum(wce, scratch);
  clip = BlockSum(clip, scratch);
  qsum = BlockSum(qsum, scratch);
  qmin = BlockMin(qmin, scratch);
  qmax = BlockMax(qmax, scratch);
  bad = BlockMax(bad, scratch);

  DeviceState* s = a.state;
  if (threadIdx.x == 0) {
    const float loss = wce / a.batch;
    const float norm = sqrtf(norm_sq);
    int32_t reason = step::kGuardNone;
    if (!isfinite(loss)) {
      reason = step::kGuardNonFiniteLoss;
    } else if (!isfinite(norm)) {
      reason = step::kGuardNonFiniteGrad;
    } else if (a.max_grad_norm > 0.0f && norm > a.max_grad_norm) {
      reason = step::kGuardGradNorm;
    } else if (bad > 0.0f || fmaxf(fabsf(qmin), fabsf(qmax)) > a.q_bound) {
      reason = step::kGuardQRange;
    }
    s->apply = reason == step::kGuardNone ? 1 : 0;
    s->clip_scale = a.clip_grad_norm > 0.0f ? fminf(1.0f, a.clip_grad_norm / (norm + 1e-6f)) : 1.0f;
    if (reason == step::kGuardNone) {
      const int64_t k = ++s->adam_updates;
      s->bias_correction1 = static_cast<float>(1.0 - pow(static_cast<double>(a.beta1), static_cast<double>(k)));
      s->bias_correction2 = static_cast<float>(1.0 - pow(static_cast<double>(a.beta2), static_cast<double>(k)));
      s->consecutive_trips = 0;
    } else {
      ++s->guard_trips[reason];
      ++s->consecutive_trips;
    }
    DeviceStats& st = s->stats;
    st.step = s->t + 1;
    st.loss = loss;
    st.grad_norm = norm;
    st.q_min = qmin;
    st.q_max = qmax;
    st.q_mean = qsum / (static_cast<float>(a.batch) * a.total_actions);
    st.target_clip_fraction = clip / (static_cast<float>(a.batch) * a.num_branches);
    st.guard = reason;
    st.applied = s->apply;
    sh_apply = s->apply;
  }
  __syncthreads();

  // 11. Priority write-back. One writer per slot, the largest b: the sampler's
  // indices are nondecreasing (per_sample.h), so a later b' with the same
  // index exists iff idx[b+1] == idx[b]. Should they ever not be sorted, the
  // block falls back to the O(B^2) scan for a later equal index (same owner).
  bool unsorted = false;
  for (int b = threadIdx.x; b + 1 < a.batch; b += blockDim.x) unsorted = unsorted || sh_idx[b] > sh_idx[b + 1];
  const bool sorted = __syncthreads_or(unsorted) == 0;
  const bool apply = sh_apply != 0;
  float pmax = 0.0f;
  if (apply) {
    for (int b = threadIdx.x; b < a.batch; b += blockDim.x) {
      const int32_t idx = sh_idx[b];
      bool later = sorted && b + 1 < a.batch && sh_idx[b + 1] == idx;
      for (int o = b + 1; !sorted && o < a.batch && !later; ++o) later = sh_idx[o] == idx;
      const float p = powf(a.ce[b] + a.priority_epsilon, a.alpha);
      pmax = fmaxf(pmax, p);
      if (!later) a.priorities[idx] = p;
    }
  }
  pmax = BlockMax(pmax, scratch);
  if (threadIdx.x == 0) {
    if (apply) s->max_priority = fmaxf(s->max_priority, pmax);
    s->t += 1;
  }
}

__global__ void __launch_bounds__(kThreads) AdamTargetKernel(AdamArgs a) {
  const DeviceState* s = a.state;
  const bool apply = s->apply != 0;
  const float scale = s->clip_scale;
  const float bc1 = s->bias_correction1;
  const float bc2 = s->bias_correction2;
  const int64_t t_next = s->t;  // already advanced by the finalize kernel
  const bool copy = a.target_period > 0 && t_next % a.target_period == 0;
  const bool ema = a.target_period <= 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < a.n; i += int64_t{gridDim.x} * blockDim.x) {
    float theta = a.params[i];
    if (apply) {
      const float g = a.grads[i] * scale;
      const float m = a.beta1 * a.m[i] + (1.0f - a.beta1) * g;
      const float v = a.beta2 * a.v[i] + (1.0f - a.beta2) * g * g;
      a.m[i] = m;
      a.v[i] = v;
      theta -= a.lr * (m / bc1) / (sqrtf(v / bc2) + a.epsilon);
      a.params[i] = theta;
    }
    if (copy) {
      a.target[i] = theta;
    } else if (ema) {
      const float tg = a.target[i];
      a.target[i] = tg + a.tau * (theta - tg);
    }
  }
}

int GridFor(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > 1056) blocks = 1056;  // 8 blocks per SM on 132 SMs; the rest is grid-stride
  return static_cast<int>(blocks);
}

}  // namespace

cudaError_t LaunchGradSumSquares(const float* grads, int64_t n, float* partials, cudaStream_t stream) {
  GradSumSquaresKernel<<<kNormBlocks, kThreads, 0, stream>>>(grads, n, partials);
  return cudaGetLastError();
}

cudaError_t LaunchFinalize(const FinalizeArgs& a, cudaStream_t stream) {
  FinalizeKernel<<<1, kFinalizeThreads, sizeof(int32_t) * a.batch, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchAdamTarget(const AdamArgs& a, cudaStream_t stream) {
  AdamTargetKernel<<<GridFor(a.n), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace qstream::kernels
