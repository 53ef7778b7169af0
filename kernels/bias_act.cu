#include "kernels/bias_act.h"

#include <cstdint>

namespace qstream::kernels {
namespace {

constexpr int kColsPerBlock = 32;
constexpr int kRowGroups = 32;  // 1024 threads: more rows in flight per column

template <bool kRelu>
__global__ void BiasActivationKernel(float* __restrict__ y, const float* __restrict__ bias, int64_t n, int cols) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float v = y[i] + bias[i % cols];
    if (kRelu) v = v < 0.0f ? 0.0f : v;  // keeps NaN visible to the guard
    y[i] = v;
  }
}

__global__ void ActivationBackwardBiasGradKernel(float* __restrict__ dy, const float* __restrict__ act, float* __restrict__ db,
                                                 int rows, int cols) {
  __shared__ float partial[kRowGroups][kColsPerBlock + 1];
  const int c = blockIdx.x * kColsPerBlock + threadIdx.x;
  float sum = 0.0f;
  if (c < cols) {
    for (int r = threadIdx.y; r < rows; r += kRowGroups) {
      const int64_t i = int64_t{r} * cols + c;
      float g = dy[i];
      if (act != nullptr) {
        g = act[i] > 0.0f ? g : 0.0f;
        dy[i] = g;
      }
      sum += g;
    }
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
    for (int k = 0; k < kRowGroups; ++k) total += partial[k][threadIdx.x];
    db[c] = total;
  }
}

}  // namespace

cudaError_t LaunchBiasActivation(Matrix y, const float* bias, bool relu, cudaStream_t stream) {
  const int64_t n = int64_t{y.rows} * y.cols;
  const int threads = 256;
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks > 2048) blocks = 2048;
  if (relu) {
    BiasActivationKernel<true><<<static_cast<int>(blocks), threads, 0, stream>>>(y.data, bias, n, y.cols);
  } else {
    BiasActivationKernel<false><<<static_cast<int>(blocks), threads, 0, stream>>>(y.data, bias, n, y.cols);
  }
  return cudaGetLastError();
}

cudaError_t LaunchActivationBackwardBiasGrad(Matrix dy, const float* activation, float* bias_grad,
                                             cudaStream_t stream) {
  const dim3 block(kColsPerBlock, kRowGroups);
  const dim3 grid((dy.cols + kColsPerBlock - 1) / kColsPerBlock);
  ActivationBackwardBiasGradKernel<<<grid, block, 0, stream>>>(dy.data, activation, bias_grad, dy.rows, dy.cols);
  return cudaGetLastError();
}

}  // namespace qstream::kernels
