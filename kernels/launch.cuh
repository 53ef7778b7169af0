// Device and launch side of programmatic dependent launch (kernels/launch.h).
//
// Every kernel launched through LaunchDependent calls WaitForPredecessor()
// as its first statement, before it reads or writes global memory:
// griddepcontrol.wait returns once the grid before it in the stream has
// completed and its writes are visible, and griddepcontrol.launch_dependents
// then lets the next grid be launched while this one runs, so its blocks are
// resident and waiting when this one drains. Waiting first means at most two
// grids of the step are resident at once, and since each grid completed only
// after its own wait, a kernel also sees everything every earlier kernel
// wrote. Without the launch attribute (or before sm_90) both are no-ops.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "kernels/launch.h"

namespace qstream::kernels {

__device__ __forceinline__ void WaitForPredecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...), with the
// programmatic stream serialization attribute when DependentLaunch(which).
template <typename... Params, typename... Args>
cudaError_t LaunchDependent(StepKernel which, void (*kernel)(Params...), dim3 grid, dim3 block,
                            size_t shared_bytes, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1] = {};
  if (DependentLaunch(which)) {
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace qstream::kernels
