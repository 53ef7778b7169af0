// A data-parallel group of learners (config distributed; README
// "Scale-out"): what a backend needs to join it, and the part of the config
// every rank must share.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "qstream/v1/config.pb.h"

namespace qstream {

struct DistributedGroup {
  int world_size = 1;
  int rank = 0;
  // ncclUniqueId bytes from rank 0's rendezvous (server/rendezvous.h).
  std::string nccl_unique_id;
};

// The fields every rank of a group must share, and nothing else: network,
// optimizer, guard, loss, returns, matmul precision, and the replay's batch
// size and priority settings (not its capacity: shards may differ).
v1::TrainerConfig GroupLearnerConfig(const v1::TrainerConfig& config);

// OK when `joining` (from rank `rank`) shares rank 0's learner config;
// FailedPrecondition naming the fields that differ and both values otherwise.
absl::Status CheckGroupConfig(const v1::TrainerConfig& rank0, const v1::TrainerConfig& joining, int rank);

}  // namespace qstream
