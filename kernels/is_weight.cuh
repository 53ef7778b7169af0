// Importance-sampling weights arrive raw from the sampler (per_sample.h):
// w_b = (size p_b / total)^-beta. Every consumer normalises them by
// m = max(0, max_b w_b) itself, with this one function, so the normalised
// weight w_b / m has the same bits in every kernel (a max is exact in any
// order) and no launch of its own.
#pragma once

#include "kernels/warp_reduce.cuh"

namespace qstream::kernels {

// m over the batch; every thread of the block gets it. `scratch`: one float
// per warp (BlockMax). Ends with a barrier.
__device__ __forceinline__ float MaxIsWeight(const float* __restrict__ w, int batch, float* scratch) {
  float m = 0.0f;
  for (int b = threadIdx.x; b < batch; b += blockDim.x) m = fmaxf(m, w[b]);
  return BlockMax(m, scratch);
}

}  // namespace qstream::kernels
