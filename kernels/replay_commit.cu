#include "kernels/replay_commit.h"

namespace qstream::kernels {
namespace {

constexpr int kColumns = 6;  // obs, next_obs, actions, rewards, discounts, priorities
constexpr int kThreads = 256;

__global__ void ReplayCommitKernel(ReplayCommitArgs a) {
  const int column = blockIdx.y;
  const int d = a.ring.obs_dim;
  const uint32_t* src = nullptr;  // nullptr: the priorities (a fill, not a copy)
  uint32_t* dst = nullptr;
  int width = 1;
  switch (column) {
    case 0:
      src = reinterpret_cast<const uint32_t*>(a.staged.obs), dst = reinterpret_cast<uint32_t*>(a.ring.obs);
      width = d;
      break;
    case 1:
      src = reinterpret_cast<const uint32_t*>(a.staged.next_obs);
      dst = reinterpret_cast<uint32_t*>(a.ring.next_obs);
      width = d;
      break;
    case 2:
      src = reinterpret_cast<const uint32_t*>(a.staged.actions);
      dst = reinterpret_cast<uint32_t*>(a.ring.actions);
      width = a.ring.num_branches;
      break;
    case 3:
      src = reinterpret_cast<const uint32_t*>(a.staged.rewards);
      dst = reinterpret_cast<uint32_t*>(a.ring.rewards);
      break;
    case 4:
      src = reinterpret_cast<const uint32_t*>(a.staged.discounts);
      dst = reinterpret_cast<uint32_t*>(a.ring.discounts);
      break;
    default: dst = reinterpret_cast<uint32_t*>(a.ring.priorities); break;
  }
  const int64_t words = a.count * width;
  const int64_t ring_words = a.ring.capacity * width;
  const int64_t first = a.first_slot * width;
  const uint32_t fill = src == nullptr ? __float_as_uint(a.state->max_priority) : 0u;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < words;
       e += int64_t{gridDim.x} * blockDim.x) {
    int64_t at = first + e;
    if (at >= ring_words) at -= ring_words;
    dst[at] = src == nullptr ? fill : src[e];
  }
  if (blockIdx.x == 0 && column == 0 && threadIdx.x == 0) {
    a.state->replay_size = a.new_size;
    a.state->replay_cursor = a.new_cursor;
  }
}

}  // namespace

cudaError_t LaunchReplayCommit(const ReplayCommitArgs& a, cudaStream_t stream) {
  // Blocks for the widest column; narrower ones stride less or idle.
  const int64_t widest =
      a.count * (a.ring.obs_dim > a.ring.num_branches ? a.ring.obs_dim : a.ring.num_branches);
  int64_t blocks = (widest + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > 512) blocks = 512;
  ReplayCommitKernel<<<dim3(static_cast<unsigned>(blocks), kColumns), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace qstream::kernels
