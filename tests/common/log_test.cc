#include "common/log.h"

#include <regex>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace qstream {
namespace {

TEST(Log, TextLinesCarryUtcTimeAndLevel) {
  const std::string line = FormatLogLineForTest("text", "warning", "restore: refused ckpt-9");
  EXPECT_TRUE(std::regex_match(
      line, std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z W qstreamd: restore: refused ckpt-9)")))
      << line;
  EXPECT_NE(FormatLogLineForTest("text", "info", "x").find("Z I qstreamd: x"), std::string::npos);
  EXPECT_NE(FormatLogLineForTest("text", "error", "x").find("Z E qstreamd: x"), std::string::npos);
}

TEST(Log, JsonLinesAreOneObjectEachWhateverTheMessage) {
  const std::string hostile = "quote \" backslash \\ newline \n tab \t ctrl \x01 bad utf-8 \xff end";
  const std::string line = FormatLogLineForTest("json", "error", hostile);
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  const nlohmann::json j = nlohmann::json::parse(line);  // throws (fails the test) when not JSON
  EXPECT_EQ(j.at("level"), "error");
  EXPECT_TRUE(std::regex_match(j.at("time").get<std::string>(),
                               std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z)")));
  const std::string msg = j.at("msg");
  EXPECT_EQ(msg.substr(0, 48), hostile.substr(0, 48));
  EXPECT_NE(msg.find("end"), std::string::npos);
  EXPECT_EQ(j.size(), 3u);
}

TEST(Log, InitRejectsUnknownFormatAndLevel) {
  EXPECT_TRUE(InitLogging("json", "debug").ok());
  EXPECT_TRUE(InitLogging("text", "off").ok());
  EXPECT_TRUE(InitLogging("text").ok());
  const absl::Status format = InitLogging("xml");
  EXPECT_FALSE(format.ok());
  EXPECT_NE(format.message().find("--log_format"), absl::string_view::npos);
  const absl::Status level = InitLogging("text", "loud");
  EXPECT_FALSE(level.ok());
  EXPECT_NE(level.message().find("--log_level"), absl::string_view::npos);
}

}  // namespace
}  // namespace qstream
