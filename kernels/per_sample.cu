#include "kernels/per_sample.h"

#include <cub/device/device_scan.cuh>
#include <thrust/iterator/transform_iterator.h>

#include <cmath>

#include "common/rng.h"
#include "kernels/warp_reduce.cuh"

namespace qstream::kernels {
namespace {

constexpr int kSampleThreads = 256;  // 8 warps: one sample per warp
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr int kNormalizeThreads = 1024;
constexpr int kGatherThreads = 256;

// p -> round(p * 2^shift). Scaling by a power of two is exact; only the
// rounding to an integer rounds (p * 2^shift < 2^42 is exact in float).
struct ToFixed {
  float scale;
  __host__ __device__ uint64_t operator()(float p) const { return static_cast<uint64_t>(rintf(p * scale)); }
};

using FixedIterator = thrust::transform_iterator<ToFixed, const float*, uint64_t>;

// beta annealed linearly from beta_start to beta_end over beta_anneal_steps.
// The fmaf spells out the contraction nvcc made of start + diff * frac, so a
// host reference (std::fma) reproduces it bit for bit.
__device__ __forceinline__ float AnnealedBeta(const PrioritySampleArgs& a, int64_t t) {
  if (a.beta_anneal_steps == 0) return a.beta_end;
  const float frac = fminf(1.0f, static_cast<float>(t) / static_cast<float>(a.beta_anneal_steps));
  return fmaf(a.beta_end - a.beta_start, frac, a.beta_start);
}

// First j in [0, n) with prefix[j] > u, or n when there is none: a binary
// search's answer, found by a 32-ary search. Called by a whole warp with the
// same (prefix, n, u); every lane returns the answer.
//
// Invariant: every prefix before lo is <= u, and hi == n or prefix[hi] > u,
// so the answer lies in [lo, hi]. Each round splits [lo, hi) into 32
// contiguous sub-ranges [lo + k len/32, lo + (k+1) len/32); lane k loads the
// last prefix of sub-range k (one load per lane, all in flight together) and
// the first non-empty sub-range whose last prefix is > u holds the answer
// (every prefix in the sub-ranges before it is <= u). A sub-range of length m
// leaves [begin, begin + m - 1], so len -> at most ceil(len / 32) - 1: 2^20
// slots take 4 rounds and 2^24 take 5 (a binary search: 20 and 24 dependent
// loads).
__device__ __forceinline__ int64_t WarpUpperBound(const uint64_t* __restrict__ prefix, int64_t n, uint64_t u,
                                                  int lane) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {  // warp-uniform: every lane holds the same lo and hi
    const int64_t len = hi - lo;
    const int64_t begin = lo + (lane * len) / 32;
    const int64_t end = lo + ((lane + 1) * len) / 32;
    const bool above = end > begin && prefix[end - 1] > u;
    const unsigned ballot = __ballot_sync(0xffffffffu, above);
    if (ballot == 0u) return hi;  // every prefix in [lo, hi) is <= u
    const int k = __ffs(static_cast<int>(ballot)) - 1;
    const int64_t next_lo = lo + (k * len) / 32;
    hi = lo + ((k + 1) * len) / 32 - 1;  // lane k's load: prefix[hi] > u
    lo = next_lo;
  }
  return lo;
}

// One warp per sample b; lane 0 alone writes indices[b] and the raw weight
// weights[b] = (size p / total)^-beta (normalised by the next kernel).
__global__ void __launch_bounds__(kSampleThreads) StratifiedSampleKernel(PrioritySampleArgs a) {
  const int lane = threadIdx.x % 32;
  const int b = blockIdx.x * kSampleWarps + threadIdx.x / 32;
  if (b >= a.batch) return;  // the whole warp leaves together: the ballots see 32 lanes
  const int64_t t = a.state->t;
  const int64_t size = a.state->replay_size;
  const uint64_t total = a.prefix[a.capacity - 1];
  const float r = qstream::Uniform01(a.seed, static_cast<uint64_t>(t), static_cast<uint64_t>(b));
  const double u = (static_cast<double>(b) + r) / a.batch * static_cast<double>(total);
  // prefix is integer, so prefix[j] > u <=> prefix[j] > floor(u).
  const uint64_t u_int = static_cast<uint64_t>(floor(u));
  const int64_t j = WarpUpperBound(a.prefix, a.capacity, u_int, lane);
  if (lane != 0) return;
  const int64_t idx = j < size ? j : size - 1;
  const double scale = ldexp(1.0, a.fixed_shift);
  const double total_real = static_cast<double>(total) / scale;
  const float beta = AnnealedBeta(a, t);
  const double prob = static_cast<double>(a.priorities[idx]) / total_real;
  a.indices[b] = static_cast<int32_t>(idx);
  a.weights[b] = static_cast<float>(pow(static_cast<double>(size) * prob, -static_cast<double>(beta)));
}

// One block: m = max(0, max_b w_b) by a fixed shuffle tree (a max is exact,
// so m is bit for bit the single-block sampler's), then w_b /= m. Each thread
// rescales only the weights it read itself, after the block's barrier.
__global__ void __launch_bounds__(kNormalizeThreads) NormalizeWeightsKernel(float* __restrict__ w, int batch) {
  __shared__ float warp_max[kNormalizeThreads / 32];
  float local_max = 0.0f;
  for (int b = threadIdx.x; b < batch; b += blockDim.x) local_max = fmaxf(local_max, w[b]);
  const float m = BlockMax(local_max, warp_max);
  for (int b = threadIdx.x; b < batch; b += blockDim.x) w[b] = w[b] / m;
}

__global__ void GatherKernel(GatherArgs a) {
  const int warps = blockDim.x / 32;
  const int row = blockIdx.x * warps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.batch) return;
  const int64_t slot = a.indices[row];
  const int d = a.replay.obs_dim;
  const float* src = a.replay.obs + slot * d;
  const float* nsrc = a.replay.next_obs + slot * d;
  for (int i = lane; i < d; i += 32) {
    a.obs[int64_t{row} * d + i] = src[i];
    a.next_obs[int64_t{row} * d + i] = nsrc[i];
  }
  const int nb = a.replay.num_branches;
  for (int i = lane; i < nb; i += 32) a.actions[row * nb + i] = a.replay.actions[slot * nb + i];
  if (lane == 0) {
    a.rewards[row] = a.replay.rewards[slot];
    a.discounts[row] = a.replay.discounts[slot];
  }
}

}  // namespace

int FixedPointShift(int64_t capacity) {
  int log2c = 0;
  while ((int64_t{1} << log2c) < capacity) ++log2c;
  return 62 - log2c - static_cast<int>(std::log2(kMaxFixedPriority));
}

cudaError_t PriorityScanTempBytes(int64_t capacity, size_t* bytes) {
  *bytes = 0;
  const FixedIterator in(static_cast<const float*>(nullptr), ToFixed{1.0f});
  return cub::DeviceScan::InclusiveSum(nullptr, *bytes, in, static_cast<uint64_t*>(nullptr), capacity);
}

cudaError_t LaunchPrioritySample(const PrioritySampleArgs& a, cudaStream_t stream) {
  const FixedIterator in(a.priorities, ToFixed{std::ldexp(1.0f, a.fixed_shift)});
  size_t temp_bytes = a.scan_temp_bytes;
  cudaError_t err = cub::DeviceScan::InclusiveSum(a.scan_temp, temp_bytes, in, a.prefix, a.capacity, stream);
  if (err != cudaSuccess) return err;
  if (a.batch <= 0) return cudaSuccess;
  StratifiedSampleKernel<<<(a.batch + kSampleWarps - 1) / kSampleWarps, kSampleThreads, 0, stream>>>(a);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  NormalizeWeightsKernel<<<1, kNormalizeThreads, 0, stream>>>(a.weights, a.batch);
  return cudaGetLastError();
}

cudaError_t LaunchGather(const GatherArgs& a, cudaStream_t stream) {
  const int rows_per_block = kGatherThreads / 32;
  GatherKernel<<<(a.batch + rows_per_block - 1) / rows_per_block, kGatherThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace qstream::kernels
