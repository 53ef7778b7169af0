// Text-format TrainerConfig loading as qstreamd --config runs it: ParseConfig
// (text format, defaults, ValidateConfig). An accepted config must also build
// its network, summarize, and print to text that loads back to the same config.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_init.h"
#include "google/protobuf/text_format.h"
#include "trainer/config.h"
#include "trainer/network_spec.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  qstream::QuietProtobufLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace qstream;
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<v1::TrainerConfig> config = ParseConfig(text);
  if (!config.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(config.status()) && !config.status().message().empty());
    return 0;
  }
  FUZZ_CHECK(ValidateConfig(*config).ok());
  FUZZ_CHECK(NetworkSpec::Create(config->network()).ok());
  FUZZ_CHECK(!ConfigSummary(*config).empty());
  std::string printed;
  FUZZ_CHECK(google::protobuf::TextFormat::PrintToString(*config, &printed));
  absl::StatusOr<v1::TrainerConfig> again = ParseConfig(printed);
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->SerializeAsString() == config->SerializeAsString());
  return 0;
}
