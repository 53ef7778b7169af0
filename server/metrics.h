// Prometheus export of the learner's statistics and the ingest counters
// (metric names: DESIGN.md "Metrics"). A poll thread reads Learner::status()
// and DrainStepTimes() on a fixed period, so the learner never synchronizes
// with the device for metrics; an Exposer serves /metrics (pull) and an
// optional Gateway pushes to a Pushgateway.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/gateway.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/ingest_counters.h"
#include "trainer/learner.h"

namespace qstream {

struct MetricsOptions {
  // host:port of the /metrics endpoint ("...:0" picks a free port); empty: none.
  std::string listen;
  // host:port of a Pushgateway; empty: no push.
  std::string pushgateway;
  absl::Duration push_interval = absl::Seconds(10);
  // Value of the instance label of pushed metrics (Daemon defaults it to
  // hostname:grpc_port).
  std::string instance;
  // How often the statistics are read from the learner.
  absl::Duration poll_interval = absl::Milliseconds(500);
};

// Step-time histogram buckets, seconds: 1-2-5 steps from 10 us to 1 s.
std::vector<double> StepSecondsBuckets();

class Metrics {
 public:
  // Binds the exposer (when options.listen is set). `learner` and `counters`
  // must outlive the object.
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(const MetricsOptions& options, Learner* learner,
                                                         const IngestCounters* counters);
  ~Metrics();  // Stop()s

  // Starts polling (and pushing, labelled with `instance` when the options
  // left it empty).
  void Start(const std::string& instance = "");
  // Stops the poll thread after one last poll (and push). Idempotent.
  void Stop();

  // Reads the learner and the counters once into the registry.
  void Poll() ABSL_LOCKS_EXCLUDED(mu_);
  // Pushes the registry to the Pushgateway; returns the HTTP status (or -1).
  int Push();

  int port() const { return port_; }
  // Mean step time of the last poll window with steps, seconds (0 before any).
  double recent_step_seconds() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

 private:
  Metrics(const MetricsOptions& options, Learner* learner, const IngestCounters* counters);
  void Run();

  const MetricsOptions options_;
  Learner* const learner_;
  const IngestCounters* const counters_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::unique_ptr<prometheus::Gateway> gateway_;
  std::string gateway_host_, gateway_port_;
  int port_ = 0;

  prometheus::Histogram* step_seconds_;
  prometheus::Counter* train_steps_;
  prometheus::Counter* transitions_ingested_;
  prometheus::Family<prometheus::Counter>* ingest_rejected_;
  prometheus::Gauge* replay_size_;
  prometheus::Gauge* replay_capacity_;
  prometheus::Gauge* q_min_;
  prometheus::Gauge* q_mean_;
  prometheus::Gauge* q_max_;
  prometheus::Gauge* loss_;
  prometheus::Gauge* grad_norm_;
  prometheus::Gauge* target_clip_fraction_;
  std::vector<prometheus::Counter*> guard_trips_;  // index = GuardReason (0 unused)
  prometheus::Gauge* guard_tripped_;
  prometheus::Gauge* policy_version_;
  prometheus::Gauge* actor_streams_;
  prometheus::Gauge* samples_per_insert_;
  prometheus::Histogram* policy_lag_;
  prometheus::Gauge* checkpoint_seconds_;
  prometheus::Gauge* checkpoint_snapshot_seconds_;
  prometheus::Gauge* checkpoint_bytes_;
  prometheus::Gauge* checkpoint_last_step_;
  prometheus::Gauge* checkpoint_last_timestamp_;
  prometheus::Counter* checkpoints_written_;
  prometheus::Family<prometheus::Counter>* checkpoint_failures_;
  prometheus::Counter* guard_rollbacks_;
  prometheus::Gauge* learner_halted_;

  // Totals already exported, to turn the sources' running totals into
  // counter increments. Touched by Poll only.
  mutable absl::Mutex mu_;
  int64_t seen_steps_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t seen_transitions_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int64_t> seen_guard_trips_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> seen_rejected_ ABSL_GUARDED_BY(mu_);
  PolicyLagCounts seen_lag_ ABSL_GUARDED_BY(mu_);
  int64_t seen_checkpoints_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int64_t> seen_checkpoint_failures_ ABSL_GUARDED_BY(mu_);
  int64_t seen_rollbacks_ ABSL_GUARDED_BY(mu_) = 0;
  double recent_step_seconds_ ABSL_GUARDED_BY(mu_) = 0;

  absl::Notification stop_;
  std::thread thread_;
  bool started_ = false;
};

}  // namespace qstream
