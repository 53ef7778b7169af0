// Device side of kernels/per_sample.h's PrioritySums: one chunk's sums by one
// block, shared by the sums kernel, the replay's commit kernel and the step's
// Adam kernel (which keep them current).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/per_sample.h"

namespace qstream::kernels {

inline constexpr int kPrioritySubChunks = 32;  // per chunk, one per lane of the sampler's search

// p -> round(p * 2^shift). Scaling by a power of two is exact; only the
// rounding to an integer rounds (p * 2^shift < 2^42 is exact in float).
__device__ __forceinline__ uint64_t ToFixed(float p, float scale) {
  return static_cast<uint64_t>(rintf(p * scale));
}

__device__ __forceinline__ uint64_t WarpSumU64(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The whole block (a multiple of 32 threads; uniform call): the sum of
// ToFixed over each of chunk c's 32 sub-chunks (2^(chunk_log2 - 5) slots each,
// read coalesced by one warp) into sums[chunks + c * 32 + j], then chunk c's
// total into sums[c]. Slots at or past capacity count 0. Exact integers, so
// the order does not matter. Reads the priorities the block wrote before it
// (after a barrier) or that kernels before it wrote.
__device__ __forceinline__ void SumPriorityChunk(const PrioritySums& s, int c) {
  __shared__ uint64_t sub_sums[kPrioritySubChunks];
  __syncthreads();  // a previous call's reads of sub_sums are done
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  const int64_t sub_len = int64_t{1} << (s.chunk_log2 - 5);
  for (int j = warp; j < kPrioritySubChunks; j += warps) {
    const int64_t begin = (int64_t{c} << s.chunk_log2) + j * sub_len;
    uint64_t sum = 0;
    // One slot per lane per round (sub_len is 32 up to 2^20 slots): a
    // conversion to u64 is slow, so none is spent on padding.
    for (int64_t off = lane; off < sub_len; off += 32) {
      if (begin + off < s.capacity) sum += ToFixed(s.priorities[begin + off], s.scale);
    }
    sum = WarpSumU64(sum);
    if (lane == 0) {
      sub_sums[j] = sum;
      s.sums[s.chunks + int64_t{c} * kPrioritySubChunks + j] = sum;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t t = 0;
    for (int j = 0; j < kPrioritySubChunks; ++j) t += sub_sums[j];
    s.sums[c] = t;
  }
}

}  // namespace qstream::kernels
