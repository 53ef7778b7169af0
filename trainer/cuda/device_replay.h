// Replay ring on the device: columnar buffers (obs, next_obs, actions,
// rewards, discounts, priorities^alpha). Inserts go through two staging
// buffers, each pinned on the host and mirrored on the device: the upload
// (host -> device staging) runs on a copy stream of its own, beside the step
// in flight, and the learner stream then waits for it and moves the rows into
// the ring (device -> device, ~1 us for a thousand rows) and commits them. So
// inserts are ordered against the step's graph replays (a step sees an
// insert whole or not at all) without the PCIe copy holding up the steps.
// Size, cursor and max priority live in DeviceState (device memory) and are
// advanced in stream order, so the captured graph never needs re-capture
// when data arrives; the host keeps a mirror of size and cursor.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/views.h"
#include "trainer/backend_state.h"
#include "trainer/cuda/device_memory.h"
#include "trainer/network_spec.h"
#include "trainer/transitions.h"

namespace qstream::cuda {

class DeviceReplay {
 public:
  // `state` is device memory the step graph reads; `staging_rows` bounds one
  // upload (larger batches go in several).
  static absl::StatusOr<std::unique_ptr<DeviceReplay>> Create(const NetworkSpec& spec, int64_t capacity,
                                                              int64_t staging_rows, cudaStream_t stream,
                                                              kernels::DeviceState* state);

  // Appends at max priority, overwriting the oldest items. Returns before
  // the copy finishes; waits only when both staging buffers are in flight.
  absl::Status Insert(const TransitionColumns& batch);
  // Inserts `batches` in order, packed together into the staging buffers: one
  // set of copies and one commit kernel per staging buffer filled, not per
  // batch. (*statuses)[i] is batch i's outcome (a batch that does not match
  // the spec is left out with InvalidArgument; a CUDA error fails the batches
  // of the chunk it hit and every later one).
  void InsertMany(const std::vector<const TransitionColumns*>& batches, std::vector<absl::Status>* statuses);

  // Seconds spent waiting for a staging buffer since the last call.
  double ConsumeWaitSeconds() {
    const double s = wait_seconds_;
    wait_seconds_ = 0;
    return s;
  }

  // Copies rows [0, size), priorities, cursor and max priority to the host;
  // waits for the stream.
  absl::Status Save(ReplayState* out);
  // Replaces the contents (`state` has this capacity and passed
  // CheckReplayState) and the size/cursor/max priority in DeviceState; waits.
  absl::Status Load(const ReplayState& state);

  int64_t size() const { return size_; }
  int64_t capacity() const { return capacity_; }
  kernels::ReplayColumns columns() const;

 private:
  // One chunk of rows on its way to the ring: the host side (pinned) and the
  // device side in the same layout, one block of 32-bit words with a region
  // per column of staging_rows rows each (StagedRows): obs, next_obs,
  // actions, rewards, discounts. A full chunk is one upload; a partial one
  // three (obs and next_obs together, actions, rewards and discounts together).
  struct Staging {
    PinnedBuffer<float> host;
    DeviceBuffer<float> dev;  // what the copy stream uploads and the learner stream moves into the ring
    Event uploaded;           // copy stream: the host buffer has been read (it may be refilled)
    Event consumed;           // learner stream: the device buffer has been read (it may be uploaded to)
    bool in_flight = false;
  };
  // Word offsets of the column regions in a staging block, and its size.
  struct StagingLayout {
    size_t obs = 0, next_obs = 0, actions = 0, rewards = 0, discounts = 0, words = 0;
  };
  static StagingLayout LayoutFor(int64_t rows, int obs_dim, int num_branches);

  DeviceReplay(const NetworkSpec& spec, int64_t capacity, int64_t staging_rows, cudaStream_t stream,
               kernels::DeviceState* state);
  absl::Status Allocate();
  // The next staging buffer, once its previous copies have left it.
  absl::StatusOr<Staging*> AcquireStaging();
  // Copies `rows` rows of `batch` from `first_row` into staging rows [at, at + rows).
  void Pack(const TransitionColumns& batch, int64_t first_row, int64_t rows, Staging* st, int64_t at) const;
  // Uploads staging rows [0, rows) and (in learner-stream order) moves them
  // into the ring at the cursor and commits them: one kernel.
  absl::Status Commit(Staging* st, int64_t rows);

  const int obs_dim_;
  const int num_branches_;
  const std::vector<int> branch_actions_;
  const int64_t capacity_;
  const int64_t staging_rows_;
  const StagingLayout layout_;
  cudaStream_t stream_;
  kernels::DeviceState* state_;
  Stream copy_stream_;  // uploads into the device staging buffers

  DeviceBuffer<float> obs_, next_obs_, rewards_, discounts_, priorities_;
  DeviceBuffer<int32_t> actions_;
  std::array<Staging, 2> staging_;
  int next_staging_ = 0;
  double wait_seconds_ = 0;
  int64_t size_ = 0;
  int64_t cursor_ = 0;
};

}  // namespace qstream::cuda
