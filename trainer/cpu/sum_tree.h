// SumTree: priorities of a fixed number of slots with O(log N) update and
// prefix search, the sampling structure of the CPU prioritized replay.
//
// Leaves hold the float priorities; inner nodes hold sums in double, each
// recomputed from its two children on update (never adjusted by a delta), so
// the sums do not drift however many updates run.
#pragma once

#include <cstdint>
#include <vector>

namespace qstream::cpu {

class SumTree {
 public:
  explicit SumTree(int64_t capacity);

  int64_t capacity() const { return capacity_; }
  void Set(int64_t index, float priority);
  // Sets leaves [first, first + count) to `priority` and recomputes each
  // inner node above them once (O(count + log N)): the same nodes, bit for
  // bit, as Set on each leaf in turn.
  void SetRange(int64_t first, int64_t count, float priority);
  // Replaces every leaf (missing ones become 0) and rebuilds the sums: the
  // same nodes, bit for bit, as setting the leaves one by one.
  void Assign(const std::vector<float>& leaves);
  float Get(int64_t index) const { return leaves_[index]; }
  double total() const { return nodes_[1]; }

  // Smallest j with prefix_j > u (prefix inclusive: p_0 + ... + p_j), or the
  // last slot with nonzero prefix when u >= total.
  int64_t Find(double u) const;

 private:
  int64_t capacity_;
  int64_t width_;              // leaves rounded up to a power of two
  std::vector<float> leaves_;  // capacity
  std::vector<double> nodes_;  // 2 * width_: node k has children 2k, 2k+1; leaves at width_ + i
};

}  // namespace qstream::cpu
