// Counters of the ingest path. ExperienceService bumps them once per batch
// with relaxed atomics (no lock on the accept path; episode reports, which
// come about once per episode, under a mutex); AdminService.Status and the
// metrics thread read them.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/episode_reports.h"

namespace qstream {

// Upper bounds of the policy-lag histogram buckets, in policy versions
// (qstream_policy_lag_versions); one more bucket holds everything above.
inline constexpr std::array<double, 11> kPolicyLagBuckets = {0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000};

struct PolicyLagCounts {
  std::array<int64_t, kPolicyLagBuckets.size() + 1> buckets{};  // per bucket, not cumulative
  double sum = 0;
};

// Upper bounds of the episode-return histogram buckets
// (qstream_episode_return): one fixed set for every env, so returns of very
// different scales share it (CartPole-v1 0..500 with 475 "solved",
// Acrobot -500..0, MountainCar -200..-100, LunarLander -400..300, Atari
// Pong -21..21); finer where those cluster. One more bucket holds
// everything above 1000. The mean is exact whatever the buckets:
// rate(_sum) / rate(_count).
inline constexpr std::array<double, 26> kEpisodeReturnBuckets = {
    -1000, -500, -400, -300, -200, -150, -120, -100, -80, -50, -20, -10, 0,
    10,    20,   50,   80,   100,  120,  150,  200,  300, 400, 475, 500, 1000};
// Upper bounds of the episode-length histogram buckets, environment steps
// (qstream_episode_length_steps): 1-2-5 steps up to 100000.
inline constexpr std::array<double, 16> kEpisodeLengthBuckets = {
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000};
// Distinct env label values with series of their own (README "Limits");
// reports of later envs count under kOtherEnvLabel, so a client cannot grow
// the metrics without bound.
inline constexpr size_t kMaxEpisodeEnvLabels = 32;
inline constexpr char kOtherEnvLabel[] = "other";
// The label of reports whose batch named no env.
inline constexpr char kUnnamedEnvLabel[] = "unnamed";

// The episodes counted under one env label.
struct EpisodeCounts {
  std::array<int64_t, kEpisodeReturnBuckets.size() + 1> return_buckets{};  // per bucket, not cumulative
  double return_sum = 0;
  std::array<int64_t, kEpisodeLengthBuckets.size() + 1> length_buckets{};
  int64_t length_sum = 0;
};

class IngestCounters {
 public:
  void Accepted(int64_t transitions, int64_t policy_lag);
  void Rejected(const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);
  // Counts the episodes of a committed batch under its env label.
  void Episodes(const EpisodeReports& episodes) ABSL_LOCKS_EXCLUDED(mu_);

  // Admits a stream when fewer than `max_streams` are open.
  bool TryOpenStream(int max_streams);
  void CloseStream();

  int64_t transitions() const { return transitions_.load(std::memory_order_relaxed); }
  int64_t batches() const { return batches_.load(std::memory_order_relaxed); }
  int64_t rejected() const { return rejected_.load(std::memory_order_relaxed); }
  int actor_streams() const { return streams_.load(std::memory_order_relaxed); }
  std::map<std::string, int64_t> rejected_by_reason() const ABSL_LOCKS_EXCLUDED(mu_);
  PolicyLagCounts policy_lag() const;
  // By env label: at most kMaxEpisodeEnvLabels of them, plus kOtherEnvLabel.
  std::map<std::string, EpisodeCounts> episodes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  std::atomic<int64_t> transitions_{0};
  std::atomic<int64_t> batches_{0};
  std::atomic<int64_t> rejected_{0};
  std::atomic<int> streams_{0};
  std::array<std::atomic<int64_t>, kPolicyLagBuckets.size() + 1> lag_buckets_{};
  std::atomic<int64_t> lag_sum_{0};
  mutable absl::Mutex mu_;
  std::map<std::string, int64_t> rejected_by_reason_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, EpisodeCounts> episodes_ ABSL_GUARDED_BY(mu_);
  size_t env_labels_ ABSL_GUARDED_BY(mu_) = 0;  // labels other than the overflow's
};

}  // namespace qstream
