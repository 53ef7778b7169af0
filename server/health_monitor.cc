#include "server/health_monitor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "spdlog/spdlog.h"

namespace qstream {

HealthVerdict EvaluateHealth(const HealthInputs& in) {
  if (in.stopped) return {false, false, "shutting down"};
  if (in.liveness_timeout_seconds > 0 && !in.progress.waiting &&
      in.progress.busy_seconds > in.liveness_timeout_seconds) {
    return {false, false,
            absl::StrFormat("the learner thread has been in one step, insert round or checkpoint snapshot "
                            "for %.1f s (server.liveness_timeout_seconds %g)",
                            in.progress.busy_seconds, in.liveness_timeout_seconds)};
  }
  if (!in.started) return {false, true, "restoring or starting"};
  if (in.halted) return {false, true, "the guard halted the learner (Admin Resume clears it)"};
  if (in.progress.step_failed) {
    return {false, true,
            "a learner step failed and paused the learner (Admin Status: last_error; Resume retries)"};
  }
  return {true, true, ""};
}

HealthMonitor::HealthMonitor(const Learner* learner, double liveness_timeout_seconds, absl::Duration period,
                             Sink sink)
    : learner_(learner),
      liveness_timeout_seconds_(liveness_timeout_seconds),
      period_(period),
      sink_(std::move(sink)) {
  absl::MutexLock lock(&mu_);
  inputs_.liveness_timeout_seconds = liveness_timeout_seconds_;
}

HealthMonitor::~HealthMonitor() { Stop(); }

void HealthMonitor::Start() {
  {
    absl::MutexLock lock(&mu_);
    if (inputs_.started || inputs_.stopped) return;
    inputs_.started = true;
    Evaluate();
  }
  thread_ = std::thread([this] { Run(); });
}

void HealthMonitor::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (inputs_.stopped) return;
    inputs_.stopped = true;
    Evaluate();
  }
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

void HealthMonitor::SetHalted(bool halted) {
  absl::MutexLock lock(&mu_);
  inputs_.halted = halted;
  Evaluate();
}

std::string HealthMonitor::reason() const {
  absl::MutexLock lock(&mu_);
  return reason_;
}

void HealthMonitor::Evaluate() {
  inputs_.progress = learner_->progress();
  const HealthVerdict v = EvaluateHealth(inputs_);
  const bool changed = !reported_ || v.serving != serving_.load(std::memory_order_relaxed) ||
                       v.live != live_.load(std::memory_order_relaxed);
  reason_ = v.reason;
  serving_.store(v.serving, std::memory_order_relaxed);
  live_.store(v.live, std::memory_order_relaxed);
  if (!changed) return;
  reported_ = true;
  if (v.serving) {
    spdlog::info("health: SERVING");
  } else if (inputs_.started && !inputs_.stopped) {
    spdlog::error("health: NOT_SERVING: {}", v.reason);
  } else {
    spdlog::info("health: NOT_SERVING: {}", v.reason);
  }
  // Under mu_, so the sink sees the changes in order; it must not call back.
  sink_(v.serving, v.live);
}

void HealthMonitor::Run() {
  while (!stop_.WaitForNotificationWithTimeout(period_)) {
    absl::MutexLock lock(&mu_);
    if (inputs_.stopped) return;
    Evaluate();
  }
}

}  // namespace qstream
