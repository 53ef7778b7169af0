#include "kernels/per_sample.h"

#include <cmath>

#include "common/rng.h"
#include "kernels/launch.cuh"

namespace qstream::kernels {
namespace {

constexpr int kChunkThreads = 256;
constexpr int kSampleThreads = 256;  // 8 warps: one sample per warp
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr int kChunksPerThread = kMaxPriorityChunks / kSampleThreads;
constexpr int kMinChunkLog2 = 10;
constexpr int kLoadBatch = 16;  // slots a lane loads at once
constexpr int kSubChunks = 32;  // per chunk, one per lane of the search

// p -> round(p * 2^shift). Scaling by a power of two is exact; only the
// rounding to an integer rounds (p * 2^shift < 2^42 is exact in float).
__device__ __forceinline__ uint64_t ToFixed(float p, float scale) {
  return static_cast<uint64_t>(rintf(p * scale));
}

// beta annealed linearly from beta_start to beta_end over beta_anneal_steps.
// The fmaf spells out the contraction nvcc made of start + diff * frac, so a
// host reference (std::fma) reproduces it bit for bit.
__device__ __forceinline__ float AnnealedBeta(const PrioritySampleArgs& a, int64_t t) {
  if (a.beta_anneal_steps == 0) return a.beta_end;
  const float frac = fminf(1.0f, static_cast<float>(t) / static_cast<float>(a.beta_anneal_steps));
  return fmaf(a.beta_end - a.beta_start, frac, a.beta_start);
}

// Inclusive scan over the warp's lanes (exact: integers).
__device__ __forceinline__ uint64_t WarpInclusiveScan(uint64_t v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t up = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += up;
  }
  return v;
}

__device__ __forceinline__ uint64_t WarpSumU64(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
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
// leaves [begin, begin + m - 1], so len -> at most ceil(len / 32) - 1.
__device__ __forceinline__ int WarpUpperBound(const uint64_t* prefix, int n, uint64_t u, int lane) {
  int lo = 0, hi = n;
  while (lo < hi) {  // warp-uniform: every lane holds the same lo and hi
    const int len = hi - lo;
    const int begin = lo + (lane * len) / 32;
    const int end = lo + ((lane + 1) * len) / 32;
    const bool above = end > begin && prefix[end - 1] > u;
    const unsigned ballot = __ballot_sync(0xffffffffu, above);
    if (ballot == 0u) return hi;  // every prefix in [lo, hi) is <= u
    const int k = __ffs(static_cast<int>(ballot)) - 1;
    const int next_lo = lo + (k * len) / 32;
    hi = lo + ((k + 1) * len) / 32 - 1;  // lane k's load: prefix[hi] > u
    lo = next_lo;
  }
  return lo;
}

// Block c: sub[c * 32 + j] = the fixed-point sum of sub-chunk j of chunk c
// (2^(chunk_log2 - 5) slots, read coalesced by one warp), then chunk[c] =
// their sum. Slots at or past capacity count 0.
__global__ void __launch_bounds__(kChunkThreads)
    ChunkSumsKernel(const float* __restrict__ p, int64_t capacity, int chunk_log2, float scale,
                    uint64_t* __restrict__ chunk, uint64_t* __restrict__ sub) {
  WaitForPredecessor();
  __shared__ uint64_t sub_sums[kSubChunks];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int64_t sub_len = int64_t{1} << (chunk_log2 - 5);
  for (int j = warp; j < kSubChunks; j += kChunkThreads / 32) {
    const int64_t begin = (int64_t{blockIdx.x} << chunk_log2) + j * sub_len;
    uint64_t s = 0;
    // One slot per lane per round (sub_len is 32 up to 2^20 slots): a
    // conversion to u64 is slow, so none is spent on padding.
    for (int64_t off = lane; off < sub_len; off += 32) {
      if (begin + off < capacity) s += ToFixed(p[begin + off], scale);
    }
    s = WarpSumU64(s);
    if (lane == 0) {
      sub_sums[j] = s;
      sub[int64_t{blockIdx.x} * kSubChunks + j] = s;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t t = 0;
    for (int j = 0; j < kSubChunks; ++j) t += sub_sums[j];
    chunk[blockIdx.x] = t;
  }
}

// The block's inclusive prefix of the chunk sums, into shared memory.
__device__ void ScanChunkSums(const uint64_t* __restrict__ sums, int chunks, uint64_t* prefix,
                              uint64_t* warp_totals) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int first = threadIdx.x * kChunksPerThread;
  uint64_t local[kChunksPerThread];
  uint64_t run = 0;
#pragma unroll
  for (int k = 0; k < kChunksPerThread; ++k) {
    local[k] = first + k < chunks ? sums[first + k] : 0;
    run += local[k];
  }
  const uint64_t incl = WarpInclusiveScan(run, lane);
  if (lane == 31) warp_totals[warp] = incl;
  __syncthreads();
  uint64_t acc = incl - run;
  for (int w = 0; w < warp; ++w) acc += warp_totals[w];
#pragma unroll
  for (int k = 0; k < kChunksPerThread; ++k) {
    acc += local[k];
    if (first + k < chunks) prefix[first + k] = acc;
  }
  __syncthreads();
}

// First j in [lo, lo + len) with base + (fixed-point prefix of [lo, j]) > u,
// given that one exists (base + the range's sum > u); slots at or past
// capacity count 0. len is a power of two. Whole warp; every lane returns j.
__device__ __forceinline__ int64_t SearchChunk(const float* __restrict__ p, int64_t capacity, float scale,
                                               int64_t lo, int64_t len, uint64_t base, uint64_t u, int lane) {
  while (len > 32) {
    const int64_t per = len / 32;
    const int64_t begin = lo + lane * per;
    uint64_t s = 0;
    // kLoadBatch independent loads in flight per lane (a plain loop issues
    // one L2 round trip per slot: ncu, 14 us for the kernel at 2^20 slots).
    for (int64_t i0 = 0; i0 < per; i0 += kLoadBatch) {
      float v[kLoadBatch];
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) {
        const int64_t i = begin + i0 + j;
        v[j] = i0 + j < per && i < capacity ? p[i] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) {
        if (i0 + j < per) s += ToFixed(v[j], scale);
      }
    }
    const uint64_t incl = WarpInclusiveScan(s, lane);
    const unsigned ballot = __ballot_sync(0xffffffffu, base + incl > u);
    const int k = ballot == 0u ? 31 : __ffs(static_cast<int>(ballot)) - 1;  // nonzero by the precondition
    base += __shfl_sync(0xffffffffu, incl - s, k);
    lo += k * per;
    len = per;
  }
  const int64_t i = lo + lane;
  const uint64_t s = lane < len && i < capacity ? ToFixed(p[i], scale) : 0;
  const uint64_t incl = WarpInclusiveScan(s, lane);
  const unsigned ballot = __ballot_sync(0xffffffffu, lane < len && base + incl > u);
  const int k = ballot == 0u ? static_cast<int>(len) - 1 : __ffs(static_cast<int>(ballot)) - 1;
  return lo + k;
}

// One warp per sample b; lane 0 writes indices[b] and the raw weight; with
// the gather on, the warp then copies the sampled row.
__global__ void __launch_bounds__(kSampleThreads)
    StratifiedSampleKernel(PrioritySampleArgs a, int chunk_log2, int chunks) {
  WaitForPredecessor();
  __shared__ uint64_t prefix[kMaxPriorityChunks];
  __shared__ uint64_t warp_totals[kSampleWarps];
  ScanChunkSums(a.sums, chunks, prefix, warp_totals);
  const int lane = threadIdx.x % 32;
  const int b = blockIdx.x * kSampleWarps + threadIdx.x / 32;
  if (b >= a.batch) return;  // the whole warp leaves together: the ballots see 32 lanes
  const ReplayColumns& r = a.replay;
  const int64_t t = a.state->t;
  const int64_t size = a.state->replay_size;
  const uint64_t total = prefix[chunks - 1];
  const float rnd = qstream::Uniform01(a.seed, static_cast<uint64_t>(t), static_cast<uint64_t>(b));
  const double u = (static_cast<double>(b) + rnd) / a.batch * static_cast<double>(total);
  // prefix is integer, so prefix[j] > u <=> prefix[j] > floor(u).
  const uint64_t u_int = static_cast<uint64_t>(floor(u));
  const float scale = ldexpf(1.0f, a.fixed_shift);
  const int c = WarpUpperBound(prefix, chunks, u_int, lane);
  int64_t j = r.capacity;
  if (c < chunks) {
    // The sub-chunk: one sum per lane, an exact scan, the first lane above u.
    uint64_t base = c > 0 ? prefix[c - 1] : 0;
    const uint64_t s = a.sums[chunks + int64_t{c} * kSubChunks + lane];
    const uint64_t incl = WarpInclusiveScan(s, lane);
    const unsigned ballot = __ballot_sync(0xffffffffu, base + incl > u_int);
    const int k = ballot == 0u ? 31 : __ffs(static_cast<int>(ballot)) - 1;  // nonzero: prefix[c] > u
    base += __shfl_sync(0xffffffffu, incl - s, k);
    const int64_t sub_len = int64_t{1} << (chunk_log2 - 5);
    j = SearchChunk(r.priorities, r.capacity, scale, (int64_t{c} << chunk_log2) + k * sub_len, sub_len, base,
                    u_int, lane);
  }
  const int64_t idx = j < size ? j : size - 1;
  if (lane == 0) {
    const double total_real = static_cast<double>(total) / ldexp(1.0, a.fixed_shift);
    const float beta = AnnealedBeta(a, t);
    const double prob = static_cast<double>(r.priorities[idx]) / total_real;
    a.indices[b] = static_cast<int32_t>(idx);
    a.weights[b] = static_cast<float>(pow(static_cast<double>(size) * prob, -static_cast<double>(beta)));
  }
  if (a.obs == nullptr) return;
  const int d = r.obs_dim;
  const float* src = r.obs + idx * d;
  const float* nsrc = r.next_obs + idx * d;
  for (int i = lane; i < d; i += 32) {
    a.obs[int64_t{b} * d + i] = src[i];
    a.next_obs[int64_t{b} * d + i] = nsrc[i];
  }
  const int nb = r.num_branches;
  for (int i = lane; i < nb; i += 32) a.actions[b * nb + i] = r.actions[idx * nb + i];
  if (lane == 0) {
    a.rewards[b] = r.rewards[idx];
    a.discounts[b] = r.discounts[idx];
  }
}

}  // namespace

int FixedPointShift(int64_t capacity) {
  int log2c = 0;
  while ((int64_t{1} << log2c) < capacity) ++log2c;
  return 62 - log2c - static_cast<int>(std::log2(kMaxFixedPriority));
}

int PriorityChunkLog2(int64_t capacity) {
  int log2 = kMinChunkLog2;
  while (((capacity + (int64_t{1} << log2) - 1) >> log2) > kMaxPriorityChunks) ++log2;
  return log2;
}

int64_t PriorityChunks(int64_t capacity) {
  const int log2 = PriorityChunkLog2(capacity);
  return (capacity + (int64_t{1} << log2) - 1) >> log2;
}

int64_t PrioritySumWords(int64_t capacity) { return PriorityChunks(capacity) * (1 + kSubChunks); }

cudaError_t LaunchPrioritySample(const PrioritySampleArgs& a, cudaStream_t stream) {
  const int64_t capacity = a.replay.capacity;
  if (capacity <= 0) return cudaErrorInvalidValue;
  const int chunk_log2 = PriorityChunkLog2(capacity);
  const int chunks = static_cast<int>(PriorityChunks(capacity));
  const cudaError_t err = LaunchDependent(StepKernel::kChunkSums, ChunkSumsKernel, chunks, kChunkThreads, 0,
                                          stream, a.replay.priorities, capacity, chunk_log2,
                                          std::ldexp(1.0f, a.fixed_shift), a.sums, a.sums + chunks);
  if (err != cudaSuccess || a.batch <= 0) return err;
  return LaunchDependent(StepKernel::kSample, StratifiedSampleKernel,
                         (a.batch + kSampleWarps - 1) / kSampleWarps, kSampleThreads, 0, stream, a,
                         chunk_log2, chunks);
}

}  // namespace qstream::kernels
