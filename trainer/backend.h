// Backend: one replay + one learner step, behind one interface for the CPU
// (trainer/cpu, the numerical oracle) and CUDA (trainer/cuda) implementations.
//
// The learner step (DESIGN.md), the contract both backends implement exactly:
//   t = steps taken before this one (Step() calls, skipped or not).
//   1. Sample: p_i = stored priority (already ^alpha), total = sum_{i<size} p_i.
//      For b in [0,B): u_b = (b + Uniform01(seed, t, b)) / B * total;
//      idx_b = smallest j with prefix_j > u_b (prefix inclusive), clamped to size-1.
//      beta = beta_start + (beta_end - beta_start) * min(1, t / beta_anneal_steps)
//      (beta_end when beta_anneal_steps == 0).
//      w_b = (size * p_idx / total)^-beta, then w_b /= max_b w_b.
//   2. Gather s, a, R, discount, s'.
//   3. Online forward on s and s'; target forward on s'.
//   4. Per branch: l[a][z] = V[z] + A[a][z] - mean_a A[a][z]; p = softmax_z(l);
//      Q[a] = sum_z p[a][z] * atom(z).
//   5. Double DQN: a* = argmax_a Q_online(s')[a] (ties: lowest a); target dist
//      p_target(s', a*).
//   6. Tz_j = R + discount * atom(j); clip mass = sum of p_target[j] over atoms
//      with Tz_j outside [v_min, v_max]; Tz clamped; bj = (Tz_j - v_min)/dz
//      clamped to [0, atoms-1]; l = floor(bj), u = ceil(bj); l == u: m[l] += p_j,
//      else m[l] += p_j (u - bj), m[u] += p_j (bj - l).
//      target_clip_fraction = total clip mass / (B * branches).
//      Label smoothing eps (loss.label_smoothing; 0: m' = m, untouched):
//      m' = (1 - eps) m + eps sum(m) / atoms.
//   7. CE_b = (1/branches) sum_br -sum_z m'[z] log_softmax(l(s)[a_br])[z]
//      (log-probs in fp32 or better). MSE blend: alpha = step::MseBlendAlpha(
//      loss.mse_blend, t); when alpha > 0, with p = softmax(l(s)[a_br]),
//      Q = sum_z p_z atom(z), y = sum_z m[z] atom(z) (m unsmoothed),
//      MSE_b = (1/branches) sum_br 1/2 (Q - y)^2 / (v_max - v_min)^2 and
//      L_b = (1 - alpha) CE_b + alpha MSE_b; else L_b = CE_b.
//      loss = (1/B) sum_b w_b L_b.
//   8. Gradient of loss w.r.t. all online parameters (targets are constants).
//   9. Guard, first match wins: loss non-finite -> kNonFiniteLoss; grad norm
//      non-finite -> kNonFiniteGrad; max_grad_norm > 0 and norm > max_grad_norm
//      -> kGradNorm; any Q_online(s) non-finite or |Q| > bound (max_abs_q, or
//      max(|v_min|,|v_max|) * (1 + 1e-4) when 0) -> kQRange.
//      On a trip the Adam update and the priority write-back are skipped.
//  10. scale = clip > 0 ? min(1, clip / (norm + 1e-6)) : 1; g *= scale.
//      Adam (k = applied updates so far + 1): m = b1 m + (1-b1) g;
//      v = b2 v + (1-b2) g^2; theta -= lr * (m / (1-b1^k)) / (sqrt(v / (1-b2^k)) + eps).
//      Target: period K > 0: copy online -> target when (t+1) % K == 0;
//      else target += tau * (online - target). Runs every step, tripped or not.
//  11. Priorities: p_idx = (CE_b + priority_epsilon)^replay.alpha (the CE, not L_b:
//      the blend's alpha changes the gradient, not the replay); for duplicate
//      indices the largest b wins; max_priority = max(max_priority, p).
//   Stats: loss, grad norm (before clip), Q min/mean/max over Q_online(s) of all
//   B x total_actions, target_clip_fraction, guard reason.
//
// Replay: ring buffer of `capacity`; Insert overwrites the oldest items; new
// items get the current max priority (initially 1). Indices are ring slots.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/step_constants.h"
#include "qstream/v1/config.pb.h"
#include "trainer/backend_state.h"
#include "trainer/network_spec.h"
#include "trainer/transitions.h"

namespace qstream {

enum class GuardReason : int32_t {
  kNone = step::kGuardNone,
  kNonFiniteLoss = step::kGuardNonFiniteLoss,
  kNonFiniteGrad = step::kGuardNonFiniteGrad,
  kGradNorm = step::kGuardGradNorm,
  kQRange = step::kGuardQRange,
};
inline constexpr int kNumGuardReasons = step::kNumGuardReasons;
// Metric label of a reason: "none", "nonfinite_loss", "nonfinite_grad", "grad_norm", "q_range".
const char* GuardReasonName(GuardReason reason);

struct StepStats {
  int64_t step = 0;  // steps taken including this one
  float loss = 0;
  float grad_norm = 0;
  float q_min = 0;
  float q_mean = 0;
  float q_max = 0;
  float target_clip_fraction = 0;
  GuardReason guard = GuardReason::kNone;
  int64_t consecutive_trips = 0;  // tripped steps in a row ending at this one
};

// Memory of the backend's device, bytes (-1: no device).
struct DeviceMemory {
  int64_t used_bytes = -1;  // in use on the device once the backend is set up (all processes)
  int64_t total_bytes = -1;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;    // "cpu" or "cuda"
  virtual std::string device() const = 0;  // e.g. "cpu (2 threads)", "NVIDIA H200"
  virtual const NetworkSpec& spec() const = 0;
  // Fixed once the backend is created (nothing is allocated after set-up).
  virtual DeviceMemory device_memory() const { return {}; }

  // Appends to the replay ring at max priority. Columns must match the spec
  // (validated by the caller; an inconsistent batch returns InvalidArgument).
  virtual absl::Status Insert(const TransitionColumns& batch) = 0;
  // Inserts `batches` in order; (*statuses)[i] is batch i's outcome. The
  // learner hands over every batch gathered between two steps at once, so a
  // backend can pack them into one upload (the CUDA replay does); this
  // default inserts them one by one.
  // Seconds the inserts since the last call spent waiting for the device
  // (a staging buffer still being copied from): the device's pace, which the
  // learner does not count as insert cost.
  virtual double ConsumeInsertWaitSeconds() { return 0; }
  virtual void InsertMany(const std::vector<const TransitionColumns*>& batches,
                          std::vector<absl::Status>* statuses) {
    statuses->clear();
    for (const TransitionColumns* b : batches) statuses->push_back(Insert(*b));
  }
  virtual int64_t replay_size() const = 0;
  virtual int64_t replay_capacity() const = 0;

  // One learner step (contract above). FailedPrecondition when the replay is empty.
  virtual absl::Status Step() = 0;
  virtual int64_t steps() const = 0;

  // Statistics of the most recent step whose statistics reached the host. The
  // CPU backend returns the last step's; the CUDA backend the latest copied
  // asynchronously (every stats_every steps), without waiting on the device.
  // Guard trips are counted per step in `guard_trips` (index = reason).
  virtual StepStats last_stats() = 0;
  virtual std::vector<int64_t> guard_trips() = 0;
  // Step times measured since the last call, appended to `out` as
  // (seconds per step, number of steps) windows. Both backends time every
  // step (count 1): the CPU backend on the host clock, the CUDA backend with
  // a pair of CUDA events around each graph replay, read once complete.
  virtual void DrainStepTimes(std::vector<std::pair<double, int64_t>>* out) = 0;

  // Online parameters (flat layout of NetworkSpec). May synchronize.
  virtual std::vector<float> GetParams() = 0;
  virtual absl::Status SetParams(const std::vector<float>& params) = 0;

  // Copies the whole learner state (the replay only when include_replay) to
  // host memory; waits for the device. Called between steps.
  virtual absl::Status SaveState(bool include_replay, BackendState* out) = 0;
  // Replaces the state (see StateParts); shapes must match the network
  // (InvalidArgument naming the buffer otherwise). A replay of another
  // capacity is resized (ResizeReplayState). kAll without a replay empties
  // the replay. The statistics restart from the restored counters.
  virtual absl::Status LoadState(const BackendState& state, StateParts parts) = 0;

  // Data-parallel group (config distributed; the CUDA backend over NCCL):
  // every Step all-reduces (averages) the flat gradient buffer and the
  // guard's inputs over the ranks before step 9, so all ranks take the same
  // guard decision and apply the same update. SyncGroup makes rank 0's
  // network state (online and target parameters, Adam moments, t and the
  // applied-update count) every rank's; a collective, called by every rank
  // at the same point (after its restore, before its first step). No-op
  // without a group.
  virtual absl::Status SyncGroup() { return absl::OkStatus(); }
  // World size and rank of the backend's group; 1 and 0 without one.
  virtual int world_size() const { return 1; }
  virtual int rank() const { return 0; }
};

}  // namespace qstream
