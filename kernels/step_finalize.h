// The step's finalize stage (backend.h contract, steps 9 and 11), one block,
// because its jobs share the guard decision:
//   1. grad norm: the second, fixed-order stage over the norm partials;
//   2. loss reduction and Q / clip statistics over the batch;
//   3. the guard (first match wins) and its trip counters;
//   4. the clip scale and Adam's bias corrections for this step's update;
//   5. the priority write-back (skipped on a trip) and max priority;
//   6. the step counter t += 1.
// The Adam pass that follows (kernels/optimizer.h) reads its results from
// DeviceState.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/optimizer.h"
#include "kernels/views.h"

namespace qstream::kernels {

struct FinalizeArgs {
  const float* norm_partials = nullptr;  // kNormBlocks
  const float* ce = nullptr;             // B, CE_b from the loss kernel: the priorities
  // B, L_b from the loss kernel: the batch loss; null: the loss uses ce.
  const float* item_loss = nullptr;
  const float* weights = nullptr;        // B, raw IS weights: w_b / max(0, max w) weighs the loss
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
  // Data-parallel group: [loss, Q out of range (0/1)] averaged over the ranks
  // (LaunchGroupGuardInputs, then the all-reduce); the guard's loss and Q
  // tests read these instead of this rank's. Null: this rank alone.
  const float* group_guard = nullptr;
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
// L_b, Q min/mean/max, clip fraction (fixed-order block trees). Guard, first
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

// This rank's guard inputs for a group, one block with the reductions of
// LaunchFinalize: out[0] = (1/B) sum_b w_b L_b, out[1] = 1 when any Q is
// non-finite or |Q| > q_bound, else 0. The all-reduce (mean) of out[0..1]
// then gives every rank the same guard inputs (group_guard).
cudaError_t LaunchGroupGuardInputs(const FinalizeArgs& args, float* out, cudaStream_t stream);

}  // namespace qstream::kernels
