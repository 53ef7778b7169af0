#include "trainer/cpu/replay.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "common/rng.h"

namespace qstream::cpu {

namespace {

// Copies n 4-byte values into the ring with non-temporal stores: the ring is
// far larger than the caches and a row is read again only when a sample
// picks it, so skipping the read-for-ownership of every destination line
// halves the copy's memory traffic (2 x 48 floats per row: ~41 -> ~20 ns on
// the 2-core VM). The caller fences once after its copies.
template <typename T>
void CopyToRing(const T* src, int64_t n, T* dst) {
  static_assert(sizeof(T) == 4, "4-byte columns");
#if defined(__SSE2__)
  int64_t i = 0;
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 15) != 0; ++i) dst[i] = src[i];
  for (; i + 4 <= n; i += 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), v);
  }
  for (; i < n; ++i) dst[i] = src[i];
#else
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
#endif
}

}  // namespace

PrioritizedReplay::PrioritizedReplay(int64_t capacity, int obs_dim, int num_branches)
    : capacity_(capacity),
      obs_dim_(obs_dim),
      num_branches_(num_branches),
      obs_(capacity * obs_dim),
      next_obs_(capacity * obs_dim),
      actions_(capacity * num_branches),
      rewards_(capacity),
      discounts_(capacity),
      tree_(capacity) {}

absl::Status PrioritizedReplay::CheckShape(const TransitionColumns& batch) const {
  // Shape only: the action ranges belong to the network, which the backend checks.
  return CheckTransitionColumns(batch, obs_dim_, num_branches_);
}

void PrioritizedReplay::Insert(const TransitionColumns& batch) {
  // Only the last `capacity` items of an oversized batch would survive.
  int64_t row = std::max<int64_t>(0, batch.n - capacity_);
  // Contiguous runs of slots (the ring wraps at most once per run): one copy
  // per column and one tree update per run.
  while (row < batch.n) {
    const int64_t slot = cursor_;
    const int64_t run = std::min(batch.n - row, capacity_ - slot);
    CopyToRing(&batch.obs[row * obs_dim_], run * obs_dim_, &obs_[slot * obs_dim_]);
    CopyToRing(&batch.next_obs[row * obs_dim_], run * obs_dim_, &next_obs_[slot * obs_dim_]);
    CopyToRing(&batch.actions[row * num_branches_], run * num_branches_, &actions_[slot * num_branches_]);
    CopyToRing(&batch.rewards[row], run, &rewards_[slot]);
    CopyToRing(&batch.discounts[row], run, &discounts_[slot]);
    tree_.SetRange(slot, run, max_priority_);
    cursor_ = (cursor_ + run) % capacity_;
    size_ = std::min(size_ + run, capacity_);
    row += run;
  }
#if defined(__SSE2__)
  _mm_sfence();  // the streamed rows are visible before anything that follows
#endif
}

void PrioritizedReplay::Sample(int batch, uint64_t seed, uint64_t step, double beta, int64_t* slots,
                               float* weights) const {
  const double total = tree_.total();
  std::vector<double> w(batch);
  double max_w = 0;
  for (int b = 0; b < batch; ++b) {
    const double u = (b + static_cast<double>(Uniform01(seed, step, b))) / batch * total;
    const int64_t slot = std::min(tree_.Find(u), size_ - 1);
    slots[b] = slot;
    w[b] = std::pow(static_cast<double>(size_) * tree_.Get(slot) / total, -beta);
    max_w = std::max(max_w, w[b]);
  }
  for (int b = 0; b < batch; ++b) weights[b] = static_cast<float>(w[b] / max_w);
}

void PrioritizedReplay::UpdatePriorities(int batch, const int64_t* slots, const float* item_loss,
                                         float epsilon, float alpha) {
  for (int b = 0; b < batch; ++b) {
    const float p = std::pow(item_loss[b] + epsilon, alpha);
    tree_.Set(slots[b], p);
    max_priority_ = std::max(max_priority_, p);
  }
}

void PrioritizedReplay::Save(ReplayState* out) const {
  out->capacity = capacity_;
  out->size = size_;
  out->cursor = cursor_;
  out->max_priority = max_priority_;
  TransitionColumns& r = out->rows;
  r.n = size_;
  r.obs_dim = obs_dim_;
  r.num_branches = num_branches_;
  r.obs.assign(obs_.begin(), obs_.begin() + size_ * obs_dim_);
  r.next_obs.assign(next_obs_.begin(), next_obs_.begin() + size_ * obs_dim_);
  r.actions.assign(actions_.begin(), actions_.begin() + size_ * num_branches_);
  r.rewards.assign(rewards_.begin(), rewards_.begin() + size_);
  r.discounts.assign(discounts_.begin(), discounts_.begin() + size_);
  out->priorities.resize(size_);
  for (int64_t i = 0; i < size_; ++i) out->priorities[i] = tree_.Get(i);
}

absl::Status PrioritizedReplay::Load(const ReplayState& state) {
  if (state.capacity != capacity_) {
    return absl::InvalidArgumentError(
        absl::StrCat("replay.capacity: state has ", state.capacity, ", this replay ", capacity_));
  }
  if (state.size < 0 || state.size > capacity_ || state.cursor < 0 || state.cursor >= capacity_ ||
      (state.size < capacity_ && state.cursor != state.size)) {
    return absl::InvalidArgumentError(absl::StrCat("replay: size ", state.size, " / cursor ", state.cursor,
                                                   " do not fit capacity ", capacity_));
  }
  if (state.rows.n != state.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("replay.rows: ", state.rows.n, " rows, size ", state.size));
  }
  if (auto st = CheckShape(state.rows); !st.ok()) return st;
  if (static_cast<int64_t>(state.priorities.size()) != state.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("replay.priorities: ", state.priorities.size(), " values, size ", state.size));
  }
  const auto& r = state.rows;
  std::copy(r.obs.begin(), r.obs.end(), obs_.begin());
  std::copy(r.next_obs.begin(), r.next_obs.end(), next_obs_.begin());
  std::copy(r.actions.begin(), r.actions.end(), actions_.begin());
  std::copy(r.rewards.begin(), r.rewards.end(), rewards_.begin());
  std::copy(r.discounts.begin(), r.discounts.end(), discounts_.begin());
  tree_.Assign(state.priorities);
  size_ = state.size;
  cursor_ = state.cursor;
  max_priority_ = state.max_priority;
  return absl::OkStatus();
}

void PrioritizedReplay::SetPriority(int64_t slot, float priority) {
  tree_.Set(slot, priority);
  max_priority_ = std::max(max_priority_, priority);
}

}  // namespace qstream::cpu
