// RateLimiter: keeps the ratio of sampled to inserted transitions near
// samples_per_insert, in the manner of Reverb's rate limiter. Sampling is
// blocked until min_size_to_sample items are in the replay; after that, with
// diff = inserts * spi - samples, an insert is allowed while
// diff <= min_size * spi + error_buffer (so a batch may overshoot by itself)
// and a sample of k items while diff - k >= min_size * spi - error_buffer.
// spi <= 0 disables the ratio: inserts always pass, samples need min size only.
#pragma once

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "qstream/v1/config.pb.h"

namespace qstream {

class RateLimiter {
 public:
  explicit RateLimiter(const v1::RateLimiterConfig& config);

  // Non-blocking checks. `size` is the current replay size.
  bool CanInsert() const ABSL_LOCKS_EXCLUDED(mu_);
  bool CanSample(int64_t k) const ABSL_LOCKS_EXCLUDED(mu_);

  // Blocking forms: wait until allowed, cancelled (CancelledError) or timed
  // out (DeadlineExceededError).
  absl::Status AwaitCanInsert(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status AwaitCanSample(int64_t k, absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

  void Inserted(int64_t n) ABSL_LOCKS_EXCLUDED(mu_);  // n items entered the replay
  void Sampled(int64_t k) ABSL_LOCKS_EXCLUDED(mu_);   // k items were sampled
  // Sets the running totals (a restore continues the ratio where it was).
  void Restore(int64_t inserts, int64_t samples) ABSL_LOCKS_EXCLUDED(mu_);
  // Wakes every waiter with CancelledError; later awaits fail at once.
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);

  int64_t inserts() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t samples() const ABSL_LOCKS_EXCLUDED(mu_);
  float samples_per_insert() const { return spi_; }

 private:
  bool CanInsertLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool CanSampleLocked(int64_t k) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const float spi_;
  const int64_t min_size_;
  const double min_diff_;
  const double max_diff_;
  mutable absl::Mutex mu_;
  int64_t inserts_ ABSL_GUARDED_BY(mu_) = 0;  // also the replay size bound: size = min(inserts, capacity)
  int64_t samples_ ABSL_GUARDED_BY(mu_) = 0;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace qstream
