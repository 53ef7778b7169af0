#include "server/ingest_counters.h"

#include <algorithm>

namespace qstream {

void IngestCounters::Accepted(int64_t transitions, int64_t policy_lag) {
  transitions_.fetch_add(transitions, std::memory_order_relaxed);
  batches_.fetch_add(1, std::memory_order_relaxed);
  const auto it = std::lower_bound(kPolicyLagBuckets.begin(), kPolicyLagBuckets.end(),
                                   static_cast<double>(policy_lag));
  lag_buckets_[it - kPolicyLagBuckets.begin()].fetch_add(1, std::memory_order_relaxed);
  lag_sum_.fetch_add(policy_lag, std::memory_order_relaxed);
}

void IngestCounters::Rejected(const std::string& reason) {
  rejected_.fetch_add(1, std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  ++rejected_by_reason_[reason];
}

namespace {

template <size_t N>
size_t Bucket(const std::array<double, N>& bounds, double value) {
  return std::lower_bound(bounds.begin(), bounds.end(), value) - bounds.begin();
}

}  // namespace

void IngestCounters::Episodes(const EpisodeReports& episodes) {
  if (episodes.empty()) return;
  const std::string& label = episodes.env.empty() ? kUnnamedEnvLabel : episodes.env;
  absl::MutexLock lock(&mu_);
  auto it = episodes_.find(label);
  if (it == episodes_.end()) {
    if (env_labels_ < kMaxEpisodeEnvLabels) {
      ++env_labels_;
      it = episodes_.try_emplace(label).first;
    } else {
      it = episodes_.try_emplace(kOtherEnvLabel).first;
    }
  }
  EpisodeCounts& c = it->second;
  for (const EpisodeReport& r : episodes.reports) {
    ++c.return_buckets[Bucket(kEpisodeReturnBuckets, r.episode_return)];
    c.return_sum += r.episode_return;
    ++c.length_buckets[Bucket(kEpisodeLengthBuckets, static_cast<double>(r.length))];
    c.length_sum += r.length;
  }
}

bool IngestCounters::TryOpenStream(int max_streams) {
  if (streams_.fetch_add(1, std::memory_order_relaxed) >= max_streams) {
    streams_.fetch_sub(1, std::memory_order_relaxed);
    return false;
  }
  return true;
}

void IngestCounters::CloseStream() { streams_.fetch_sub(1, std::memory_order_relaxed); }

std::map<std::string, int64_t> IngestCounters::rejected_by_reason() const {
  absl::MutexLock lock(&mu_);
  return rejected_by_reason_;
}

std::map<std::string, EpisodeCounts> IngestCounters::episodes() const {
  absl::MutexLock lock(&mu_);
  return episodes_;
}

PolicyLagCounts IngestCounters::policy_lag() const {
  PolicyLagCounts c;
  for (size_t i = 0; i < c.buckets.size(); ++i) c.buckets[i] = lag_buckets_[i].load(std::memory_order_relaxed);
  c.sum = static_cast<double>(lag_sum_.load(std::memory_order_relaxed));
  return c;
}

}  // namespace qstream
