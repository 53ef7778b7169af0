#include "kernels/per_sample.h"

#include <cub/device/device_scan.cuh>
#include <thrust/iterator/transform_iterator.h>

#include <cmath>

#include "kernels/warp_reduce.cuh"
#include "trainer/rng.h"

namespace qstream::kernels {
namespace {

constexpr int kSampleThreads = 1024;
constexpr int kGatherThreads = 256;

// p -> round(p * 2^shift). Scaling by a power of two is exact; only the
// rounding to an integer rounds (p * 2^shift < 2^42 is exact in float).
struct ToFixed {
  float scale;
  __host__ __device__ uint64_t operator()(float p) const { return static_cast<uint64_t>(rintf(p * scale)); }
};

using FixedIterator = thrust::transform_iterator<ToFixed, const float*, uint64_t>;

__global__ void __launch_bounds__(kSampleThreads) StratifiedSampleKernel(PrioritySampleArgs a) {
  __shared__ float warp_max[kSampleThreads / 32];
  const int64_t t = a.state->t;
  const int64_t size = a.state->replay_size;
  const uint64_t total = a.prefix[a.capacity - 1];
  const double scale = ldexp(1.0, a.fixed_shift);
  const double total_real = static_cast<double>(total) / scale;
  const float beta =
      a.beta_anneal_steps == 0
          ? a.beta_end
          : a.beta_start + (a.beta_end - a.beta_start) *
                               fminf(1.0f, static_cast<float>(t) / static_cast<float>(a.beta_anneal_steps));
  float local_max = 0.0f;
  for (int b = threadIdx.x; b < a.batch; b += blockDim.x) {
    const float r = qstream::Uniform01(a.seed, static_cast<uint64_t>(t), static_cast<uint64_t>(b));
    const double u = (static_cast<double>(b) + r) / a.batch * static_cast<double>(total);
    const uint64_t u_int = static_cast<uint64_t>(floor(u));
    // First j with prefix[j] > u_int (prefix is integer, so > u <=> > floor(u)).
    int64_t lo = 0, hi = a.capacity;
    while (lo < hi) {
      const int64_t mid = (lo + hi) >> 1;
      if (a.prefix[mid] > u_int) hi = mid; else lo = mid + 1;
    }
    const int64_t idx = lo < size ? lo : size - 1;
    const double prob = static_cast<double>(a.priorities[idx]) / total_real;
    const float w = static_cast<float>(pow(static_cast<double>(size) * prob, -static_cast<double>(beta)));
    a.indices[b] = static_cast<int32_t>(idx);
    a.weights[b] = w;
    local_max = fmaxf(local_max, w);
  }
  const float m = BlockMax(local_max, warp_max);
  for (int b = threadIdx.x; b < a.batch; b += blockDim.x) a.weights[b] = a.weights[b] / m;
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
  StratifiedSampleKernel<<<1, kSampleThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchGather(const GatherArgs& a, cudaStream_t stream) {
  const int rows_per_block = kGatherThreads / 32;
  GatherKernel<<<(a.batch + rows_per_block - 1) / rows_per_block, kGatherThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace qstream::kernels
