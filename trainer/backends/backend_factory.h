// Chooses and creates a Backend: cpu, cuda, or auto (cuda when a device is usable).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "qstream/v1/config.pb.h"
#include "trainer/backend.h"
#include "trainer/distributed.h"

namespace qstream {

enum class BackendKind { kAuto, kCpu, kCuda };

// "auto" | "cpu" | "cuda"; InvalidArgument names the flag value otherwise.
absl::StatusOr<BackendKind> ParseBackendKind(const std::string& name);

// True when this build has the CUDA backend and a device is usable; `why`
// gets the reason when not.
bool CudaBackendAvailable(std::string* why);

// `group`: joins that data-parallel group (CUDA only; null: none).
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const v1::TrainerConfig& config, BackendKind kind,
                                                       const DistributedGroup* group = nullptr);

// A fresh NCCL unique id for a group that rank 0 forms (server/rendezvous.h);
// FailedPrecondition when this build or host has no NCCL.
absl::StatusOr<std::string> NewGroupId();

}  // namespace qstream
