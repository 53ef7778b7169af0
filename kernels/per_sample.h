// Prioritized-replay sampling on the device (backend.h contract, step 1-2).
//
// Priorities are scanned as fixed-point integers: CUB's float scan may sum in
// a different order from run to run, an integer scan is exact, so the sampled
// indices are bitwise reproducible. Slot i carries round(p_i * 2^shift); a
// slot never written holds 0 and so is never the first prefix above u.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/views.h"

namespace qstream::kernels {

// Fixed-point shift that keeps the sum of `capacity` priorities, each below
// kMaxFixedPriority, inside 62 bits.
inline constexpr float kMaxFixedPriority = 4096.0f;
int FixedPointShift(int64_t capacity);

struct PrioritySampleArgs {
  const float* priorities = nullptr;  // capacity
  uint64_t* prefix = nullptr;         // capacity: inclusive scan of the fixed-point priorities
  void* scan_temp = nullptr;
  size_t scan_temp_bytes = 0;
  int64_t capacity = 0;
  int fixed_shift = 0;
  const DeviceState* state = nullptr;  // reads t and replay_size
  uint64_t seed = 0;
  int batch = 0;
  float beta_start = 0;
  float beta_end = 0;
  int64_t beta_anneal_steps = 0;
  int32_t* indices = nullptr;  // batch, written
  float* weights = nullptr;    // batch, written: IS weights / max
};

// Bytes of CUB temp storage the scan of `capacity` items needs (query once at set-up).
cudaError_t PriorityScanTempBytes(int64_t capacity, size_t* bytes);

// Three launches:
//  1. cub::DeviceScan::InclusiveSum over rint(p_i * 2^shift) (converted as
//     the scan reads, so no fixed-point copy is stored) into `prefix`, in the
//     temp storage allocated once at set-up.
//  2. StratifiedSample, one warp per sample (ceil(B/8) blocks of 8 warps):
//     u_b = (b + Uniform01(seed, t, b)) / B * total (double), idx_b = first j
//     in [0, capacity) with prefix_j > floor(u_b) (capacity when none; found
//     by a 32-ary search, log32(capacity) rounds of 32 parallel loads, the
//     same answer as a binary search), clamped to size-1;
//     w_b = (size p_idx / total)^-beta, beta = fma(beta_end - beta_start,
//     min(1, t / anneal_steps), beta_start) (beta_end when anneal_steps == 0).
//     Lane 0 of warp b alone writes indices[b] and the raw weights[b].
//  3. NormalizeWeights, one block: m = max(0, max_b w_b) (exact, fixed
//     shuffle tree, no atomics), then weights[b] = w_b / m.
// Every output is bitwise reproducible. indices is NONDECREASING in b (u_b
// increases with b since b + r_b < b + 1, the rounded double ops, floor, the
// search and the clamp are all monotone), so equal indices are adjacent: the
// priority write-back (step_finalize.h, LaunchFinalize) relies on this for its
// O(1) one-writer-per-slot rule.
// batch == 0 runs the scan only.
cudaError_t LaunchPrioritySample(const PrioritySampleArgs& args, cudaStream_t stream);

struct GatherArgs {
  ReplayColumns replay;
  const int32_t* indices = nullptr;  // batch
  int batch = 0;
  float* obs = nullptr;        // batch x obs_dim, written
  float* next_obs = nullptr;   // batch x obs_dim, written
  int32_t* actions = nullptr;  // batch x num_branches, written
  float* rewards = nullptr;    // batch, written
  float* discounts = nullptr;  // batch, written
};

// One warp per sampled row: lanes copy obs/next_obs features (strided by 32),
// lane < num_branches copies actions, lane 0 the reward and discount.
cudaError_t LaunchGather(const GatherArgs& args, cudaStream_t stream);

}  // namespace qstream::kernels
