// The tail of the learner step (backend.h contract, steps 9-11), over the one
// flat parameter buffer: global grad norm (two-stage, no atomics), guard and
// statistics, clip + Adam + target update in one pass, priority write-back.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/views.h"

namespace qstream::kernels {

// Blocks of the first norm stage; fixed so the summation order is fixed.
inline constexpr int kNormBlocks = 256;

// Stage 1: block k sums g_i^2 over the contiguous chunk k of n/kNormBlocks
// elements (threads strided inside it, then a fixed block tree) and alone
// writes partials[k]. Grid: kNormBlocks x 256.
cudaError_t LaunchGradSumSquares(const float* grads, int64_t n, float* partials, cudaStream_t stream);

struct FinalizeArgs {
  const float* norm_partials = nullptr;  // kNormBlocks
  const float* ce = nullptr;             // B, from the loss kernel
  const float* weights = nullptr;        // B
  const float* clip_mass = nullptr;      // B
  const float* q_min = nullptr;          // B
  const float* q_max = nullptr;          // B
  const float* q_sum = nullptr;          // B
  const int32_t* q_bad = nullptr;        // B
  int batch = 0;
  int num_branches = 0;
  int total_actions = 0;
  float max_grad_norm = 0;   // guard; <= 0 disables
  float q_bound = 0;         // guard: largest allowed |Q|
  float clip_grad_norm = 0;  // <= 0 disables
  float beta1 = 0;
  float beta2 = 0;
  // Priority write-back (step 11).
  float* priorities = nullptr;       // replay capacity
  const int32_t* indices = nullptr;  // B
  float priority_epsilon = 0;
  float alpha = 0;
  DeviceState* state = nullptr;
};

// Stage 2 + guard + priority write-back, one block (they share the guard
// decision, so one launch): norm = sqrt(sum partials), loss = (1/B) sum w_b
// CE_b, Q min/mean/max, clip fraction (fixed-order block trees). Guard, first
// match wins: non-finite loss, non-finite norm, norm > max_grad_norm, Q
// non-finite or |Q| > q_bound. Thread 0 alone writes state: apply flag, clip
// scale min(1, clip / (norm + 1e-6)), Adam's k and bias corrections, stats,
// trips. Then, when the guard passed, p_b = (CE_b + eps)^alpha is written to
// priorities[idx_b] by thread b unless a later b' has the same index (largest
// b wins: one writer per slot), max_priority = max(max_priority, max_b p_b),
// and thread 0 advances the step counter t (so the Adam pass after this
// kernel sees t + 1). The owner test relies on the sampler's indices being
// NONDECREASING in b (per_sample.h, LaunchPrioritySample): duplicates are then
// adjacent and b writes iff b == B-1 or idx[b+1] != idx[b], O(1) per sample.
// A block-wide check (one pass, __syncthreads_or) falls back to the O(B^2)
// scan for a later equal index when they are not sorted, with the same owner.
cudaError_t LaunchFinalize(const FinalizeArgs& args, cudaStream_t stream);

struct AdamArgs {
  float* params = nullptr;
  const float* grads = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  float* target = nullptr;
  int64_t n = 0;
  float lr = 0;
  float beta1 = 0;
  float beta2 = 0;
  float epsilon = 0;
  float tau = 0;
  int32_t target_period = 0;  // > 0: hard copy every period steps; 0: EMA
  const DeviceState* state = nullptr;
};

// One pass, thread i (grid-stride) owns element i: when the guard passed,
// g = grads[i] * clip_scale; m, v, theta Adam update with the step's bias
// corrections; then (tripped or not) the target: copy when period > 0 and
// (t+1) % period == 0 (state->t already holds t+1 here), EMA
// target += tau (theta - target) when period == 0.
cudaError_t LaunchAdamTarget(const AdamArgs& args, cudaStream_t stream);

}  // namespace qstream::kernels
