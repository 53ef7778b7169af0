#include "server/process_stats.h"

#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace qstream {
namespace {

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::UnavailableError(absl::StrCat(path, ": cannot read"));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

absl::StatusOr<ProcessStats> ParseProcStat(const std::string& stat, long ticks_per_second, long page_bytes,
                                           double boot_time_seconds) {
  // pid (comm) state ppid ...: comm may hold spaces and ')', so fields are
  // counted from the last ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos || ticks_per_second <= 0) {
    return absl::InvalidArgumentError("/proc stat: no ')' after the command name");
  }
  const std::vector<absl::string_view> f = absl::StrSplit(
      absl::StripAsciiWhitespace(absl::string_view(stat).substr(close + 1)), ' ', absl::SkipEmpty());
  // f[0] is field 3 (state): field k of proc(5) is f[k - 3].
  auto field = [&f](int k, double* out) {
    const size_t i = static_cast<size_t>(k - 3);
    return i < f.size() && absl::SimpleAtod(f[i], out);
  };
  double utime = 0, stime = 0, threads = 0, start_ticks = 0, vsize = 0, rss_pages = 0;
  if (!field(14, &utime) || !field(15, &stime) || !field(20, &threads) || !field(22, &start_ticks) ||
      !field(23, &vsize) || !field(24, &rss_pages)) {
    return absl::InvalidArgumentError("/proc stat: fewer than 24 numeric fields");
  }
  ProcessStats p;
  const double hz = static_cast<double>(ticks_per_second);
  p.cpu_seconds = (utime + stime) / hz;
  p.threads = threads;
  p.start_time_seconds = boot_time_seconds + start_ticks / hz;
  p.virtual_bytes = vsize;
  p.resident_bytes = rss_pages * static_cast<double>(page_bytes);
  return p;
}

absl::StatusOr<ProcessStats> ReadProcessStats() {
  auto stat = ReadText("/proc/self/stat");
  if (!stat.ok()) return stat.status();
  auto system = ReadText("/proc/stat");
  if (!system.ok()) return system.status();
  double boot = 0;
  for (absl::string_view line : absl::StrSplit(*system, '\n')) {
    if (absl::ConsumePrefix(&line, "btime ")) {
      if (!absl::SimpleAtod(line, &boot)) return absl::InvalidArgumentError("/proc/stat: bad btime");
      break;
    }
  }
  auto p = ParseProcStat(*stat, sysconf(_SC_CLK_TCK), sysconf(_SC_PAGESIZE), boot);
  if (!p.ok()) return p.status();
  std::error_code ec;
  double fds = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++fds;
  }
  p->open_fds = fds;
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    p->max_fds = limit.rlim_cur == RLIM_INFINITY ? -1 : static_cast<double>(limit.rlim_cur);
  }
  return p;
}

}  // namespace qstream
