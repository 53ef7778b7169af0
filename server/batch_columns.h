// Replay columns shaped for a network.
#pragma once

#include "trainer/network_spec.h"
#include "trainer/transitions.h"

namespace qstream {

// Empty columns shaped for `spec`.
TransitionColumns EmptyColumns(const NetworkSpec& spec);

}  // namespace qstream
