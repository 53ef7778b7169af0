// Validation of an incoming TransitionBatch against the network shape and the
// server limits. A pure function: the RPC layer calls it before anything of
// the batch is converted or inserted, and a failure becomes an error Ack.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "qstream/v1/config.pb.h"
#include "qstream/v1/experience.pb.h"
#include "trainer/network_spec.h"

namespace qstream {

struct BatchError {
  v1::Error::Code code = v1::Error::INVALID_FIELD;
  // Name of the proto field that failed, e.g. "actions" (also the metric label).
  std::string field;
  // Names the field and the offending index, e.g.
  // "actions[13]: 7 out of range [0, 5) for branch 1".
  std::string message;

  v1::Error ToProto() const;
};

// Every value BatchError::field can take (the ingest-rejected metric's
// reason label values).
const std::vector<std::string>& BatchFieldNames();

// Checks, in order: kind (KIND_NSTEP or KIND_STEP; KIND_UNSPECIFIED is an
// error), stream_id (at most 128 bytes of [A-Za-z0-9._:@/-]), count (> 0,
// <= server.max_batch_transitions), column lengths (obs, next_obs = count x
// obs_dim; actions = count x branches; rewards = count; KIND_NSTEP:
// discounts = count, no per-step columns; KIND_STEP: done = count, truncated
// and env_ids empty or count, no discounts, never done[i] and truncated[i]
// both true), then values (obs, next_obs, rewards finite; actions in range of
// their branch; discounts finite and in [0, 1]), policy_version >= 0.
// Returns nullopt when the batch is valid.
std::optional<BatchError> ValidateBatch(const v1::TransitionBatch& batch, const NetworkSpec& spec,
                                        const v1::ServerConfig& server);

}  // namespace qstream
