// Commits an insert into the device replay after its columns were copied:
// the new slots get the current max priority and the device-resident size and
// cursor advance, all in stream order with the step's graph replays.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/views.h"

namespace qstream::kernels {

struct ReplayCommitArgs {
  float* priorities = nullptr;  // capacity
  int64_t capacity = 0;
  int64_t first_slot = 0;  // ring slot of the first new item
  int64_t count = 0;       // new items (<= capacity), slots first_slot.. wrapping
  int64_t new_size = 0;
  int64_t new_cursor = 0;
  DeviceState* state = nullptr;
};

// Grid-stride, thread i writes priorities[(first_slot + i) % capacity] =
// state->max_priority; thread 0 of block 0 writes replay_size / replay_cursor
// (no other thread reads them in this launch).
cudaError_t LaunchReplayCommit(const ReplayCommitArgs& args, cudaStream_t stream);

}  // namespace qstream::kernels
