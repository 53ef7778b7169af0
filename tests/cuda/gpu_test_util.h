// Helpers of the GPU tests: device skip, device arrays that are poisoned
// before a kernel runs, fresh random inputs, relative errors.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "trainer/config.h"
#include "trainer/cuda/cuda_backend.h"
#include "trainer/transitions.h"

namespace qstream::testing {

// The GPU tests' network: 8 inputs, trunk 32-32, heads of 16, 51 atoms,
// branches of 3 and 2 actions; stats every step, lr 1e-3.
inline v1::TrainerConfig SmallNetworkConfig() {
  v1::TrainerConfig c = DefaultConfig();
  auto* n = c.mutable_network();
  n->set_obs_dim(8);
  n->clear_trunk_hidden();
  n->add_trunk_hidden(32);
  n->add_trunk_hidden(32);
  n->set_head_hidden(16);
  n->set_num_atoms(51);
  n->clear_branch_actions();
  n->add_branch_actions(3);
  n->add_branch_actions(2);
  c.mutable_server()->set_stats_every(1);
  c.mutable_optimizer()->set_lr(1e-3f);
  return c;
}

#define QS_SKIP_WITHOUT_GPU()                                \
  do {                                                       \
    std::string why_;                                        \
    if (!::qstream::CudaDeviceAvailable(&why_)) GTEST_SKIP() << why_; \
  } while (0)

#define QS_ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// Device copy of a host vector; Poison() fills it with NaN bytes (0xFF) so
// an element no kernel wrote is caught.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) == cudaSuccess) ptr_ = static_cast<T*>(p);
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { Upload(host); }
  ~DeviceArray() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  void Upload(const std::vector<T>& host) {
    EXPECT_EQ(host.size(), n_);
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  void Poison() { EXPECT_EQ(cudaMemset(ptr_, 0xFF, n_ * sizeof(T)), cudaSuccess); }
  std::vector<T> Download() const {
    std::vector<T> host(n_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  T* get() const { return ptr_; }
  size_t size() const { return n_; }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

inline std::vector<float> RandomUniform(std::mt19937_64& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// ||out - ref|| / ||ref||; +inf when any output is non-finite (NaN never passes).
template <typename A, typename B>
double RelError(const std::vector<A>& out, const std::vector<B>& ref) {
  if (out.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(static_cast<double>(out[i]))) return std::numeric_limits<double>::infinity();
    const double d = static_cast<double>(out[i]) - static_cast<double>(ref[i]);
    num += d * d;
    den += static_cast<double>(ref[i]) * static_cast<double>(ref[i]);
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

// n random transitions for the network of `c`: observations and rewards
// uniform, every 10th a terminal (discount 0), the others discount 0.99^3,
// actions uniform per branch.
inline TransitionColumns RandomTransitions(const v1::TrainerConfig& c, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  TransitionColumns t;
  t.n = n;
  t.obs_dim = c.network().obs_dim();
  t.num_branches = c.network().branch_actions_size();
  t.obs = RandomUniform(rng, n * t.obs_dim, -1, 1);
  t.next_obs = RandomUniform(rng, n * t.obs_dim, -1, 1);
  t.rewards = RandomUniform(rng, n, -2, 2);
  t.discounts.assign(n, 0.99f * 0.99f * 0.99f);
  for (int64_t i = 0; i < n; i += 10) t.discounts[i] = 0.0f;
  t.actions.resize(n * t.num_branches);
  for (int64_t i = 0; i < n; ++i) {
    for (int br = 0; br < t.num_branches; ++br)
      t.actions[i * t.num_branches + br] = int32_t(rng() % c.network().branch_actions(br));
  }
  return t;
}

}  // namespace qstream::testing
