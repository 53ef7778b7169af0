#include "trainer/cuda/gemm.h"

namespace qstream::cuda {
namespace {
// cuBLAS's recommended workspace on Hopper.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr float kOne = 1.0f;
constexpr float kZero = 0.0f;
}  // namespace

Gemm::~Gemm() {
  if (handle_ != nullptr) cublasDestroy(handle_);
}

absl::Status Gemm::Init(cudaStream_t stream, bool allow_tf32) {
  QS_CUDA_CHECK(cublasCreate(&handle_));
  QS_CUDA_CHECK(cublasSetStream(handle_, stream));
  if (absl::Status s = workspace_.Allocate(kWorkspaceBytes); !s.ok()) return s;
  QS_CUDA_CHECK(cublasSetWorkspace(handle_, workspace_.get(), workspace_.bytes()));
  QS_CUDA_CHECK(cublasSetMathMode(handle_, allow_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  QS_CUDA_CHECK(cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST));
  compute_ = allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  return absl::OkStatus();
}

absl::Status Gemm::Forward(const float* x, const float* w, int rows, int in, int out, float* y) const {
  // Col-major: Y^T (out x rows) = W (stored in x out, so op T) * X^T (in x rows).
  QS_CUDA_CHECK(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &kOne, w, CUDA_R_32F, in, x,
                             CUDA_R_32F, in, &kZero, y, CUDA_R_32F, out, compute_, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

absl::Status Gemm::BackwardData(const float* dy, const float* w, int rows, int in, int out, float* dx,
                                float beta) const {
  // Col-major: dX^T (in x rows) = W^T-stored (in x out) * dY^T (out x rows).
  QS_CUDA_CHECK(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, in, rows, out, &kOne, w, CUDA_R_32F, in, dy,
                             CUDA_R_32F, out, &beta, dx, CUDA_R_32F, in, compute_, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

absl::Status Gemm::BackwardWeight(const float* dy, const float* x, int rows, int in, int out, float* dw) const {
  // Col-major: dW^T (in x out) = X^T (in x rows) * dY (rows x out).
  QS_CUDA_CHECK(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_T, in, out, rows, &kOne, x, CUDA_R_32F, in, dy,
                             CUDA_R_32F, out, &kZero, dw, CUDA_R_32F, in, compute_, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

}  // namespace qstream::cuda
