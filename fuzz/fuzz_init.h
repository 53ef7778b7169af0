// What every fuzz target does once before its first input.
#pragma once

#include "google/protobuf/stubs/logging.h"

namespace qstream {

// Protobuf logs every text-format parse error to stderr; thousands of lines
// a second would slow the fuzzer down and bury its findings.
inline void QuietProtobufLogs() {
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int, const std::string&) {});
}

}  // namespace qstream
