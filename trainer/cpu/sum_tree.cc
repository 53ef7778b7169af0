#include "trainer/cpu/sum_tree.h"

#include <algorithm>

namespace qstream::cpu {

SumTree::SumTree(int64_t capacity) : capacity_(capacity), width_(1) {
  while (width_ < capacity_) width_ *= 2;
  leaves_.assign(capacity_, 0.0f);
  nodes_.assign(2 * width_, 0.0);
}

void SumTree::Set(int64_t index, float priority) {
  leaves_[index] = priority;
  int64_t node = width_ + index;
  nodes_[node] = priority;
  for (node /= 2; node >= 1; node /= 2) nodes_[node] = nodes_[2 * node] + nodes_[2 * node + 1];
}

void SumTree::SetRange(int64_t first, int64_t count, float priority) {
  if (count <= 0) return;
  std::fill_n(leaves_.begin() + first, count, priority);
  int64_t lo = width_ + first;
  int64_t hi = width_ + first + count - 1;
  std::fill(nodes_.begin() + lo, nodes_.begin() + hi + 1, static_cast<double>(priority));
  for (lo /= 2, hi /= 2; lo >= 1; lo /= 2, hi /= 2) {
    for (int64_t node = lo; node <= hi; ++node) nodes_[node] = nodes_[2 * node] + nodes_[2 * node + 1];
  }
}

void SumTree::Assign(const std::vector<float>& leaves) {
  leaves_.assign(capacity_, 0.0f);
  std::copy_n(leaves.begin(), std::min<int64_t>(capacity_, static_cast<int64_t>(leaves.size())),
              leaves_.begin());
  std::fill(nodes_.begin(), nodes_.end(), 0.0);
  for (int64_t i = 0; i < capacity_; ++i) nodes_[width_ + i] = leaves_[i];
  for (int64_t node = width_ - 1; node >= 1; --node) nodes_[node] = nodes_[2 * node] + nodes_[2 * node + 1];
}

int64_t SumTree::Find(double u) const {
  int64_t node = 1;
  while (node < width_) {
    const int64_t left = 2 * node;
    if (u < nodes_[left] || nodes_[left + 1] <= 0.0) {
      node = left;
    } else {
      u -= nodes_[left];
      node = left + 1;
    }
  }
  return node - width_;
}

}  // namespace qstream::cpu
