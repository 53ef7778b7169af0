#include "kernels/launch.h"

namespace qstream::kernels {
namespace {

thread_local uint32_t dependent_launch = 0;

}  // namespace

bool DependentLaunch(StepKernel kernel) { return (dependent_launch >> static_cast<int>(kernel)) & 1u; }

DependentLaunchScope::DependentLaunchScope(uint32_t mask) : previous_(dependent_launch) {
  dependent_launch = mask;
}

DependentLaunchScope::~DependentLaunchScope() { dependent_launch = previous_; }

}  // namespace qstream::kernels
