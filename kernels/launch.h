// Programmatic dependent launch (Hopper, compute capability 9.0+) for the
// kernels of the learner step. A launcher that goes through
// kernels/launch.cuh's LaunchDependent adds
// cudaLaunchAttributeProgrammaticStreamSerialization while a
// DependentLaunchScope that turned it on is alive on the calling thread (the
// CUDA backend opens one around its graph capture); elsewhere (tests, the
// replay's insert kernel) it launches as before.
#pragma once

namespace qstream::kernels {

// Whether this thread's step launchers add the dependent-launch attribute.
bool DependentLaunch();

// Sets DependentLaunch() for this thread until it goes out of scope.
class DependentLaunchScope {
 public:
  explicit DependentLaunchScope(bool on);
  ~DependentLaunchScope();
  DependentLaunchScope(const DependentLaunchScope&) = delete;
  DependentLaunchScope& operator=(const DependentLaunchScope&) = delete;

 private:
  bool previous_;
};

}  // namespace qstream::kernels
