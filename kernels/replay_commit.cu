#include "kernels/replay_commit.h"

namespace qstream::kernels {
namespace {

__global__ void ReplayCommitKernel(ReplayCommitArgs a) {
  const float p = a.state->max_priority;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < a.count; i += int64_t{gridDim.x} * blockDim.x) {
    int64_t slot = a.first_slot + i;
    if (slot >= a.capacity) slot -= a.capacity;
    a.priorities[slot] = p;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    a.state->replay_size = a.new_size;
    a.state->replay_cursor = a.new_cursor;
  }
}

}  // namespace

cudaError_t LaunchReplayCommit(const ReplayCommitArgs& a, cudaStream_t stream) {
  const int threads = 256;
  int64_t blocks = (a.count + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  if (blocks > 1024) blocks = 1024;
  ReplayCommitKernel<<<static_cast<int>(blocks), threads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace qstream::kernels
