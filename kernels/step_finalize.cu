#include "kernels/step_finalize.h"

#include "kernels/launch.cuh"
#include "kernels/warp_reduce.cuh"

namespace qstream::kernels {
namespace {

constexpr int kFinalizeThreads = 1024;

// The batch reductions of the finalize stage, fixed-order block trees; every
// thread gets the results.
struct BatchSums {
  float wloss = 0.0f, clip = 0.0f, qsum = 0.0f, qmin = INFINITY, qmax = -INFINITY, bad = 0.0f;
  // Reduced in the same pass: the squared grad norm (a sum of the partials)
  // and whether the sampled indices are out of order (a max of 0/1).
  float norm_sq = 0.0f, unsorted = 0.0f;

  __device__ float loss(int batch) const { return wloss / batch; }
  __device__ bool q_out_of_range(float q_bound) const {
    return bad > 0.0f || fmaxf(fabsf(qmin), fabsf(qmax)) > q_bound;
  }
};

// All loads first, then two block reductions: everything that does not need
// the largest IS weight, then the weighted loss, which does. Each value is
// accumulated per thread in the same order and reduced by the same trees as
// one BlockSum/BlockMax each would, so the bits are those of separate passes.
// With `norm_partials` the norm's partials; with `indices` the order check
// (idx[b] > idx[b + 1] for some b).
__device__ BatchSums ReduceBatch(const FinalizeArgs& a, const float* norm_partials, const int32_t* indices,
                                 float (*scratch)[32]) {
  const float* item_loss = a.item_loss != nullptr ? a.item_loss : a.ce;
  BatchSums r;
  if (norm_partials != nullptr) {
    for (int i = threadIdx.x; i < kNormBlocks; i += blockDim.x) r.norm_sq += norm_partials[i];
  }
  float w_max = 0.0f;
  for (int b = threadIdx.x; b < a.batch; b += blockDim.x) {
    w_max = fmaxf(w_max, a.weights[b]);
    r.clip += a.clip_mass[b];
    r.qsum += a.q_sum[b];
    r.qmin = fminf(r.qmin, a.q_min[b]);
    r.qmax = fmaxf(r.qmax, a.q_max[b]);
    if (a.q_bad[b] != 0) r.bad = 1.0f;
    if (indices != nullptr && b + 1 < a.batch && indices[b] > indices[b + 1]) r.unsorted = 1.0f;
  }
  float first[] = {r.norm_sq, w_max, r.clip, r.qsum, r.qmin, r.qmax, r.bad, r.unsorted};
  constexpr ReduceOp kFirstOps[] = {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kSum, ReduceOp::kSum,
                                    ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kMax, ReduceOp::kMax};
  BlockReduceMany(first, kFirstOps, scratch);
  r.norm_sq = first[0];
  w_max = first[1];  // MaxIsWeight's m (is_weight.cuh): max(0, max_b w_b)
  r.clip = first[2];
  r.qsum = first[3];
  r.qmin = first[4];
  r.qmax = first[5];
  r.bad = first[6];
  r.unsorted = first[7];
  float wloss = 0.0f;
  for (int b = threadIdx.x; b < a.batch; b += blockDim.x) wloss += (a.weights[b] / w_max) * item_loss[b];
  float second[] = {wloss};
  constexpr ReduceOp kSecondOps[] = {ReduceOp::kSum};
  BlockReduceMany(second, kSecondOps, scratch);
  r.wloss = second[0];
  return r;
}

constexpr int kReduceValues = 8;

__global__ void __launch_bounds__(kFinalizeThreads) GroupGuardInputsKernel(FinalizeArgs a, float* out) {
  WaitForPredecessor();
  __shared__ float scratch[kReduceValues][32];
  const BatchSums r = ReduceBatch(a, nullptr, nullptr, scratch);
  if (threadIdx.x == 0) {
    out[0] = r.loss(a.batch);
    out[1] = r.q_out_of_range(a.q_bound) ? 1.0f : 0.0f;
  }
}

__global__ void __launch_bounds__(kFinalizeThreads) FinalizeKernel(FinalizeArgs a) {
  WaitForPredecessor();
  extern __shared__ int32_t sh_idx[];  // B
  __shared__ float scratch[kReduceValues][32];
  __shared__ int32_t sh_apply;
  for (int b = threadIdx.x; b < a.batch; b += blockDim.x) sh_idx[b] = a.indices[b];
  const BatchSums r = ReduceBatch(a, a.norm_partials, a.indices, scratch);  // its barriers publish sh_idx
  const float norm_sq = r.norm_sq;
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
  const bool sorted = r.unsorted == 0.0f;
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
  pmax = BlockMax(pmax, scratch[0]);
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
