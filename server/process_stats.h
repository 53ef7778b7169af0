// The standard process_* metrics of Prometheus client libraries, read from
// /proc/self (prometheus-cpp has no process collector).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace qstream {

struct ProcessStats {
  double cpu_seconds = 0;  // user + system
  double resident_bytes = 0;
  double virtual_bytes = 0;
  double start_time_seconds = 0;  // Unix time
  double open_fds = 0;
  double max_fds = 0;  // soft RLIMIT_NOFILE
  double threads = 0;
};

// Parses the text of /proc/<pid>/stat (`stat`) with the system's clock
// ticks per second, page size and boot time (Unix seconds). InvalidArgument
// when the text is not a stat line.
absl::StatusOr<ProcessStats> ParseProcStat(const std::string& stat, long ticks_per_second, long page_bytes,
                                           double boot_time_seconds);

// This process, now: /proc/self/stat, /proc/stat's btime, /proc/self/fd and
// getrlimit.
absl::StatusOr<ProcessStats> ReadProcessStats();

}  // namespace qstream
