#include "trainer/cpu/forward.h"

#include <algorithm>

#include "trainer/cpu/network.h"

namespace qstream {

void ComputeQValues(const NetworkSpec& spec, const float* params, const float* obs, int64_t n, float* q) {
  if (n <= 0) return;
  cpu::Activations<float> acts;
  acts.input = Eigen::Map<const cpu::Matrix<float>>(obs, spec.obs_dim, n);
  cpu::Forward(spec, params, &acts);
  // acts.q is total_actions x n column-major, i.e. n x total_actions row-major.
  std::copy(acts.q.data(), acts.q.data() + acts.q.size(), q);
}

void GreedyActions(const NetworkSpec& spec, const float* q, int64_t n, int32_t* actions) {
  const int total = spec.total_actions();
  for (int64_t i = 0; i < n; ++i) {
    const float* row = q + i * total;
    for (int br = 0; br < spec.num_branches(); ++br) {
      const int first = spec.branch_offset(br);
      int best = 0;
      for (int a = 1; a < spec.branch_actions[br]; ++a) {
        if (row[first + a] > row[first + best]) best = a;
      }
      actions[i * spec.num_branches() + br] = best;
    }
  }
}

}  // namespace qstream
