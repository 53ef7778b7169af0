// Counter-based random numbers shared by the CPU and CUDA backends (host and
// device code: trainer/cpu and kernels/ both include it), so both
// draw the same stratified-sampling offsets for a (seed, step, index).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define QS_HD __host__ __device__ __forceinline__
#else
#define QS_HD inline
#endif

namespace qstream {

// SplitMix64 finalizer: a bijective 64-bit mix.
QS_HD uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [0, 1) with 24 random bits (exactly representable in float).
QS_HD float Uniform01(uint64_t seed, uint64_t step, uint64_t index) {
  const uint64_t h = Mix64(Mix64(seed ^ Mix64(step)) + index);
  return static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
}

}  // namespace qstream
