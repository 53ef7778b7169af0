// HealthMonitor: the grpc.health.v1 status of qstreamd (README "Health").
// SERVING once the learner runs; NOT_SERVING while restoring (before Start),
// while the guard has halted the learner, after a failed backend step paused
// it (until Resume), while the learner thread has been
// in one piece of work for longer than server.liveness_timeout_seconds (a
// hung device or a deadlock: it reads Learner::progress(), which takes no
// lock), and after Stop (shutdown). A paused learner, or one waiting for
// data, is live. Every change is logged with its reason and handed to the
// sink (the daemon sets both health services from it).
//
// Liveness alone is the status of the service name "liveness" (kLivenessService):
// NOT_SERVING only while the learner thread is stuck, or at shutdown. That is
// what a container liveness probe asks: a restart cures a hung device, not a
// guard halt or a restore in progress (those are the readiness of "").
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "trainer/learner.h"

namespace qstream {

struct HealthInputs {
  bool started = false;  // the learner runs (restore, if any, is over)
  bool stopped = false;  // shutting down
  bool halted = false;   // by the guard
  Learner::Progress progress;
  double liveness_timeout_seconds = 0;  // 0: no liveness check
};

struct HealthVerdict {
  bool serving = false;
  bool live = false;   // the "liveness" service
  std::string reason;  // why not serving; "" when serving
};

// grpc.health.v1 service name of liveness alone.
inline constexpr char kLivenessService[] = "liveness";

// The pure rule above.
HealthVerdict EvaluateHealth(const HealthInputs& in);

class HealthMonitor {
 public:
  using Sink = std::function<void(bool serving, bool live)>;

  // `learner` must outlive the monitor. `period`: how often liveness is
  // checked.
  HealthMonitor(const Learner* learner, double liveness_timeout_seconds, absl::Duration period, Sink sink);
  ~HealthMonitor();  // Stop()s

  // Restore is over and the learner runs: evaluates now, then every period.
  void Start() ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_SERVING from now on; joins the thread. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // From the learner's halt listener (any thread): evaluates now.
  void SetHalted(bool halted) ABSL_LOCKS_EXCLUDED(mu_);

  bool serving() const { return serving_.load(std::memory_order_relaxed); }
  bool live() const { return live_.load(std::memory_order_relaxed); }
  std::string reason() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Evaluate() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run();

  const Learner* const learner_;
  const double liveness_timeout_seconds_;
  const absl::Duration period_;
  const Sink sink_;
  std::atomic<bool> serving_{false};
  std::atomic<bool> live_{true};
  mutable absl::Mutex mu_;
  HealthInputs inputs_ ABSL_GUARDED_BY(mu_);
  std::string reason_ ABSL_GUARDED_BY(mu_) = "starting";
  bool reported_ ABSL_GUARDED_BY(mu_) = false;  // the sink has been called once
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace qstream
