// Loading and validating TrainerConfig (proto/qstream/v1/config.proto).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "qstream/v1/config.pb.h"

namespace qstream {

// The built-in default: proto defaults with repeated fields filled
// (trunk [64, 64], branch_actions [2]).
v1::TrainerConfig DefaultConfig();

// Fills empty repeated fields with their documented defaults.
void FillDefaults(v1::TrainerConfig* config);

// Checks every field's range; the error names the field ("replay.alpha: ...").
absl::Status ValidateConfig(const v1::TrainerConfig& config);

// The CUDA operand precision: matmul_precision, or FP32 when only the
// deprecated allow_tf32: false is given.
v1::TrainerConfig::MatmulPrecision MatmulPrecision(const v1::TrainerConfig& config);

// Parses a text-format TrainerConfig, fills defaults and validates.
absl::StatusOr<v1::TrainerConfig> ParseConfig(const std::string& text);
absl::StatusOr<v1::TrainerConfig> LoadConfigFile(const std::string& path);

// One line: network shape, batch, replay capacity, n-step, lr.
std::string ConfigSummary(const v1::TrainerConfig& config);

// Named configs of BENCH.md: "h200", "small". NotFound otherwise.
absl::StatusOr<v1::TrainerConfig> BenchConfig(const std::string& name);

}  // namespace qstream
