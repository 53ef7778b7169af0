// Counters of the ingest path. ExperienceService bumps them once per batch
// with relaxed atomics (no lock on the accept path); AdminService.Status and
// the metrics thread read them.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace qstream {

// Upper bounds of the policy-lag histogram buckets, in policy versions
// (qstream_policy_lag_versions); one more bucket holds everything above.
inline constexpr std::array<double, 11> kPolicyLagBuckets = {0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000};

struct PolicyLagCounts {
  std::array<int64_t, kPolicyLagBuckets.size() + 1> buckets{};  // per bucket, not cumulative
  double sum = 0;
};

class IngestCounters {
 public:
  void Accepted(int64_t transitions, int64_t policy_lag);
  void Rejected(const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);

  // Admits a stream when fewer than `max_streams` are open.
  bool TryOpenStream(int max_streams);
  void CloseStream();

  int64_t transitions() const { return transitions_.load(std::memory_order_relaxed); }
  int64_t batches() const { return batches_.load(std::memory_order_relaxed); }
  int64_t rejected() const { return rejected_.load(std::memory_order_relaxed); }
  int actor_streams() const { return streams_.load(std::memory_order_relaxed); }
  std::map<std::string, int64_t> rejected_by_reason() const ABSL_LOCKS_EXCLUDED(mu_);
  PolicyLagCounts policy_lag() const;

 private:
  std::atomic<int64_t> transitions_{0};
  std::atomic<int64_t> batches_{0};
  std::atomic<int64_t> rejected_{0};
  std::atomic<int> streams_{0};
  std::array<std::atomic<int64_t>, kPolicyLagBuckets.size() + 1> lag_buckets_{};
  std::atomic<int64_t> lag_sum_{0};
  mutable absl::Mutex mu_;
  std::map<std::string, int64_t> rejected_by_reason_ ABSL_GUARDED_BY(mu_);
};

}  // namespace qstream
