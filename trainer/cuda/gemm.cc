#include "trainer/cuda/gemm.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "trainer/cuda/cuda_status.h"

namespace qstream::cuda {
namespace {

// cuBLAS's recommended workspace on Hopper.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr uint32_t kMaxAlignment = 256;

// Largest power of two (<= 256) dividing the address: what the heuristic may assume.
uint32_t Alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = kMaxAlignment;
  while (align > 4 && a % align != 0) align >>= 1;
  return align;
}

struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

Gemm::~Gemm() {
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

absl::Status Gemm::Init(cudaStream_t stream, kernels::Precision precision) {
  QS_CUDA_CHECK(cublasLtCreate(&handle_));
  stream_ = stream;
  compute_ = precision == kernels::Precision::kTf32   ? CUBLAS_COMPUTE_32F_FAST_TF32
             : precision == kernels::Precision::kBf16 ? CUBLAS_COMPUTE_32F_FAST_16BF
                                                      : CUBLAS_COMPUTE_32F;
  return workspace_.Allocate(kWorkspaceBytes);
}

absl::Status Gemm::Matmul(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, const float* a,
                          int lda, const float* b, int ldb, float beta, float* d, int ldd, cublasLtEpilogue_t epilogue,
                          const void* bias, const ReluMask& mask, const Strides& batch) const {
  Descs s;
  QS_CUDA_CHECK(cublasLtMatmulDescCreate(&s.op, compute_, CUDA_R_32F));
  QS_CUDA_CHECK(cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  QS_CUDA_CHECK(cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  QS_CUDA_CHECK(cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  if (bias != nullptr) {
    QS_CUDA_CHECK(cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  if (mask.bits != nullptr) {
    QS_CUDA_CHECK(
        cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &mask.bits, sizeof(mask.bits)));
    QS_CUDA_CHECK(cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &mask.ld, sizeof(mask.ld)));
  }
  QS_CUDA_CHECK(cublasLtMatrixLayoutCreate(&s.a, CUDA_R_32F, op_a == CUBLAS_OP_N ? m : k,
                                           op_a == CUBLAS_OP_N ? k : m, lda));
  QS_CUDA_CHECK(cublasLtMatrixLayoutCreate(&s.b, CUDA_R_32F, op_b == CUBLAS_OP_N ? k : n,
                                           op_b == CUBLAS_OP_N ? n : k, ldb));
  QS_CUDA_CHECK(cublasLtMatrixLayoutCreate(&s.d, CUDA_R_32F, m, n, ldd));
  if (batch.count > 1) {
    const int32_t count = batch.count;
    for (auto [layout, stride] : {std::pair{s.a, batch.a}, std::pair{s.b, batch.b}, std::pair{s.d, batch.d}}) {
      QS_CUDA_CHECK(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      QS_CUDA_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                     sizeof(stride)));
    }
    if (bias != nullptr) {
      QS_CUDA_CHECK(cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &batch.bias,
                                                   sizeof(batch.bias)));
    }
    if (mask.bits != nullptr) {
      QS_CUDA_CHECK(cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &batch.aux,
                                                   sizeof(batch.aux)));
    }
  }
  QS_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&s.pref));
  const size_t ws = workspace_.bytes();
  QS_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  // Every batch's pointer must meet the alignment the algorithm assumes.
  const bool batched = batch.count > 1;
  const uint32_t align_a = std::min(Alignment(a), batched ? Alignment(a + batch.a) : kMaxAlignment);
  const uint32_t align_b = std::min(Alignment(b), batched ? Alignment(b + batch.b) : kMaxAlignment);
  const uint32_t align_d = std::min(Alignment(d), batched ? Alignment(d + batch.d) : kMaxAlignment);
  QS_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                     sizeof(align_a)));
  QS_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                     sizeof(align_b)));
  QS_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d,
                                                     sizeof(align_d)));
  QS_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                                     sizeof(align_d)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t heuristic =
      cublasLtMatmulAlgoGetHeuristic(handle_, s.op, s.a, s.b, s.d, s.d, s.pref, 1, &result, &found);
  if (heuristic != CUBLAS_STATUS_NOT_SUPPORTED) QS_CUDA_CHECK(heuristic);
  if (heuristic == CUBLAS_STATUS_NOT_SUPPORTED || found == 0) {
    return absl::UnimplementedError(absl::StrCat("cuBLASLt: no algorithm for m=", m, " n=", n, " k=", k, " epilogue=",
                                            static_cast<int>(epilogue)));
  }
  const float alpha = 1.0f;
  QS_CUDA_CHECK(cublasLtMatmul(handle_, s.op, &alpha, a, s.a, b, s.b, &beta, d, s.d, d, s.d, &result.algo,
                               workspace_.get(), ws, stream_));
  return absl::OkStatus();
}

absl::Status Gemm::Forward(const float* x, const float* w, const float* b, int rows, int in, int out, bool relu,
                           ReluMask mask, float* y, GemmBatch batch) const {
  // Col-major: Y^T (out x rows) = W (stored in x out, so op T) * X^T (in x rows); bias along `out`.
  // Without a bias the caller applies bias and activation itself.
  const bool fused = b != nullptr;
  const bool aux = fused && relu && mask.bits != nullptr;
  const cublasLtEpilogue_t epi = !fused ? CUBLASLT_EPILOGUE_DEFAULT
                                 : !relu ? CUBLASLT_EPILOGUE_BIAS
                                 : (aux ? CUBLASLT_EPILOGUE_RELU_AUX_BIAS : CUBLASLT_EPILOGUE_RELU_BIAS);
  Strides strides;
  strides.count = batch.count;
  strides.a = batch.stride_w;
  strides.b = batch.stride_x;
  strides.d = batch.stride_y;
  strides.bias = batch.stride_w;
  strides.aux = mask.ld * rows;
  return Matmul(CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, w, in, x, in, 0.0f, y, out, epi, b,
                aux ? mask : ReluMask{}, strides);
}

absl::Status Gemm::BackwardData(const float* dy, const float* w, int rows, int in, int out, float beta,
                                ReluMask mask, float* bias_grad, float* dx) const {
  // Col-major: dX^T (in x rows) = W^T-stored (in x out) * dY^T (out x rows).
  const bool fused = mask.bits != nullptr;
  return Matmul(CUBLAS_OP_N, CUBLAS_OP_N, in, rows, out, w, in, dy, out, beta, dx, in,
                fused ? CUBLASLT_EPILOGUE_DRELU_BGRAD : CUBLASLT_EPILOGUE_DEFAULT, fused ? bias_grad : nullptr,
                mask, Strides{});
}

absl::Status Gemm::BackwardWeight(const float* dy, const float* x, int rows, int in, int out, float* bias_grad,
                                  float* dw) const {
  // Col-major: dW^T (in x out) = X^T (in x rows) * dY (rows x out); BGRADB sums op(B) over rows.
  return Matmul(CUBLAS_OP_N, CUBLAS_OP_T, in, out, rows, x, in, dy, out, 0.0f, dw, in,
                bias_grad != nullptr ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_DEFAULT, bias_grad, ReluMask{},
                Strides{});
}

}  // namespace qstream::cuda
