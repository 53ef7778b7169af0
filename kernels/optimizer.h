// The optimizer stages of the learner step (backend.h contract, steps 9-10)
// over the one flat parameter buffer: the first stage of the global grad norm
// (the cuBLASLt path; the fused path's weight-gradient kernel writes the same
// partials) and clip + Adam + target update in one pass. The second norm stage,
// the guard, statistics and priority write-back are kernels/step_finalize.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/views.h"

namespace qstream::kernels {

// Blocks of the first norm stage; fixed so the summation order is fixed.
inline constexpr int kNormBlocks = 256;

// Stage 1: block k sums g_i^2 over the contiguous chunk k of n/kNormBlocks
// elements (threads strided inside it, then a fixed block tree) and alone
// writes partials[k]. Grid: kNormBlocks x 256.
cudaError_t LaunchGradSumSquares(const float* grads, int64_t n, float* partials, cudaStream_t stream);

struct AdamArgs {
  float* params = nullptr;
  const float* grads = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  float* target = nullptr;
  int64_t n = 0;
  float lr = 0;
  float lr_end = 0;            // with lr_decay_steps > 0: step::LearningRate at state->t - 1
  int64_t lr_decay_steps = 0;  // 0: lr throughout
  float beta1 = 0;
  float beta2 = 0;
  float epsilon = 0;
  float tau = 0;
  int32_t target_period = 0;  // > 0: hard copy every period steps; 0: EMA
  const DeviceState* state = nullptr;
};

// One pass, thread i (grid-stride) owns element i: when the guard passed,
// g = grads[i] * clip_scale; m, v, theta Adam update with the step's bias
// corrections; then (tripped or not) the target: copy when period > 0 and
// (t+1) % period == 0 (state->t already holds t+1 here), EMA
// target += tau (theta - target) when period == 0.
cudaError_t LaunchAdamTarget(const AdamArgs& args, cudaStream_t stream);

}  // namespace qstream::kernels
