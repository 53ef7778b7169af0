// Programmatic dependent launch (Hopper, compute capability 9.0+) for the
// kernels of the learner step. A launcher that goes through
// kernels/launch.cuh's LaunchDependent adds
// cudaLaunchAttributeProgrammaticStreamSerialization while a
// DependentLaunchScope that turned it on is alive on the calling thread (the
// CUDA backend opens one around its graph capture); elsewhere (tests, the
// replay's insert kernel) it launches as before.
#pragma once

#include <cstdint>

namespace qstream::kernels {

// The step's kernels that can launch as dependents, one bit each in a mask.
enum class StepKernel : int {
  kChunkSums,
  kSample,
  kPack,
  kChain,
  kLoss,
  kWeightGrad,
  kFinalize,
  kGradNorm,
  kAdam,
  kCount,
};
inline constexpr uint32_t kAllStepKernels = (1u << static_cast<int>(StepKernel::kCount)) - 1;
constexpr uint32_t StepKernelBit(StepKernel k) { return 1u << static_cast<int>(k); }
// The CUDA backend's default on 9.0+ devices: every kernel but the sampler's
// two and the weight gradients. Measured on H100 (bench/NOTES.md, stop 32):
// with the sampler's kernels as dependents as well, h200 steps were 1-4 us
// slower; with the weight gradients, h200 B = 1024 BF16 was 9 us slower (its
// tiles, launched early, pile onto the SMs the backward chain leaves idle
// instead of spreading over all of them).
inline constexpr uint32_t kDefaultStepKernels =
    kAllStepKernels & ~(StepKernelBit(StepKernel::kChunkSums) | StepKernelBit(StepKernel::kSample) |
                        StepKernelBit(StepKernel::kWeightGrad));

// Whether this thread's launcher of `kernel` adds the dependent-launch attribute.
bool DependentLaunch(StepKernel kernel);

// Sets the mask DependentLaunch() reads on this thread until it goes out of scope.
class DependentLaunchScope {
 public:
  explicit DependentLaunchScope(uint32_t mask);
  ~DependentLaunchScope();
  DependentLaunchScope(const DependentLaunchScope&) = delete;
  DependentLaunchScope& operator=(const DependentLaunchScope&) = delete;

 private:
  uint32_t previous_;
};

}  // namespace qstream::kernels
