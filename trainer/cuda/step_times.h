// Step times of the CUDA backend without a host sync per step: CUDA event
// pairs around runs of graph replays ("windows"; the backend closes one after
// every replay, so each step is timed), read when they are done.
// Not thread-safe: the backend calls it with its lock held.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "trainer/cuda/device_memory.h"

namespace qstream::cuda {

class StepTimes {
 public:
  // Windows that may wait for Drain; when all are in use, steps go untimed
  // until one is drained.
  static constexpr int kWindows = 512;

  absl::Status Init(cudaStream_t stream);
  // Before a replay: starts a window unless one is open (or none is free).
  absl::Status Open();
  // After a replay enqueued inside the open window.
  void CountStep();
  // Ends the open window, e.g. before work that is not step time (an upload).
  absl::Status Close();
  // Appends (seconds per step, steps) of every finished window in order; the
  // first failed event's error is returned (its window is dropped).
  absl::Status Drain(std::vector<std::pair<double, int64_t>>* out);

 private:
  struct Window {
    Event start, end;
    int64_t steps = 0;
  };
  cudaStream_t stream_ = nullptr;
  std::vector<Window> windows_;
  std::deque<int> free_;
  std::deque<int> pending_;
  int open_ = -1;
};

}  // namespace qstream::cuda
