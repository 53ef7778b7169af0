// Typed views over device memory shared by the kernels and their host
// launchers. Plain structs (no ownership): the CUDA backend owns the memory
// (RAII, trainer/cuda/device_memory.h) and hands these to the launchers.
#pragma once

#include <cstdint>

#include "common/step_constants.h"

namespace qstream::kernels {

// Row-major matrix: rows x cols, element (r, c) at data[r * cols + c].
struct Matrix {
  float* data = nullptr;
  int rows = 0;
  int cols = 0;
};

// Largest branch count a kernel parameter block carries (NetworkSpec allows 64).
inline constexpr int kMaxBranches = 64;

// The categorical head: atoms on [v_min, v_max], branches of actions.
struct HeadShape {
  int num_atoms = 0;
  int num_branches = 0;
  int total_actions = 0;
  float v_min = 0;
  float v_max = 0;
  float delta_z = 0;
  int branch_offset[kMaxBranches + 1] = {};  // first action of each branch; [num_branches] = total
};

// Replay columns on the device, `capacity` ring slots each.
struct ReplayColumns {
  float* obs = nullptr;        // capacity x obs_dim
  float* next_obs = nullptr;   // capacity x obs_dim
  int32_t* actions = nullptr;  // capacity x num_branches
  float* rewards = nullptr;    // capacity
  float* discounts = nullptr;  // capacity
  float* priorities = nullptr; // capacity, already ^alpha; 0 in never-written slots
  int64_t capacity = 0;
  int obs_dim = 0;
  int num_branches = 0;
};

// Device statistics of the latest step (the host copies this struct).
struct DeviceStats {
  int64_t step = 0;  // steps taken including this one
  float loss = 0;
  float grad_norm = 0;
  float q_min = 0;
  float q_mean = 0;
  float q_max = 0;
  float target_clip_fraction = 0;
  int32_t guard = 0;  // GuardReason
  int32_t applied = 0;
};

inline constexpr int kNumGuardReasonsDevice = step::kNumGuardReasons;

// Every scalar the step carries from one graph replay to the next lives here,
// so the captured graph never needs re-capture: replay size/cursor (written by
// inserts), max priority, step counter t, Adam's update count.
struct DeviceState {
  int64_t t = 0;           // steps taken before the running one
  int64_t adam_updates = 0;
  int64_t replay_size = 0;
  int64_t replay_cursor = 0;
  float max_priority = 1.0f;
  int32_t apply = 0;       // this step's update passes the guard
  float clip_scale = 1.0f;
  float bias_correction1 = 1.0f;  // 1 - beta1^k of this step's update
  float bias_correction2 = 1.0f;  // 1 - beta2^k
  DeviceStats stats;
  int64_t guard_trips[kNumGuardReasonsDevice] = {};
  int64_t consecutive_trips = 0;  // tripped steps in a row, ending at the latest
};

}  // namespace qstream::kernels
