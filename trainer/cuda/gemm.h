// The three GEMMs of a Linear layer through cuBLASLt, with the bias and ReLU
// work folded into the GEMM epilogues. Row-major activations [rows][features]
// and the flat buffer's W[out][in] row-major; cuBLASLt is column-major, so a
// row-major [r][c] matrix is passed as the column-major c x r matrix (ld c).
//   Forward:        Y = act(X W^T + b)          epilogue BIAS / RELU_BIAS / RELU_AUX_BIAS
//                   (RELU_AUX_BIAS also stores the ReLU bit mask for the backward)
//   BackwardData:   dX = dY W (+ beta dX)       optional DRELU_BGRAD: dX *= relu'(mask),
//                                               bias grad of the layer below = sum_rows dX
//   BackwardWeight: dW = dY^T X                 optional BGRADB: db = sum_rows dY
// Compute type from the operand precision: exact fp32 (CUBLAS_COMPUTE_32F),
// TF32 or bf16 tensor cores (the _FAST_ compute types).
// A plan (descriptors + heuristic algorithm) is made per call: the step is
// enqueued once, into the captured graph, so this host work is not per step.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/fused_mlp.h"
#include "trainer/cuda/device_memory.h"

namespace qstream::cuda {

// ReLU bit mask of a [rows][features] activation, as cuBLASLt stores it:
// column-major features x rows bits with a leading dimension divisible by 128.
struct ReluMask {
  void* bits = nullptr;
  int64_t ld = 0;  // bits per row of the activation
  static int64_t LeadingDim(int features) { return (features + 127) / 128 * 128; }
  static size_t Bytes(int features, int rows) { return static_cast<size_t>(LeadingDim(features)) / 8 * rows; }
};

// Strided batch of Forward calls: batch b uses x + b stride_x, w (and the
// bias) + b stride_w, y + b stride_y, the mask + b (mask.ld * rows) bits.
struct GemmBatch {
  int count = 1;
  int64_t stride_x = 0;  // elements
  int64_t stride_w = 0;
  int64_t stride_y = 0;
};

class Gemm {
 public:
  Gemm() = default;
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;
  ~Gemm();

  absl::Status Init(cudaStream_t stream, kernels::Precision precision);

  // y = x W^T + b, then ReLU when relu; mask.bits != nullptr stores the ReLU mask.
  // b == nullptr: plain y = x W^T (bias and ReLU left to the caller).
  // Unimplemented when cuBLASLt has no algorithm for a fused epilogue.
  absl::Status Forward(const float* x, const float* w, const float* b, int rows, int in, int out, bool relu,
                       ReluMask mask, float* y, GemmBatch batch = {}) const;
  // dx = dy W + beta dx; with mask.bits: dx *= relu'(mask) and bias_grad = sum_rows dx.
  absl::Status BackwardData(const float* dy, const float* w, int rows, int in, int out, float beta, ReluMask mask,
                            float* bias_grad, float* dx) const;
  // dw = dy^T x; with bias_grad: bias_grad = sum_rows dy.
  absl::Status BackwardWeight(const float* dy, const float* x, int rows, int in, int out, float* bias_grad,
                              float* dw) const;

 private:
  // batch strides: a, b, d, bias in elements; the mask's in bits.
  struct Strides {
    int count = 1;
    int64_t a = 0, b = 0, d = 0, bias = 0, aux = 0;
  };
  absl::Status Matmul(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, const float* a, int lda,
                      const float* b, int ldb, float beta, float* d, int ldd, cublasLtEpilogue_t epilogue,
                      const void* bias, const ReluMask& mask, const Strides& batch) const;

  cublasLtHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cublasComputeType_t compute_ = CUBLAS_COMPUTE_32F;
  DeviceBuffer<char> workspace_;
};

}  // namespace qstream::cuda
