#include "server/process_stats.h"

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <ctime>

#include "gtest/gtest.h"

namespace qstream {
namespace {

TEST(ParseProcStat, CountsFieldsFromTheLastParenthesis) {
  // A command name with spaces and a ')' of its own; utime 250, stime 50
  // ticks, 7 threads, started 1000 ticks after boot, 4096000 bytes virtual,
  // 300 resident pages.
  const std::string stat =
      "1234 (q s) d) S 1 1234 1234 0 -1 4194304 100 0 0 0 250 50 0 0 20 0 7 0 1000 4096000 300 "
      "18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
  auto p = ParseProcStat(stat, /*ticks_per_second=*/100, /*page_bytes=*/4096, /*boot_time_seconds=*/1.7e9);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_DOUBLE_EQ(p->cpu_seconds, 3.0);
  EXPECT_DOUBLE_EQ(p->threads, 7);
  EXPECT_DOUBLE_EQ(p->start_time_seconds, 1.7e9 + 10);
  EXPECT_DOUBLE_EQ(p->virtual_bytes, 4096000);
  EXPECT_DOUBLE_EQ(p->resident_bytes, 300.0 * 4096);
}

TEST(ParseProcStat, RejectsWhatIsNotAStatLine) {
  EXPECT_FALSE(ParseProcStat("", 100, 4096, 0).ok());
  EXPECT_FALSE(ParseProcStat("1 (x) S 1 2 3", 100, 4096, 0).ok());
  EXPECT_FALSE(ParseProcStat("no parenthesis at all", 100, 4096, 0).ok());
}

TEST(ReadProcessStats, ThisProcess) {
  auto before = ReadProcessStats();
  ASSERT_TRUE(before.ok()) << before.status();
  // Burn 0.2 s of this process's CPU (however busy the machine) and open a
  // file: both show.
  auto cpu_now = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  };
  const double start = cpu_now();
  volatile double x = 0;
  while (cpu_now() - start < 0.2) x = std::sqrt(x + 1.0);
  const int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  auto after = ReadProcessStats();
  close(fd);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_GE(after->cpu_seconds - before->cpu_seconds, 0.15);  // clock ticks of 10 ms
  EXPECT_EQ(after->open_fds, before->open_fds + 1);
  EXPECT_GT(after->resident_bytes, 1 << 20);
  EXPECT_GE(after->virtual_bytes, after->resident_bytes);
  EXPECT_GE(after->threads, 1);
  EXPECT_GT(after->max_fds, after->open_fds);
  const double now = static_cast<double>(std::time(nullptr));
  EXPECT_LE(after->start_time_seconds, now + 1);
  EXPECT_GT(after->start_time_seconds, now - 3600);  // this test binary started recently
}

}  // namespace
}  // namespace qstream
