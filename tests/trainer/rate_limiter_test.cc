#include "trainer/rate_limiter.h"

#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace qstream {
namespace {

// How long a waiter is given to (wrongly) get through before we check it is
// still blocked. Only "still blocked" is asserted, never a duration.
constexpr absl::Duration kShortWait = absl::Milliseconds(50);

v1::RateLimiterConfig Config(int64_t min_size, float spi, float error_buffer) {
  v1::RateLimiterConfig c;
  c.set_min_size_to_sample(min_size);
  c.set_samples_per_insert(spi);
  c.set_error_buffer(error_buffer);
  return c;
}

TEST(RateLimiterTest, SamplingNeedsMinSize) {
  RateLimiter limiter(Config(10, 1, 100));
  EXPECT_FALSE(limiter.CanSample(1));
  limiter.Inserted(9);
  EXPECT_FALSE(limiter.CanSample(1));
  limiter.Inserted(1);
  EXPECT_TRUE(limiter.CanSample(1));
}

TEST(RateLimiterTest, RatioBoundsBothSides) {
  // spi 2, min size 4, error buffer 6: min_diff = 8 - 6 = 2, max_diff = 8 + 6 = 14.
  RateLimiter limiter(Config(4, 2, 6));
  limiter.Inserted(4);  // diff 8
  EXPECT_TRUE(limiter.CanSample(6));   // 8 - 6 = 2 >= 2
  EXPECT_FALSE(limiter.CanSample(7));  // 1 < 2
  EXPECT_TRUE(limiter.CanInsert());
  limiter.Inserted(3);  // diff 14: still allowed (<= max_diff)
  EXPECT_TRUE(limiter.CanInsert());
  limiter.Inserted(1);  // diff 16
  EXPECT_FALSE(limiter.CanInsert());
  limiter.Sampled(2);  // diff 14
  EXPECT_TRUE(limiter.CanInsert());
  EXPECT_EQ(limiter.inserts(), 8);
  EXPECT_EQ(limiter.samples(), 2);
}

TEST(RateLimiterTest, NonPositiveRatioOnlyNeedsMinSize) {
  RateLimiter limiter(Config(2, 0, 0));
  limiter.Inserted(1000000);
  EXPECT_TRUE(limiter.CanInsert());
  limiter.Sampled(1);
  EXPECT_TRUE(limiter.CanSample(int64_t{1} << 40));
}

TEST(RateLimiterTest, BlockedInsertIsReleasedBySample) {
  RateLimiter limiter(Config(1, 1, 2));  // max_diff = 3
  limiter.Inserted(4);
  ASSERT_FALSE(limiter.CanInsert());
  absl::Notification done;
  absl::Status result;
  std::thread waiter([&] {
    result = limiter.AwaitCanInsert(absl::InfiniteDuration());
    done.Notify();
  });
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(kShortWait));
  limiter.Sampled(1);
  done.WaitForNotification();
  waiter.join();
  EXPECT_TRUE(result.ok()) << result;
}

TEST(RateLimiterTest, BlockedSampleIsReleasedByInsert) {
  RateLimiter limiter(Config(10, 1, 100));
  limiter.Inserted(5);
  absl::Notification done;
  absl::Status result;
  std::thread waiter([&] {
    result = limiter.AwaitCanSample(4, absl::InfiniteDuration());
    done.Notify();
  });
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(kShortWait));
  limiter.Inserted(4);  // 9 < min size: still blocked
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(kShortWait));
  limiter.Inserted(1);
  done.WaitForNotification();
  waiter.join();
  EXPECT_TRUE(result.ok()) << result;
}

TEST(RateLimiterTest, BlockedSampleOnRatioIsReleasedByInsert) {
  // spi 1, min size 1, error buffer 1: min_diff = 0; a sample of k needs inserts - samples >= k.
  RateLimiter limiter(Config(1, 1, 1));
  limiter.Inserted(2);
  limiter.Sampled(2);
  ASSERT_FALSE(limiter.CanSample(1));
  absl::Notification done;
  absl::Status result;
  std::thread waiter([&] {
    result = limiter.AwaitCanSample(1, absl::InfiniteDuration());
    done.Notify();
  });
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(kShortWait));
  limiter.Inserted(1);
  done.WaitForNotification();
  waiter.join();
  EXPECT_TRUE(result.ok()) << result;
}

TEST(RateLimiterTest, AwaitTimesOut) {
  RateLimiter limiter(Config(1, 1, 0));
  limiter.Inserted(5);
  EXPECT_TRUE(absl::IsDeadlineExceeded(limiter.AwaitCanInsert(absl::Milliseconds(5))));
  limiter.Sampled(5);
  EXPECT_TRUE(absl::IsDeadlineExceeded(limiter.AwaitCanSample(1, absl::Milliseconds(5))));
  // Allowed calls return at once even with a zero timeout.
  EXPECT_TRUE(limiter.AwaitCanInsert(absl::ZeroDuration()).ok());
}

TEST(RateLimiterTest, CancelWakesWaitersAndFailsLaterAwaits) {
  RateLimiter limiter(Config(100, 1, 1));
  absl::Notification insert_done, sample_done;
  absl::Status insert_result, sample_result;
  limiter.Inserted(200);  // inserts blocked (diff 200 > 101), samples allowed only with k <= 101
  std::thread inserter([&] {
    insert_result = limiter.AwaitCanInsert(absl::InfiniteDuration());
    insert_done.Notify();
  });
  std::thread sampler([&] {
    sample_result = limiter.AwaitCanSample(150, absl::InfiniteDuration());
    sample_done.Notify();
  });
  EXPECT_FALSE(insert_done.WaitForNotificationWithTimeout(kShortWait));
  EXPECT_FALSE(sample_done.HasBeenNotified());
  limiter.Cancel();
  insert_done.WaitForNotification();
  sample_done.WaitForNotification();
  inserter.join();
  sampler.join();
  EXPECT_TRUE(absl::IsCancelled(insert_result)) << insert_result;
  EXPECT_TRUE(absl::IsCancelled(sample_result)) << sample_result;
  EXPECT_TRUE(absl::IsCancelled(limiter.AwaitCanSample(1, absl::InfiniteDuration())));
  EXPECT_TRUE(absl::IsCancelled(limiter.AwaitCanInsert(absl::InfiniteDuration())));
}

}  // namespace
}  // namespace qstream
