#include "trainer/backends/backend_factory.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "trainer/cpu/cpu_backend.h"
#if QSTREAM_WITH_CUDA
#include "trainer/cuda/cuda_backend.h"
#include "trainer/cuda/nccl.h"
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

absl::StatusOr<std::string> NewGroupId() {
#if QSTREAM_WITH_CUDA
  return cuda::NewNcclUniqueId();
#else
  return absl::FailedPreconditionError("distributed: this build has no CUDA backend, so no NCCL");
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const v1::TrainerConfig& config, BackendKind kind,
                                                       const DistributedGroup* group) {
  std::string why;
  if (kind == BackendKind::kAuto) kind = CudaBackendAvailable(&why) ? BackendKind::kCuda : BackendKind::kCpu;
  if (group != nullptr && kind != BackendKind::kCuda) {
    return absl::FailedPreconditionError(
        absl::StrCat("distributed.world_size = ", group->world_size,
                     ": a data-parallel group needs the CUDA backend (NCCL); ",
                     why.empty() ? "--backend=cpu was asked for" : why));
  }
  if (kind == BackendKind::kCuda) {
#if QSTREAM_WITH_CUDA
    if (!CudaDeviceAvailable(&why)) return absl::FailedPreconditionError(absl::StrCat("--backend=cuda: ", why));
    return CreateCudaBackend(config, group);
#else
    CudaBackendAvailable(&why);
    return absl::FailedPreconditionError(absl::StrCat("--backend=cuda: ", why));
#endif
  }
  return CreateCpuBackend(config);
}

}  // namespace qstream
