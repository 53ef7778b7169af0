// Conversion of a validated client-assembled (KIND_NSTEP) batch into the
// columns the replay takes: one copy per column, straight from the wire
// buffers.
#pragma once

#include "qstream/v1/experience.pb.h"
#include "trainer/network_spec.h"
#include "trainer/transitions.h"

namespace qstream {

TransitionColumns ColumnsFromNStepBatch(const v1::TransitionBatch& batch, const NetworkSpec& spec);

// Empty columns shaped for `spec`.
TransitionColumns EmptyColumns(const NetworkSpec& spec);

}  // namespace qstream
