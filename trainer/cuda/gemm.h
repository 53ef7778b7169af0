// The three GEMMs of a Linear layer y = x W^T (+ b elsewhere) through cuBLAS,
// on row-major activations and the flat buffer's W[out][in] row-major:
//   Forward:      Y[rows][out]  = X[rows][in] W^T
//   BackwardData: dX[rows][in]  = dY[rows][out] W   (+ beta dX)
//   BackwardWeight: dW[out][in] = dY^T X
// cuBLAS is column-major, so a row-major [r][c] matrix is passed as the
// column-major c x r matrix with leading dimension c.
// TF32 tensor cores when allowed, else exact fp32 (CUBLAS_COMPUTE_32F with
// the default math mode, which never down-converts).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "trainer/cuda/device_memory.h"

namespace qstream::cuda {

class Gemm {
 public:
  Gemm() = default;
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;
  ~Gemm();

  // Creates the handle on `stream` with its own workspace, so that graph
  // capture never makes cuBLAS allocate.
  absl::Status Init(cudaStream_t stream, bool allow_tf32);

  absl::Status Forward(const float* x, const float* w, int rows, int in, int out, float* y) const;
  absl::Status BackwardData(const float* dy, const float* w, int rows, int in, int out, float* dx,
                            float beta) const;
  absl::Status BackwardWeight(const float* dy, const float* x, int rows, int in, int out, float* dw) const;

 private:
  cublasHandle_t handle_ = nullptr;
  cublasComputeType_t compute_ = CUBLAS_COMPUTE_32F;
  DeviceBuffer<char> workspace_;
};

}  // namespace qstream::cuda
