// Moves an uploaded chunk of transitions from the device staging buffer into
// the replay ring and commits it, as one kernel on the learner stream: the
// columns are copied to the ring at the cursor (wrapping at most once), the
// new slots get the current max priority and the device-resident size and
// cursor advance, all in stream order with the step's graph replays.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/views.h"

namespace qstream::kernels {

// The staging buffer's layout: five regions of `stride_rows` rows each, one
// per column, rows [0, count) filled: obs (obs_dim words per row), next_obs
// (obs_dim), actions (num_branches), rewards (1), discounts (1); 32-bit words.
struct StagedRows {
  const float* obs = nullptr;
  const float* next_obs = nullptr;
  const int32_t* actions = nullptr;
  const float* rewards = nullptr;
  const float* discounts = nullptr;
};

struct ReplayCommitArgs {
  StagedRows staged;
  ReplayColumns ring;      // capacity, obs_dim and num_branches as the staging's
  int64_t first_slot = 0;  // ring slot of the first new item
  int64_t count = 0;       // new items (1 ..= capacity), slots first_slot.. wrapping
  int64_t new_size = 0;
  int64_t new_cursor = 0;
  DeviceState* state = nullptr;
};

// One launch: blockIdx.y picks the column (five copies and the priorities);
// grid-stride over the column's count x width words, element e goes to ring
// word first_slot x width + e (less capacity x width past the end).
// Thread 0 of block (0, 0) writes replay_size / replay_cursor (no other thread
// reads them in this launch; the priorities read max_priority only).
cudaError_t LaunchReplayCommit(const ReplayCommitArgs& args, cudaStream_t stream);

}  // namespace qstream::kernels
