#include "trainer/rate_limiter.h"

namespace qstream {

RateLimiter::RateLimiter(const v1::RateLimiterConfig& config)
    : spi_(config.samples_per_insert()),
      min_size_(config.min_size_to_sample()),
      min_diff_(static_cast<double>(config.min_size_to_sample()) * config.samples_per_insert() -
                config.error_buffer()),
      max_diff_(static_cast<double>(config.min_size_to_sample()) * config.samples_per_insert() +
                config.error_buffer()) {}

bool RateLimiter::CanInsertLocked() const {
  if (spi_ <= 0) return true;
  const double diff = static_cast<double>(inserts_) * spi_ - static_cast<double>(samples_);
  return diff <= max_diff_;
}

bool RateLimiter::CanSampleLocked(int64_t k) const {
  if (inserts_ < min_size_) return false;
  if (spi_ <= 0) return true;
  const double diff = static_cast<double>(inserts_) * spi_ - static_cast<double>(samples_);
  return diff - static_cast<double>(k) >= min_diff_;
}

void RateLimiter::Restore(int64_t inserts, int64_t samples) {
  absl::MutexLock lock(&mu_);
  inserts_ = inserts;
  samples_ = samples;
}

bool RateLimiter::CanInsert() const {
  absl::MutexLock lock(&mu_);
  return CanInsertLocked();
}

bool RateLimiter::CanSample(int64_t k) const {
  absl::MutexLock lock(&mu_);
  return CanSampleLocked(k);
}

absl::Status RateLimiter::AwaitCanInsert(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return cancelled_ || CanInsertLocked(); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) {
    return absl::DeadlineExceededError("rate limiter: timed out waiting to insert");
  }
  if (cancelled_) return absl::CancelledError("rate limiter cancelled");
  return absl::OkStatus();
}

absl::Status RateLimiter::AwaitCanSample(int64_t k, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this, k]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return cancelled_ || CanSampleLocked(k); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) {
    return absl::DeadlineExceededError("rate limiter: timed out waiting to sample");
  }
  if (cancelled_) return absl::CancelledError("rate limiter cancelled");
  return absl::OkStatus();
}

void RateLimiter::Inserted(int64_t n) {
  absl::MutexLock lock(&mu_);
  inserts_ += n;
}

void RateLimiter::Sampled(int64_t k) {
  absl::MutexLock lock(&mu_);
  samples_ += k;
}

void RateLimiter::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
}

int64_t RateLimiter::inserts() const {
  absl::MutexLock lock(&mu_);
  return inserts_;
}

int64_t RateLimiter::samples() const {
  absl::MutexLock lock(&mu_);
  return samples_;
}

}  // namespace qstream
