// CPU backend (Eigen): the numerical oracle of the learner step and the
// embedded default backend. See trainer/backend.h for the step contract.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "qstream/v1/config.pb.h"
#include "trainer/backend.h"

namespace qstream {

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const v1::TrainerConfig& config);

}  // namespace qstream
