#include "kernels/step_finalize.h"

#include "kernels/is_weight.cuh"
#include "kernels/launch.cuh"
#include "kernels/warp_reduce.cuh"

namespace qstream::kernels {
namespace {

constexpr int kFinalizeThreads = 1024;

// The batch reductions of the finalize stage, fixed-order block trees; every
// thread gets the results.
struct BatchSums {
  float wloss = 0.0f, clip = 0.0f, qsum = 0.0f, qmin = INFINITY, qmax = -INFINITY, bad = 0.0f;

  __device__ float loss(int batch) const { return wloss / batch; }
  __device__ bool q_out_of_range(float q_bound) const {
    return bad > 0.0f || fmaxf(fabsf(qmin), fabsf(qmax)) > q_bound;
  }
};

__device__ BatchSums ReduceBatch(const FinalizeArgs& a, float* scratch) {
  const float* item_loss = a.item_loss != nullptr ? a.item_loss : a.ce;
  const float w_max = MaxIsWeight(a.weights, a.batch, scratch);
  BatchSums r;
  for (int b = threadIdx.x; b < a.batch; b += blockDim.x) {
    r.wloss += (a.weights[b] / w_max) * item_loss[b];
    r.clip += a.clip_mass[b];
    r.qsum += a.q_sum[b];
    r.qmin = fminf(r.qmin, a.q_min[b]);
    r.qmax = fmaxf(r.qmax, a.q_max[b]);
    if (a.q_bad[b] != 0) r.bad = 1.0f;
  }
  r.wloss = BlockSum(r.wloss, scratch);
  r.clip = BlockSum(r.clip, scratch);
  r.qsum = BlockSum(r.qsum, scratch);
  r.qmin = BlockMin(r.qmin, scratch);
  r.qmax = BlockMax(r.qmax, scratch);
  r.bad = BlockMax(r.bad, scratch);
  return r;
}

__global__ void __launch_bounds__(kFinalizeThreads) GroupGuardInputsKernel(FinalizeArgs a, float* out) {
  WaitForPredecessor();
  __shared__ float scratch[kFinalizeThreads / 32];
  const BatchSums r = ReduceBatch(a, scratch);
  if (threadIdx.x == 0) {
    out[0] = r.loss(a.batch);
    out[1] = r.q_out_of_range(a.q_bound) ? 1.0f : 0.0f;
  }
}

__global__ void __launch_bounds__(kFinalizeThreads) FinalizeKernel(FinalizeArgs a) {
  WaitForPredecessor();
  extern __shared__ int32_t sh_idx[];  // B
  __shared__ float scratch[kFinalizeThreads / 32];
  __shared__ int32_t sh_apply;
  for (int b = threadIdx.x; b < a.batch; b += blockDim.x) sh_idx[b] = a.indices[b];
  float norm_sq = 0.0f;
  for (int i = threadIdx.x; i < kNormBlocks; i += blockDim.x) norm_sq += a.norm_partials[i];
  norm_sq = BlockSum(norm_sq, scratch);
  const BatchSums r = ReduceBatch(a, scratch);
  const float qmin = r.qmin, qmax = r.qmax;

  DeviceState* s = a.state;
  if (threadIdx.x == 0) {
    const float loss = r.loss(a.batch);
    const float norm = sqrtf(norm_sq);
    // In a group the loss and Q tests read the group's values, so every rank
    // takes the same decision (the norm is of the all-reduced gradient).
    const float guard_loss = a.group_guard != nullptr ? a.group_guard[0] : loss;
    const bool q_out = a.group_guard != nullptr ? a.group_guard[1] > 0.0f : r.q_out_of_range(a.q_bound);
    int32_t reason = step::kGuardNone;
    if (!isfinite(guard_loss)) {
      reason = step::kGuardNonFiniteLoss;
    } else if (!isfinite(norm)) {
      reason = step::kGuardNonFiniteGrad;
    } else if (a.max_grad_norm > 0.0f && norm > a.max_grad_norm) {
      reason = step::kGuardGradNorm;
    } else if (q_out) {
      reason = step::kGuardQRange;
    }
    s->apply = reason == step::kGuardNone ? 1 : 0;
    s->clip_scale = a.clip_grad_norm > 0.0f ? fminf(1.0f, a.clip_grad_norm / (norm + 1e-6f)) : 1.0f;
    if (reason == step::kGuardNone) {
      const int64_t k = ++s->adam_updates;
      s->bias_correction1 =
          static_cast<float>(1.0 - pow(static_cast<double>(a.beta1), static_cast<double>(k)));
      s->bias_correction2 =
          static_cast<float>(1.0 - pow(static_cast<double>(a.beta2), static_cast<double>(k)));
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
    st.q_mean = r.qsum / (static_cast<float>(a.batch) * a.total_actions);
    st.target_clip_fraction = r.clip / (static_cast<float>(a.batch) * a.num_branches);
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
  for (int b = threadIdx.x; b + 1 < a.batch; b += blockDim.x)
    unsorted = unsorted || sh_idx[b] > sh_idx[b + 1];
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

}  // namespace

cudaError_t LaunchGroupGuardInputs(const FinalizeArgs& a, float* out, cudaStream_t stream) {
  return LaunchDependent(StepKernel::kFinalize, GroupGuardInputsKernel, 1, kFinalizeThreads, 0, stream, a,
                         out);
}

cudaError_t LaunchFinalize(const FinalizeArgs& a, cudaStream_t stream) {
  return LaunchDependent(StepKernel::kFinalize, FinalizeKernel, 1, kFinalizeThreads,
                         sizeof(int32_t) * a.batch, stream, a);
}

}  // namespace qstream::kernels
