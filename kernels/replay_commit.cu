#include "kernels/replay_commit.h"

#include "kernels/priority_sums.cuh"

namespace qstream::kernels {
namespace {

constexpr int kColumns = 6;  // obs, next_obs, actions, rewards, discounts, priorities
constexpr int kThreads = 256;

// With sums, block x of the priorities' column fills the new slots of chunk
// (first_chunk + x) mod chunks and sums it; x < touched_chunks.
__device__ void CommitPriorityChunk(const ReplayCommitArgs& a, int first_chunk, int touched_chunks) {
  const PrioritySums& s = a.sums;
  if (static_cast<int>(blockIdx.x) >= touched_chunks) return;  // whole blocks: the barriers stay uniform
  const int c = (first_chunk + static_cast<int>(blockIdx.x)) % s.chunks;
  const float fill = a.state->max_priority;
  const int64_t begin = int64_t{c} << s.chunk_log2;
  int64_t end = begin + (int64_t{1} << s.chunk_log2);
  if (end > a.ring.capacity) end = a.ring.capacity;
  for (int64_t slot = begin + threadIdx.x; slot < end; slot += blockDim.x) {
    int64_t from_first = slot - a.first_slot;
    if (from_first < 0) from_first += a.ring.capacity;
    if (from_first < a.count) a.ring.priorities[slot] = fill;
  }
  __syncthreads();  // the block's writes are visible to its reads below
  SumPriorityChunk(s, c);
}

__global__ void ReplayCommitKernel(ReplayCommitArgs a, int first_chunk, int touched_chunks) {
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
    default:
      if (a.sums.sums != nullptr) {
        CommitPriorityChunk(a, first_chunk, touched_chunks);
        return;
      }
      dst = reinterpret_cast<uint32_t*>(a.ring.priorities);
      break;
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
  // The chunks the new slots [first_slot, first_slot + count) mod capacity
  // fall in: contiguous mod chunks, all of them when the range wraps back
  // into its first chunk.
  int first_chunk = 0, touched_chunks = 0;
  if (a.sums.sums != nullptr) {
    const PrioritySums& s = a.sums;
    if (s.capacity != a.ring.capacity || s.priorities != a.ring.priorities || a.count < 1 ||
        a.count > a.ring.capacity) {
      return cudaErrorInvalidValue;
    }
    const int64_t last = (a.first_slot + a.count - 1) % a.ring.capacity;
    first_chunk = static_cast<int>(a.first_slot >> s.chunk_log2);
    const int last_chunk = static_cast<int>(last >> s.chunk_log2);
    int64_t n = a.first_slot + a.count <= a.ring.capacity ? int64_t{last_chunk} - first_chunk + 1
                                                          : int64_t{s.chunks} - first_chunk + last_chunk + 1;
    if (a.count == a.ring.capacity || n > s.chunks) n = s.chunks;
    touched_chunks = static_cast<int>(n);
    if (blocks < touched_chunks) blocks = touched_chunks;
  }
  ReplayCommitKernel<<<dim3(static_cast<unsigned>(blocks), kColumns), kThreads, 0, stream>>>(a, first_chunk,
                                                                                             touched_chunks);
  return cudaGetLastError();
}

}  // namespace qstream::kernels
