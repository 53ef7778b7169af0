// Levelled, timestamped log lines for qstreamd (spdlog). Every line goes to
// stderr as either text
//   2026-12-05T06:40:00.123456Z I qstreamd: listening grpc=...
// or one JSON object per line (--log_format=json)
//   {"time":"2026-12-05T06:40:00.123456Z","level":"info","msg":"listening grpc=..."}
// with the message JSON-escaped. Times are UTC. Call sites use spdlog's
// functions (spdlog::info("{} ...", x)) through the default logger that
// InitLogging installs; before it, spdlog's own default logger prints.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace qstream {

// `format`: "text" or "json"; `level`: trace|debug|info|warning|error|critical|off.
// InvalidArgument naming the flag otherwise. Thread-safe; may be called again
// (tests) to switch the format.
absl::Status InitLogging(absl::string_view format, absl::string_view level = "info");

// One formatted line without the trailing newline, as InitLogging's sink would
// write it (for tests): `level` as spdlog names it.
std::string FormatLogLineForTest(absl::string_view format, absl::string_view level,
                                 absl::string_view message);

}  // namespace qstream
