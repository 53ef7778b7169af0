// Constants of the learner step that host code and CUDA kernels share, defined
// once (trainer/backend.h states the contract they implement). Plain C++17, no
// dependencies, so kernels/ can include it without reaching into trainer/.
#pragma once

#include <cmath>
#include <cstdint>

// Functions below are compiled for the device too when nvcc includes this.
#ifdef __CUDACC__
#define QS_HOST_DEVICE __host__ __device__
#else
#define QS_HOST_DEVICE
#endif

namespace qstream::step {

// Guard reasons (backend.h step 9), first match wins. trainer's GuardReason
// enum and the device's DeviceState counters use these values.
inline constexpr int32_t kGuardNone = 0;
inline constexpr int32_t kGuardNonFiniteLoss = 1;
inline constexpr int32_t kGuardNonFiniteGrad = 2;
inline constexpr int32_t kGuardGradNorm = 3;
inline constexpr int32_t kGuardQRange = 4;
inline constexpr int kNumGuardReasons = 5;

// |Q| may exceed the support bound by float rounding of sum_z p_z z.
inline constexpr double kSupportBoundSlack = 1e-4;

// The guard's largest allowed |Q|: max_abs_q when > 0, else the support's
// bound max(|v_min|, |v_max|) with kSupportBoundSlack.
inline float QBound(float max_abs_q, float v_min, float v_max) {
  if (max_abs_q > 0) return max_abs_q;
  const double bound = std::fabs(v_min) > std::fabs(v_max) ? std::fabs(v_min) : std::fabs(v_max);
  return static_cast<float>(bound * (1.0 + kSupportBoundSlack));
}

// Weight alpha of the MSE term in the loss blend (1 - alpha) CE + alpha MSE
// at step t (steps taken before the running one), config.proto MseBlend:
// start + (end - start) * min(1, t / steps), exactly end from t = steps on
// (and when steps <= 0). Computed in float with one fused multiply-add on
// host and device alike, so the CPU and CUDA backends use the same alpha
// bit for bit.
QS_HOST_DEVICE inline float LinearSchedule(float start, float end, int64_t steps, int64_t t) {
  if (steps <= 0 || t >= steps) return end;
  return fmaf(end - start, static_cast<float>(t) / static_cast<float>(steps), start);
}

QS_HOST_DEVICE inline float MseBlendAlpha(float start, float end, int64_t steps, int64_t t) {
  return LinearSchedule(start, end, steps, t);
}

// Adam's learning rate at step t (OptimizerConfig lr, lr_end,
// lr_decay_steps): lr itself when decay_steps <= 0, else the linear schedule
// above, in the same float arithmetic on host and device.
QS_HOST_DEVICE inline float LearningRate(float lr, float lr_end, int64_t decay_steps, int64_t t) {
  return decay_steps <= 0 ? lr : LinearSchedule(lr, lr_end, decay_steps, t);
}

}  // namespace qstream::step
