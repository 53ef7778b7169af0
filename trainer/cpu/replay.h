// PrioritizedReplay: the CPU replay ring (columns obs, next_obs, actions,
// rewards, discounts) with a SumTree over stored priorities (already raised
// to alpha). Sampling and priority write-back follow steps 1 and 11 of the
// learner-step contract in trainer/backend.h.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "trainer/backend_state.h"
#include "trainer/cpu/sum_tree.h"
#include "trainer/transitions.h"

namespace qstream::cpu {

class PrioritizedReplay {
 public:
  PrioritizedReplay(int64_t capacity, int obs_dim, int num_branches);

  // Checks column shapes against this replay (not action ranges: the caller
  // knows the branch sizes). InvalidArgument names the column.
  absl::Status CheckShape(const TransitionColumns& batch) const;
  // Appends at the ring cursor, overwriting the oldest items; every new item
  // gets max_priority(). The batch must pass CheckShape.
  void Insert(const TransitionColumns& batch);

  int64_t size() const { return size_; }
  int64_t capacity() const { return capacity_; }
  float max_priority() const { return max_priority_; }
  float priority(int64_t slot) const { return tree_.Get(slot); }
  double total_priority() const { return tree_.total(); }

  // Step 1: u_b = (b + Uniform01(seed, step, b)) / B * total; slot_b = smallest
  // j with prefix_j > u_b, clamped to size-1; w_b = (size * p / total)^-beta,
  // normalized by the batch maximum. Requires size() > 0.
  void Sample(int batch, uint64_t seed, uint64_t step, double beta, int64_t* slots, float* weights) const;

  // Step 11: p = (loss_b + epsilon)^alpha for slot_b in order b = 0..B-1, so
  // the largest b wins among duplicate slots; max_priority takes every p.
  void UpdatePriorities(int batch, const int64_t* slots, const float* item_loss, float epsilon, float alpha);
  void SetPriority(int64_t slot, float priority);

  // The stored ring (rows [0, size), priorities, cursor, max priority).
  void Save(ReplayState* out) const;
  // Replaces the contents; `state` must have this capacity and shape
  // (InvalidArgument naming the column otherwise).
  absl::Status Load(const ReplayState& state);

  const float* obs(int64_t slot) const { return &obs_[slot * obs_dim_]; }
  const float* next_obs(int64_t slot) const { return &next_obs_[slot * obs_dim_]; }
  const int32_t* actions(int64_t slot) const { return &actions_[slot * num_branches_]; }
  float reward(int64_t slot) const { return rewards_[slot]; }
  float discount(int64_t slot) const { return discounts_[slot]; }

 private:
  const int64_t capacity_;
  const int obs_dim_;
  const int num_branches_;
  int64_t size_ = 0;
  int64_t cursor_ = 0;  // next slot to write
  float max_priority_ = 1.0f;
  std::vector<float> obs_;
  std::vector<float> next_obs_;
  std::vector<int32_t> actions_;
  std::vector<float> rewards_;
  std::vector<float> discounts_;
  SumTree tree_;
};

}  // namespace qstream::cpu
