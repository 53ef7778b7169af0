#include "kernels/optimizer.h"

#include "common/step_constants.h"
#include "kernels/launch.cuh"
#include "kernels/warp_reduce.cuh"

namespace qstream::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) GradSumSquaresKernel(const float* __restrict__ g, int64_t n,
                                                                 float* __restrict__ partials) {
  WaitForPredecessor();
  __shared__ float scratch[kThreads / 32];
  const int64_t chunk = (n + gridDim.x - 1) / gridDim.x;
  const int64_t begin = blockIdx.x * chunk;
  const int64_t end = begin + chunk < n ? begin + chunk : n;
  float s = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) s += g[i] * g[i];
  s = BlockSum(s, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kThreads) AdamTargetKernel(AdamArgs a) {
  WaitForPredecessor();
  const DeviceState* s = a.state;
  const bool apply = s->apply != 0;
  const float scale = s->clip_scale;
  const float bc1 = s->bias_correction1;
  const float bc2 = s->bias_correction2;
  const int64_t t_next = s->t;  // already advanced by the finalize kernel
  const float lr = step::LearningRate(a.lr, a.lr_end, a.lr_decay_steps, t_next - 1);
  const bool copy = a.target_period > 0 && t_next % a.target_period == 0;
  const bool ema = a.target_period <= 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < a.n; i += int64_t{gridDim.x} * blockDim.x) {
    float theta = a.params[i];
    if (apply) {
      const float g = a.grads[i] * scale;
      const float m = a.beta1 * a.m[i] + (1.0f - a.beta1) * g;
      const float v = a.beta2 * a.v[i] + (1.0f - a.beta2) * g * g;
      a.m[i] = m;
      a.v[i] = v;
      theta -= lr * (m / bc1) / (sqrtf(v / bc2) + a.epsilon);
      a.params[i] = theta;
    }
    if (copy) {
      a.target[i] = theta;
    } else if (ema) {
      const float tg = a.target[i];
      a.target[i] = tg + a.tau * (theta - tg);
    }
  }
}

int GridFor(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > 1056) blocks = 1056;  // 8 blocks per SM on 132 SMs; the rest is grid-stride
  return static_cast<int>(blocks);
}

}  // namespace

cudaError_t LaunchGradSumSquares(const float* grads, int64_t n, float* partials, cudaStream_t stream) {
  return LaunchDependent(StepKernel::kGradNorm, GradSumSquaresKernel, kNormBlocks, kThreads, 0, stream, grads,
                         n, partials);
}

cudaError_t LaunchAdamTarget(const AdamArgs& a, cudaStream_t stream) {
  return LaunchDependent(StepKernel::kAdam, AdamTargetKernel, GridFor(a.n), kThreads, 0, stream, a);
}

}  // namespace qstream::kernels
