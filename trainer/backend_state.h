// BackendState: everything a backend carries from one learner step to the
// next, in backend-independent form, so a checkpoint written by one backend
// restores into either (trainer/checkpoint.h writes it to disk).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "trainer/network_spec.h"
#include "trainer/transitions.h"

namespace qstream {

// The replay ring as stored: rows [0, size) in slot order. While the ring is
// not full, cursor == size; once full, slot `cursor` holds the oldest item.
struct ReplayState {
  int64_t capacity = 0;  // ring capacity of the run that saved it
  int64_t size = 0;
  int64_t cursor = 0;    // next slot to write
  float max_priority = 1.0f;
  TransitionColumns rows;         // size rows
  std::vector<float> priorities;  // size priorities, already ^alpha
};

// Rewrites `state` for a ring of `capacity` slots: the same items oldest to
// newest from slot 0 (the newest `capacity` when it holds more). Identity
// when the capacity already matches.
ReplayState ResizeReplayState(const ReplayState& state, int64_t capacity);

// Checks a replay state against the network and its own counters: column
// shapes, actions in range, priorities finite and >= 0, size/cursor within
// capacity. InvalidArgument naming the column otherwise.
absl::Status CheckReplayState(const ReplayState& state, const NetworkSpec& spec);

struct BackendState {
  int64_t steps = 0;            // learner steps taken, skipped ones included (t)
  int64_t applied_updates = 0;  // Adam updates applied (its bias-correction k)
  // Flat buffers in NetworkSpec layout.
  std::vector<float> params;  // online
  std::vector<float> target;
  std::vector<float> adam_m;
  std::vector<float> adam_v;
  std::vector<int64_t> guard_trips;  // index = GuardReason
  int64_t consecutive_trips = 0;     // tripped steps in a row at the snapshot
  bool has_replay = false;
  ReplayState replay;
};

// Checks the network part: four buffers of `num_params` values, counters >= 0.
// InvalidArgument naming the buffer otherwise.
absl::Status CheckNetworkState(const BackendState& state, int64_t num_params);

// What LoadState replaces.
enum class StateParts {
  kAll,      // network, optimizer, counters and (when has_replay) the replay
  kNetwork,  // params, target, Adam moments and applied_updates only (guard rollback)
};

}  // namespace qstream
