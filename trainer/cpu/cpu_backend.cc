#include "trainer/cpu/cpu_backend.h"

namespace qstream {

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const v1::TrainerConfig&) {
  return absl::UnimplementedError("cpu backend: not yet implemented");
}

}  // namespace qstream
