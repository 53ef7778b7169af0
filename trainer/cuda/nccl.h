// NCCL for the data-parallel group (config distributed): the library, loaded
// at run time, and an RAII communicator.
//
// libnccl.so.2 is loaded with dlopen on first use (NCCL_LIBRARY overrides the
// file name), so a single-GPU daemon neither needs nor maps the 200 MB
// library; a build without nccl.h (QSTREAM_WITH_NCCL=0) reports that instead.
// NVLink multicast stays off: NCCL_NVLS_ENABLE=0 is set in the process
// environment before the library initializes unless the caller set it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace qstream::cuda {

// Bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES).
inline constexpr size_t kNcclUniqueIdBytes = 128;

// A fresh ncclUniqueId (rank 0 of a group makes it; the others receive it
// through the rendezvous). Fails when NCCL cannot be loaded, saying why.
absl::StatusOr<std::string> NewNcclUniqueId();

// "NCCL 2.28.9" of the loaded library, or why it cannot be loaded.
std::string NcclVersion();

// One rank's communicator of a group, bound to the current CUDA device.
class NcclComm {
 public:
  // Collective: every rank calls it with the same id and world size. Blocks
  // until the group has formed.
  static absl::StatusOr<std::unique_ptr<NcclComm>> Create(const std::string& unique_id, int world_size,
                                                          int rank);
  ~NcclComm();  // ncclCommDestroy
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int world_size() const { return world_size_; }
  int rank() const { return rank_; }

  // Enqueue on `stream` (and so may be captured into a graph). In place:
  // data[i] = mean over ranks of data[i].
  absl::Status AllReduceMean(float* data, int64_t count, cudaStream_t stream);
  // In place: every rank's `bytes` at data become rank `root`'s.
  absl::Status Broadcast(void* data, int64_t bytes, int root, cudaStream_t stream);

 private:
  NcclComm(void* comm, int world_size, int rank) : comm_(comm), world_size_(world_size), rank_(rank) {}
  void* comm_;  // ncclComm_t
  int world_size_;
  int rank_;
};

}  // namespace qstream::cuda
