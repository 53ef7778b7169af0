// Deterministic warp and block reductions: a fixed butterfly (xor shuffle)
// inside each warp, then warp 0 combines the per-warp values in warp order.
// No atomics, so the result is bitwise the same on every run.
#pragma once

#include <cuda_runtime.h>

namespace qstream::kernels {

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct MinOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fminf(a, b); }
};

// Every lane returns the reduction of the 32 lanes.
template <typename Op>
__device__ __forceinline__ float WarpReduce(float v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float WarpSum(float v) { return WarpReduce(v, SumOp{}); }
__device__ __forceinline__ float WarpMax(float v) { return WarpReduce(v, MaxOp{}); }

// Every thread of the block returns the reduction; `scratch` holds one float
// per warp. blockDim.x must be a multiple of 32. Ends with a barrier, so the
// scratch can be reused right after.
template <typename Op>
__device__ __forceinline__ float BlockReduce(float v, float* scratch, Op op, float identity) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  v = WarpReduce(v, op);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < warps ? scratch[lane] : identity;
  r = WarpReduce(r, op);
  __syncthreads();
  return r;
}
__device__ __forceinline__ float BlockMax(float v, float* scratch) { return BlockReduce(v, scratch, MaxOp{}, -INFINITY); }
__device__ __forceinline__ float BlockMin(float v, float* scratch) { return BlockReduce(v, scratch, MinOp{}, INFINITY); }
__device__ __forceinline__ float BlockSum(float v, float* scratch) { return BlockReduce(v, scratch, SumOp{}, 0.0f); }

}  // namespace qstream::kernels
