// CUDA backend: the learner step of trainer/backend.h captured once as one
// CUDA graph (sample -> gather -> forward -> loss -> backward -> guard ->
// Adam + target -> priority write-back) and replayed by Step().
//
// GEMMs go through cuBLASLt with bias/ReLU in the epilogues and the online
// and target forward passes as one strided-batch GEMM per layer. The
// environment variable QSTREAM_CUDA_EPILOGUES=unbatched|unfused forces the
// simpler paths (two forward GEMMs per layer; plain GEMMs + bias/ReLU
// kernels) for diagnosis; device() names the path when it is not the default.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "qstream/v1/config.pb.h"
#include "trainer/backend.h"

namespace qstream {

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const v1::TrainerConfig& config);

// True when a CUDA device can be used; otherwise `why` (if set) says why not.
bool CudaDeviceAvailable(std::string* why);

}  // namespace qstream
