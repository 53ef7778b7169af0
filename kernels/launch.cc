#include "kernels/launch.h"

namespace qstream::kernels {
namespace {

thread_local bool dependent_launch = false;

}  // namespace

bool DependentLaunch() { return dependent_launch; }

DependentLaunchScope::DependentLaunchScope(bool on) : previous_(dependent_launch) { dependent_launch = on; }

DependentLaunchScope::~DependentLaunchScope() { dependent_launch = previous_; }

}  // namespace qstream::kernels
