// Actor: steps N environments with an epsilon-greedy policy over the latest
// snapshot (the forward-only policy library, the code the daemon's Evaluate
// runs) and streams their 1-step transitions through a Writer (KIND_STEP,
// one env_id per environment) so the daemon assembles n-step returns per
// environment. Every finished episode is reported on the stream (return,
// length, policy version; labelled with `env`) for the daemon's episode
// metrics.
//
// Several streams (one per rank of a data-parallel learner) split the
// environments into contiguous blocks as even as possible: with n envs and
// N streams, envs [k*n/N, (k+1)*n/N) go to stream k through a Writer of
// their own (env ids 0.. within the block), so each env's n-step windows
// stay on one rank. The policy comes from `policy` alone (every rank holds
// the same weights).
#pragma once

#include <atomic>
#include <cstdint>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "clients/cpp/epsilon_schedule.h"
#include "clients/cpp/experience_stream.h"
#include "clients/cpp/policy_watcher.h"

namespace qstream::actor {

struct ActorOptions {
  // The built-in environment (env_registry.h); also the env label of the
  // episodes reported to the daemon.
  std::string env = "CartPole";
  int num_envs = 4;
  // Stop after this many environment steps (all envs together); 0: no cap.
  int64_t max_steps = 0;
  EpsilonSchedule epsilon;
  uint64_t seed = 1;
  // Transitions per TransitionBatch (at least num_envs) ...
  int batch_transitions = 64;
  // ... or fewer, once the oldest of them has waited this long.
  absl::Duration flush_after = absl::Milliseconds(20);
  // Episodes in the moving mean of returns.
  int return_window = 20;
  // Stop once the moving mean reaches this (over a full window); NaN: never.
  double stop_at_return = std::numeric_limits<double>::quiet_NaN();
  absl::Duration report_every = absl::Seconds(5);
};

struct ActorResult {
  int64_t env_steps = 0;
  int64_t episodes = 0;
  double mean_return = 0;  // over the last return_window episodes
  bool reached_target = false;
  StreamTotals stream;  // summed over the streams
};

// Runs until `stop` is set, max_steps is reached or the return target is met;
// sends everything collected and waits for its acks before returning.
// Progress lines go to `log`. `streams` (at least one, at most num_envs)
// must outlive the call; the caller closes them.
absl::StatusOr<ActorResult> RunActor(const ActorOptions& options,
                                     const std::vector<ExperienceStream*>& streams, PolicyWatcher& policy,
                                     const std::atomic<bool>& stop, std::ostream& log);

}  // namespace qstream::actor
