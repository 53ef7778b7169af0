// Prometheus export of the learner's statistics and the ingest counters
// (metric names: DESIGN.md "Metrics"). A poll thread reads Learner::status()
// and DrainStepTimes() on a fixed period, so the learner never synchronizes
// with the device for metrics; an Exposer serves /metrics (pull) and an
// optional Gateway pushes to a Pushgateway.
//
// The Exposer is civetweb, one worker thread per connection from accept until
// its response is written. Its bounds (README "Metrics endpoint"): a request
// must arrive, and its response leave, within request_timeout, or the
// connection is closed; keep-alive is off; at most threads + connection_queue
// connections are accepted at once and listen_backlog more wait in the
// kernel. A client holding a half-sent request therefore costs one worker for
// at most request_timeout, and scrapes go on while fewer than `threads` such
// clients are connected.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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
  // civetweb worker threads (num_threads): connections served at once.
  int threads = 16;
  // Time a connection has to send its request headers, and each response
  // write has, before it is closed (request_timeout_ms).
  absl::Duration request_timeout = absl::Seconds(5);
  // Accepted connections waiting for a worker (connection_queue); when full,
  // civetweb stops accepting.
  int connection_queue = 32;
  // Completed TCP handshakes the kernel holds for accept (listen_backlog);
  // beyond it new connections' SYNs are dropped.
  int listen_backlog = 512;
  // Basic-auth file for /metrics (MetricsAuth); empty: no auth.
  std::string auth_file;
  // host:port of a Pushgateway; empty: no push.
  std::string pushgateway;
  absl::Duration push_interval = absl::Seconds(10);
  // Value of the instance label of pushed metrics (Daemon defaults it to
  // hostname:grpc_port).
  std::string instance;
  // job label of pushed metrics: not the scrape job's ("qstream"), so pulled
  // and pushed series of one daemon never collide in Prometheus.
  std::string push_job = "qstream-push";
  // How often the statistics are read from the learner.
  absl::Duration poll_interval = absl::Milliseconds(500);
  // Labels every exported series carries, scraped and pushed (the daemon
  // sets rank="<r>" in a data-parallel group).
  std::map<std::string, std::string> const_labels;
};

// Step-time histogram buckets, seconds: 1-2-5 steps from 10 us to 1 s.
std::vector<double> StepSecondsBuckets();

// InvalidArgument naming the flag when a bound of `options` is out of range.
absl::Status ValidateMetricsOptions(const MetricsOptions& options);

using MetricsDigest = std::array<uint8_t, 32>;  // SHA-256 (Sha256Digest of server/security.h)

// The one user of /metrics basic auth, as digests only.
struct MetricsCredentials {
  MetricsDigest user;
  MetricsDigest password;
};

// Parses a --metrics_auth_file: one line `user password` or
// `user sha256:<64 hex digits of SHA-256(password)>`; blank lines and lines
// starting with '#' are skipped. The user has no ':' (basic auth splits
// there); neither field has spaces. InvalidArgument naming `source` and the
// line (never its text) otherwise.
absl::StatusOr<MetricsCredentials> ParseMetricsAuthFile(absl::string_view text, absl::string_view source);

// Basic-auth check of /metrics against a --metrics_auth_file. Check runs on
// civetweb's worker threads and compares SHA-256 digests in constant time.
// Reload re-reads the file and swaps the credentials atomically; on error the
// previous ones stay in force. Nothing here listens for a signal: the
// daemon's SIGHUP path is meant to call Metrics::ReloadAuth, which calls it.
// A file readable by group or others is accepted with a warning on stderr.
class MetricsAuth {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsAuth>> Load(const std::string& path);

  absl::Status Reload() ABSL_LOCKS_EXCLUDED(mu_);
  bool Check(const std::string& user, const std::string& password) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit MetricsAuth(std::string path) : path_(std::move(path)) {}

  const std::string path_;
  mutable absl::Mutex mu_;
  MetricsCredentials credentials_ ABSL_GUARDED_BY(mu_){};
};

class Metrics {
 public:
  // Validates the options, reads options.auth_file, binds the exposer (when
  // options.listen is set). `learner` and `counters` must outlive the object.
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(const MetricsOptions& options, Learner* learner,
                                                         const IngestCounters* counters);
  ~Metrics();  // Stop()s

  // Before Start: where qstream_serving reads the health status (absent: 0).
  void SetServingSource(std::function<bool()> serving) { serving_source_ = std::move(serving); }
  // Starts polling (and pushing, labelled with `instance` when the options
  // left it empty).
  void Start(const std::string& instance = "");
  // Stops the poll thread after one last poll (and push). Idempotent.
  void Stop();

  // Reads the learner and the counters once into the registry.
  void Poll() ABSL_LOCKS_EXCLUDED(mu_);
  // Pushes the registry to the Pushgateway; returns the HTTP status (or -1).
  int Push();
  // Re-reads options.auth_file (OK and nothing to do without one); a bad
  // file keeps the previous credentials. Meant for the daemon's SIGHUP path.
  absl::Status ReloadAuth();

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
  // What the exposer and the gateway collect: registry_ with const_labels.
  std::shared_ptr<prometheus::Collectable> exported_;
  std::unique_ptr<MetricsAuth> auth_;  // declared before exposer_: outlives its workers
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
  prometheus::Gauge* target_clip_ratio_;
  std::vector<prometheus::Counter*> guard_trips_;  // index = GuardReason (0 unused)
  prometheus::Gauge* guard_tripped_;
  prometheus::Gauge* policy_version_;
  prometheus::Gauge* actor_streams_;
  prometheus::Gauge* samples_per_insert_;
  prometheus::Histogram* policy_lag_;
  prometheus::Family<prometheus::Histogram>* episode_return_;
  prometheus::Family<prometheus::Histogram>* episode_length_;
  prometheus::Gauge* checkpoint_seconds_;
  prometheus::Gauge* checkpoint_snapshot_seconds_;
  prometheus::Gauge* checkpoint_bytes_;
  prometheus::Gauge* checkpoint_last_step_;
  prometheus::Gauge* checkpoint_last_timestamp_;
  prometheus::Counter* checkpoints_written_;
  prometheus::Family<prometheus::Counter>* checkpoint_failures_;
  prometheus::Counter* guard_rollbacks_;
  prometheus::Gauge* learner_halted_;
  prometheus::Gauge* paused_;
  prometheus::Gauge* serving_;
  prometheus::Gauge* replay_min_size_;
  prometheus::Gauge* checkpoint_interval_;
  prometheus::Gauge* gpu_memory_used_ = nullptr;  // CUDA backend only
  prometheus::Gauge* gpu_memory_total_ = nullptr;
  prometheus::Counter* process_cpu_;
  prometheus::Gauge* process_resident_;
  prometheus::Gauge* process_virtual_;
  prometheus::Gauge* process_start_time_;
  prometheus::Gauge* process_open_fds_;
  prometheus::Gauge* process_max_fds_;
  prometheus::Gauge* process_threads_;
  std::function<bool()> serving_source_;

  // Totals already exported, to turn the sources' running totals into
  // counter increments. Touched by Poll only.
  mutable absl::Mutex mu_;
  int64_t seen_steps_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t seen_transitions_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int64_t> seen_guard_trips_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> seen_rejected_ ABSL_GUARDED_BY(mu_);
  PolicyLagCounts seen_lag_ ABSL_GUARDED_BY(mu_);
  // Per env label: its two histograms and the counts already exported.
  struct EpisodeSeries {
    prometheus::Histogram* returns = nullptr;
    prometheus::Histogram* lengths = nullptr;
    EpisodeCounts seen;
  };
  std::map<std::string, EpisodeSeries> episode_series_ ABSL_GUARDED_BY(mu_);
  int64_t seen_checkpoints_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int64_t> seen_checkpoint_failures_ ABSL_GUARDED_BY(mu_);
  int64_t seen_rollbacks_ ABSL_GUARDED_BY(mu_) = 0;
  double recent_step_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double seen_cpu_seconds_ ABSL_GUARDED_BY(mu_) = 0;

  absl::Notification stop_;
  std::thread thread_;
  bool started_ = false;
};

}  // namespace qstream
