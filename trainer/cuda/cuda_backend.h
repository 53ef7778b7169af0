// CUDA backend: the learner step of trainer/backend.h captured once as one
// CUDA graph (sample -> gather -> forward -> loss -> backward -> guard ->
// Adam + target -> priority write-back) and replayed by Step().
//
// The network passes run fused (trainer/cuda/fused_network.h: a chain kernel
// per pass with activations in shared memory, one weight-gradient kernel) or
// through cuBLASLt (trainer/cuda/cublas_network.h, bias/ReLU in the epilogues, online
// and target forward as one strided-batch GEMM per layer). The environment
// variable QSTREAM_CUDA_PATH=auto|fused|cublas picks the path (auto: fused
// where it was measured faster, cuda::FusedNetwork::AutoDeclines);
// QSTREAM_CUDA_EPILOGUES=unbatched|unfused forces the simpler cuBLASLt paths
// for diagnosis. device() names the path in brackets, and why. On 9.0+
// devices the step's kernels launch as programmatic dependents
// (kernels/launch.h; device() ends in "[dependent launch]"):
// QSTREAM_CUDA_PDL=0 turns that off, a hex mask of kernels::StepKernel bits
// picks the kernels (a diagnostic; 1 or unset: the default set).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "qstream/v1/config.pb.h"
#include "trainer/backend.h"
#include "trainer/distributed.h"

namespace qstream {

// `group` (may be null): joins that data-parallel group over NCCL on the
// current device; blocks until every rank has joined. A group of world size 1
// is allowed (the all-reduce then runs in the graph over one rank).
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const v1::TrainerConfig& config,
                                                           const DistributedGroup* group = nullptr);

// True when a CUDA device can be used; otherwise `why` (if set) says why not.
bool CudaDeviceAvailable(std::string* why);

}  // namespace qstream
