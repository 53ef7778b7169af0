#include "common/log.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace qstream {
namespace {

constexpr char kTextPattern[] = "%Y-%m-%dT%H:%M:%S.%fZ %L qstreamd: %v";
constexpr char kJsonPattern[] = R"({"time":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l","msg":%*})";

// %* : the message as a JSON string (quotes, backslashes, control characters
// and invalid UTF-8 escaped or replaced by nlohmann::json's dump).
class JsonMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    const std::string quoted = nlohmann::json(std::string(msg.payload.data(), msg.payload.size()))
                                   .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    dest.append(quoted.data(), quoted.data() + quoted.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonMessageFlag>();
  }
};

std::unique_ptr<spdlog::formatter> MakeFormatter(bool json) {
  auto f = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc, "\n");
  if (json) {
    f->add_flag<JsonMessageFlag>('*').set_pattern(kJsonPattern);
  } else {
    f->set_pattern(kTextPattern);
  }
  return f;
}

}  // namespace

absl::Status InitLogging(absl::string_view format, absl::string_view level) {
  if (format != "text" && format != "json") {
    return absl::InvalidArgumentError(absl::StrCat("--log_format=", format, ": must be text or json"));
  }
  const spdlog::level::level_enum lvl = spdlog::level::from_str(std::string(level));
  // from_str maps anything unknown to off; only "off" itself may mean off.
  if (lvl == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_level=", level, ": must be trace, debug, info, warning, error, critical or off"));
  }
  auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  sink->set_formatter(MakeFormatter(format == "json"));
  auto logger = std::make_shared<spdlog::logger>("qstreamd", std::move(sink));
  logger->set_level(lvl);
  // Lines are rare (start-up, checkpoints, errors): write each at once so a
  // SIGKILL loses none and tests see them as they happen.
  logger->flush_on(spdlog::level::trace);
  spdlog::set_default_logger(std::move(logger));
  return absl::OkStatus();
}

std::string FormatLogLineForTest(absl::string_view format, absl::string_view level,
                                 absl::string_view message) {
  const auto f = MakeFormatter(format == "json");
  const spdlog::details::log_msg msg("qstreamd", spdlog::level::from_str(std::string(level)),
                                     spdlog::string_view_t(message.data(), message.size()));
  spdlog::memory_buf_t buf;
  f->format(msg, buf);
  std::string line(buf.data(), buf.size());
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
  return line;
}

}  // namespace qstream
