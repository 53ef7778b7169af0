// Prioritized-replay sampling and the gather of the sampled rows on the
// device (backend.h contract, steps 1-2).
//
// Priorities are summed as fixed-point integers: slot i carries
// round(p_i * 2^shift), and integer sums are exact in any order, so the
// sampled indices are bitwise reproducible without a stored prefix array. A
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

// The slots are summed in chunks of 2^PriorityChunkLog2(capacity) slots (at
// least 1024, and at most kMaxPriorityChunks chunks): the sampler's blocks
// each scan the chunk sums in shared memory.
inline constexpr int kMaxPriorityChunks = 2048;
int PriorityChunkLog2(int64_t capacity);
int64_t PriorityChunks(int64_t capacity);
// uint64 words of the sums' scratch: the chunk sums, then 32 sub-chunk sums per chunk.
int64_t PrioritySumWords(int64_t capacity);

struct PrioritySampleArgs {
  // Priorities (already ^alpha) and, when obs is set, the columns to gather.
  ReplayColumns replay;
  uint64_t* sums = nullptr;  // PrioritySumWords(capacity), scratch
  int fixed_shift = 0;
  const DeviceState* state = nullptr;  // reads t and replay_size
  uint64_t seed = 0;
  int batch = 0;
  float beta_start = 0;
  float beta_end = 0;
  int64_t beta_anneal_steps = 0;
  int32_t* indices = nullptr;  // batch, written
  float* weights = nullptr;    // batch, written: the raw IS weights (see below)
  // The gather (step 2), or null to sample only.
  float* obs = nullptr;        // batch x obs_dim, written
  float* next_obs = nullptr;   // batch x obs_dim, written
  int32_t* actions = nullptr;  // batch x num_branches, written
  float* rewards = nullptr;    // batch, written
  float* discounts = nullptr;  // batch, written
};

// Two launches, no stored prefix and no temp storage:
//  1. ChunkSums, one block per chunk: the sum of rint(p_i * 2^shift)
//     (exact, uint64) over each of the chunk's 32 sub-chunks, and over the
//     chunk.
//  2. StratifiedSample, one warp per sample (ceil(B/8) blocks of 8 warps).
//     Each block first scans the chunk sums into shared memory (the chunk
//     prefix; total = its last entry). Then per sample b:
//     u_b = (b + Uniform01(seed, t, b)) / B * total (double), idx_b = first j
//     in [0, capacity) with prefix_j > floor(u_b), where prefix is the
//     inclusive fixed-point prefix over the slots (capacity when none),
//     clamped to size-1. The chunk is found by a 32-ary search of the chunk
//     prefix, the sub-chunk by a warp scan of its 32 sums and a ballot, then
//     the slot by splitting the sub-chunk the same way (one lane's sum of a
//     contiguous run each) until one slot per lane is left: the same answer as
//     a binary search of the full prefix, bit for bit.
//     w_b = (size p_idx / total)^-beta, beta = fma(beta_end - beta_start,
//     min(1, t / anneal_steps), beta_start) (beta_end when anneal_steps == 0),
//     written RAW: every consumer (the loss kernel, the finalize) divides by
//     m = max(0, max_b w_b) itself (is_weight.cuh, MaxIsWeight), so no launch
//     is spent on the normalisation.
//     With obs set, the same warp then copies row idx_b: obs/next_obs features
//     (strided by 32 lanes), the actions, the reward and the discount.
// Every output is bitwise reproducible. indices is NONDECREASING in b (u_b
// increases with b since b + r_b < b + 1, the rounded double ops, floor, the
// search and the clamp are all monotone), so equal indices are adjacent: the
// priority write-back (step_finalize.h, LaunchFinalize) relies on this for its
// O(1) one-writer-per-slot rule.
// batch == 0 runs the chunk sums only.
cudaError_t LaunchPrioritySample(const PrioritySampleArgs& args, cudaStream_t stream);

}  // namespace qstream::kernels
