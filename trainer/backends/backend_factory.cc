#include "trainer/backends/backend_factory.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "trainer/cpu/cpu_backend.h"
#if QSTREAM_WITH_CUDA
#include "trainer/cuda/cuda_backend.h"
#endif

namespace qstream {

absl::StatusOr<BackendKind> ParseBackendKind(const std::string& name) {
  if (name == "auto") return BackendKind::kAuto;
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") return BackendKind::kCuda;
  return absl::InvalidArgumentError(absl::StrCat("--backend: '", name, "' is not one of auto, cpu, cuda"));
}

bool CudaBackendAvailable(std::string* why) {
#if QSTREAM_WITH_CUDA
  return CudaDeviceAvailable(why);
#else
  if (why) *why = "built without CUDA (QSTREAM_CUDA=OFF or no nvcc)";
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const v1::TrainerConfig& config, BackendKind kind) {
  std::string why;
  if (kind == BackendKind::kAuto) kind = CudaBackendAvailable(&why) ? BackendKind::kCuda : BackendKind::kCpu;
  if (kind == BackendKind::kCuda) {
#if QSTREAM_WITH_CUDA
    if (!CudaDeviceAvailable(&why)) return absl::FailedPreconditionError(absl::StrCat("--backend=cuda: ", why));
    return CreateCudaBackend(config);
#else
    CudaBackendAvailable(&why);
    return absl::FailedPreconditionError(absl::StrCat("--backend=cuda: ", why));
#endif
  }
  return CreateCpuBackend(config);
}

}  // namespace qstream
