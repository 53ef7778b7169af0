// The finished episodes an actor reported on one batch
// (TransitionBatch.episodes and .env), as validated: ValidateBatch takes
// them off the batch, the ingest session hands them back in the batch's
// outcome once its sequence committed as new, and IngestCounters counts
// them into qstream_episode_return / qstream_episode_length_steps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qstream {

struct EpisodeReport {
  double episode_return = 0;
  int64_t length = 0;  // environment steps
  int64_t policy_version = 0;
};

struct EpisodeReports {
  std::string env;  // the metrics' env label as the batch named it; "" when it named none
  std::vector<EpisodeReport> reports;

  bool empty() const { return reports.empty(); }
  int64_t bytes() const { return static_cast<int64_t>(env.size() + reports.size() * sizeof(EpisodeReport)); }
};

}  // namespace qstream
