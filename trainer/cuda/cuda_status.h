// One check macro for CUDA runtime and cuBLAS returns: a failure becomes an
// absl::Status naming the call, file and line, returned from the enclosing
// function (which returns absl::Status or absl::StatusOr).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace qstream::cuda {

inline absl::Status ToStatus(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(file, ":", line, ": ", expr, ": ", cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ")"));
}

inline absl::Status ToStatus(cublasStatus_t err, const char* expr, const char* file, int line) {
  if (err == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(file, ":", line, ": ", expr, ": ", cublasGetStatusName(err), " (", cublasGetStatusString(err), ")"));
}

}  // namespace qstream::cuda

#define QS_CUDA_CHECK(expr)                                                                 \
  do {                                                                                      \
    ::absl::Status qs_cuda_status_ = ::qstream::cuda::ToStatus((expr), #expr, __FILE__, __LINE__); \
    if (!qs_cuda_status_.ok()) return qs_cuda_status_;                                      \
  } while (0)

// Returns the absl::Status of `expr` when it is not OK.
#define QS_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status qs_status_ = (expr);      \
    if (!qs_status_.ok()) return qs_status_; \
  } while (0)
