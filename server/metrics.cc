#include "server/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <exception>
#include <optional>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "openssl/crypto.h"
#include "qstream/version.h"
#include "server/process_stats.h"
#include "server/security.h"
#include "server/validate.h"
#include "spdlog/spdlog.h"

namespace qstream {

std::vector<double> StepSecondsBuckets() {
  std::vector<double> b;
  for (double decade = 1e-5; decade < 1.0; decade *= 10) {
    for (double m : {1.0, 2.0, 5.0}) b.push_back(m * decade);
  }
  b.push_back(1.0);
  return b;
}

namespace {

// A registry whose every series carries `labels` too.
class ConstLabels final : public prometheus::Collectable {
 public:
  ConstLabels(std::shared_ptr<prometheus::Collectable> inner,
              const std::map<std::string, std::string>& labels)
      : inner_(std::move(inner)), labels_(labels.begin(), labels.end()) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> families = inner_->Collect();
    for (prometheus::MetricFamily& family : families) {
      for (prometheus::ClientMetric& metric : family.metric) {
        for (const auto& [name, value] : labels_) metric.label.push_back({name, value});
      }
    }
    return families;
  }

 private:
  const std::shared_ptr<prometheus::Collectable> inner_;
  const std::vector<std::pair<std::string, std::string>> labels_;
};

prometheus::Gauge& Gauge(prometheus::Registry& r, const std::string& name, const std::string& help,
                         const prometheus::Labels& labels = {}) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(r).Add(labels);
}

prometheus::Counter& Counter(prometheus::Registry& r, const std::string& name, const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(r).Add({});
}

template <size_t N>
std::vector<double> Bounds(const std::array<double, N>& buckets) {
  return std::vector<double>(buckets.begin(), buckets.end());
}

// The counts added since `seen`, as ObserveMultiple takes them; false when none.
template <size_t N>
bool Increments(const std::array<int64_t, N>& now, const std::array<int64_t, N>& seen,
                std::vector<double>* increments) {
  increments->assign(N, 0.0);
  bool changed = false;
  for (size_t i = 0; i < N; ++i) {
    (*increments)[i] = static_cast<double>(now[i] - seen[i]);
    changed |= now[i] > seen[i];
  }
  return changed;
}

constexpr int kMaxMetricsThreads = 1024;
constexpr size_t kMaxAuthFileBytes = 64 * 1024;
constexpr char kAuthRealm[] = "qstream";


// civetweb's options for `o` (validated). linger_timeout_ms stays unset:
// civetweb then leaves SO_LINGER alone and close() never holds a worker on a
// client that does not read its response.
std::vector<std::string> CivetwebOptions(const MetricsOptions& o) {
  // Name, value pairs.
  // clang-format off
  return {
      "listening_ports", o.listen,
      "num_threads", absl::StrCat(o.threads),
      "request_timeout_ms", absl::StrCat(absl::ToInt64Milliseconds(o.request_timeout)),
      // Scrapes come seconds apart; a kept-alive connection would only hold a worker idle.
      "enable_keep_alive", "no",
      "connection_queue", absl::StrCat(o.connection_queue),
      "listen_backlog", absl::StrCat(o.listen_backlog),
  };
  // clang-format on
}

// Reads and parses `path`; the text is wiped after parsing.
absl::StatusOr<MetricsCredentials> ReadAuthFile(const std::string& path) {
  const std::string source = absl::StrCat("--metrics_auth_file=", path);
  const auto failed = [&source](const char* what) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": ", what, ": ", std::error_code(errno, std::generic_category()).message()));
  };
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return failed("cannot open");
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const absl::Status error = failed("cannot stat");
    close(fd);
    return error;
  }
  if (!S_ISREG(st.st_mode) || static_cast<size_t>(st.st_size) > kMaxAuthFileBytes) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not a regular file of at most ", kMaxAuthFileBytes, " bytes"));
  }
  // Group-readable is how Kubernetes mounts a Secret for fsGroup (0440).
  if ((st.st_mode & S_IROTH) != 0) {
    spdlog::warn("{} is readable by others (mode {:03o}); chmod 600 it", source,
                 static_cast<unsigned>(st.st_mode & 0777));
  }
  std::string text(kMaxAuthFileBytes + 1, '\0');
  size_t size = 0;
  for (;;) {
    const ssize_t n = read(fd, text.data() + size, text.size() - size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const absl::Status error = failed("cannot read");
      close(fd);
      return error;
    }
    if (n == 0 || (size += static_cast<size_t>(n)) == text.size()) break;
  }
  close(fd);
  absl::StatusOr<MetricsCredentials> parsed =
      size > kMaxAuthFileBytes
          ? absl::InvalidArgumentError(absl::StrCat(source, ": larger than ", kMaxAuthFileBytes, " bytes"))
          : ParseMetricsAuthFile(absl::string_view(text.data(), size), source);
  OPENSSL_cleanse(text.data(), text.size());
  return parsed;
}

}  // namespace

absl::Status ValidateMetricsOptions(const MetricsOptions& options) {
  if (!options.listen.empty()) {
    const size_t colon = options.listen.rfind(':');
    int port = -1;
    if (colon == std::string::npos || colon == 0 || options.listen.find(',') != std::string::npos ||
        !absl::SimpleAtoi(options.listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
      // civetweb takes a bare port (every interface) or a list; neither is meant here.
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics_listen: '", options.listen, "' is not one host:port"));
    }
  }
  if (options.push_job.empty() || options.push_job.size() > 128 ||
      options.push_job.find_first_not_of(
          "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--push_job: '", options.push_job, "' must be 1-128 characters of [A-Za-z0-9_.-]"));
  }
  if (options.threads < 1 || options.threads > kMaxMetricsThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_threads: ", options.threads, " is outside [1, ", kMaxMetricsThreads, "]"));
  }
  if (options.request_timeout < absl::Milliseconds(1) || options.request_timeout > absl::Hours(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_request_timeout: ", absl::FormatDuration(options.request_timeout),
                     " is outside [1ms, 1h]"));
  }
  if (options.connection_queue < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics connection_queue: ", options.connection_queue, " < 1"));
  }
  if (options.listen_backlog < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics listen_backlog: ", options.listen_backlog, " < 1"));
  }
  return absl::OkStatus();
}

absl::StatusOr<MetricsCredentials> ParseMetricsAuthFile(absl::string_view text, absl::string_view source) {
  std::optional<MetricsCredentials> found;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(source, " line ", line_number, ": ", why));
    };
    const std::vector<absl::string_view> words =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (words.size() != 2) {
      return bad(
          absl::StrCat("expected `user password` or `user sha256:<hex>`, got ", words.size(), " words"));
    }
    if (found) return bad("a second credential line (the file holds one user)");
    const absl::string_view user = words[0];
    const absl::string_view password = words[1];
    if (!SecretChars(user) || !SecretChars(password)) return bad("only printable ASCII is allowed");
    if (absl::StrContains(user, ':')) return bad("the user may not contain ':'");
    MetricsCredentials c;
    c.user = Sha256(user);
    auto digest = SecretDigest(password);
    if (!digest.ok()) return bad(digest.status().message());
    c.password = *digest;
    found = c;
  }
  if (!found) return absl::InvalidArgumentError(absl::StrCat(source, ": no `user password` line"));
  return *found;
}

absl::StatusOr<std::unique_ptr<MetricsAuth>> MetricsAuth::Load(const std::string& path) {
  std::unique_ptr<MetricsAuth> auth(new MetricsAuth(path));
  if (absl::Status st = auth->Reload(); !st.ok()) return st;
  return auth;
}

absl::Status MetricsAuth::Reload() {
  absl::StatusOr<MetricsCredentials> read = ReadAuthFile(path_);
  if (!read.ok()) return read.status();
  absl::MutexLock lock(&mu_);
  credentials_ = *read;
  return absl::OkStatus();
}

bool MetricsAuth::Check(const std::string& user, const std::string& password) const {
  const MetricsDigest user_digest = Sha256(user);
  const MetricsDigest password_digest = Sha256(password);
  absl::ReaderMutexLock lock(&mu_);
  // Both compared, always: the time taken says nothing about which one differs.
  const bool user_ok = CRYPTO_memcmp(user_digest.data(), credentials_.user.data(), user_digest.size()) == 0;
  const bool password_ok =
      CRYPTO_memcmp(password_digest.data(), credentials_.password.data(), password_digest.size()) == 0;
  return user_ok && password_ok;
}

Metrics::Metrics(const MetricsOptions& options, Learner* learner, const IngestCounters* counters)
    : options_(options),
      learner_(learner),
      counters_(counters),
      registry_(std::make_shared<prometheus::Registry>()) {
  auto& r = *registry_;
  step_seconds_ = &prometheus::BuildHistogram()
                       .Name("qstream_train_step_seconds")
                       .Help("Learner step time, seconds")
                       .Register(r)
                       .Add({}, StepSecondsBuckets());
  train_steps_ = &Counter(r, "qstream_train_steps_total", "Learner steps taken");
  transitions_ingested_ =
      &Counter(r, "qstream_transitions_ingested_total", "Transitions written to the replay from actor streams");
  ingest_rejected_ = &prometheus::BuildCounter()
                          .Name("qstream_ingest_rejected_total")
                          .Help("Batches rejected by validation, by the field that failed")
                          .Register(r);
  // Known reasons start at 0 so the family is exported before any rejection.
  for (const std::string& field : BatchFieldNames()) ingest_rejected_->Add({{"reason", field}});
  replay_size_ = &Gauge(r, "qstream_replay_size", "Transitions in the replay");
  replay_capacity_ = &Gauge(r, "qstream_replay_capacity", "Replay capacity, transitions");
  auto& q = prometheus::BuildGauge()
                .Name("qstream_q_value")
                .Help("Online Q-values over the last step's batch")
                .Register(r);
  q_min_ = &q.Add({{"stat", "min"}});
  q_mean_ = &q.Add({{"stat", "mean"}});
  q_max_ = &q.Add({{"stat", "max"}});
  loss_ = &Gauge(r, "qstream_loss", "Importance-weighted C51 cross-entropy of the last step");
  grad_norm_ = &Gauge(r, "qstream_grad_norm", "Global gradient norm of the last step, before clipping");
  target_clip_ratio_ = &Gauge(r, "qstream_target_clip_ratio",
                              "Fraction of the target probability mass clamped at the support edges (0..1)");
  auto& trips = prometheus::BuildCounter()
                    .Name("qstream_guard_trips_total")
                    .Help("Steps whose update the guard skipped, by reason")
                    .Register(r);
  guard_trips_.assign(kNumGuardReasons, nullptr);
  for (int i = 1; i < kNumGuardReasons; ++i) {
    guard_trips_[i] = &trips.Add({{"reason", GuardReasonName(static_cast<GuardReason>(i))}});
  }
  seen_guard_trips_.assign(kNumGuardReasons, 0);
  guard_tripped_ = &Gauge(r, "qstream_guard_tripped", "1 when the last step's update was skipped");
  policy_version_ = &Gauge(r, "qstream_policy_version", "Latest published policy version");
  actor_streams_ = &Gauge(r, "qstream_actor_streams", "Open actor streams");
  samples_per_insert_ =
      &Gauge(r, "qstream_samples_per_insert", "Sampled transitions per inserted transition since start");
  policy_lag_ = &prometheus::BuildHistogram()
                     .Name("qstream_policy_lag_versions")
                     .Help("Policy versions an accepted batch was acted with behind the current one")
                     .Register(r)
                     .Add({}, Bounds(kPolicyLagBuckets));
  episode_return_ = &prometheus::BuildHistogram()
                         .Name("qstream_episode_return")
                         .Help("Undiscounted return of the episodes actors reported, by env")
                         .Register(r);
  episode_length_ = &prometheus::BuildHistogram()
                         .Name("qstream_episode_length_steps")
                         .Help("Environment steps of the episodes actors reported, by env")
                         .Register(r);
  checkpoint_seconds_ = &Gauge(r, "qstream_checkpoint_seconds", "Background write time of the newest checkpoint");
  checkpoint_snapshot_seconds_ = &Gauge(r, "qstream_checkpoint_snapshot_seconds",
                                        "Learner-thread snapshot time of the newest checkpoint (training stalls this long)");
  checkpoint_bytes_ = &Gauge(r, "qstream_checkpoint_bytes", "Size of the newest checkpoint");
  checkpoint_last_step_ =
      &Gauge(r, "qstream_checkpoint_last_step", "Learner step of the newest checkpoint written (-1: none yet)");
  checkpoint_last_timestamp_ = &Gauge(r, "qstream_checkpoint_last_timestamp_seconds",
                                      "Unix time the newest checkpoint was completed (0: none yet)");
  checkpoints_written_ = &Counter(r, "qstream_checkpoints_written_total", "Checkpoints written");
  checkpoint_failures_ = &prometheus::BuildCounter()
                              .Name("qstream_checkpoint_failures_total")
                              .Help("Checkpoints that failed, by reason (snapshot, write, prune)")
                              .Register(r);
  for (const char* reason : {"snapshot", "write", "prune"}) checkpoint_failures_->Add({{"reason", reason}});
  checkpoint_last_step_->Set(-1);
  guard_rollbacks_ = &Counter(r, "qstream_guard_rollbacks_total",
                              "Rollbacks to the newest good checkpoint after repeated guard trips");
  learner_halted_ = &Gauge(r, "qstream_learner_halted", "1 while the guard has halted the learner");
  paused_ = &Gauge(r, "qstream_paused",
                   "1 while the learner is paused (Admin Pause, --start_paused, a failed step)");
  serving_ = &Gauge(r, "qstream_serving", "1 while grpc.health.v1 reports SERVING (README \"Health\")");
  replay_min_size_ =
      &Gauge(r, "qstream_replay_min_size",
             "Transitions the replay must hold before the learner samples (rate_limiter.min_size_to_sample)");
  checkpoint_interval_ =
      &Gauge(r, "qstream_checkpoint_interval_seconds",
             "checkpoint.every_seconds when checkpoints are on (--checkpoint_dir), else 0");
  const LearnerStatus s = learner->status();
  prometheus::BuildGauge()
      .Name("qstream_build_info")
      .Help(
          "Always 1: the build and the backend this daemon runs (backend \"cpu\" under --backend=auto means "
          "no GPU)")
      .Register(r)
      .Add({{"version", QSTREAM_VERSION},
            {"commit", QSTREAM_GIT_COMMIT},
            {"backend", s.backend},
            {"device", s.device}})
      .Set(1);
  replay_min_size_->Set(static_cast<double>(learner->config().rate_limiter().min_size_to_sample()));
  if (s.device_memory.total_bytes >= 0) {
    gpu_memory_used_ = &Gauge(r, "qstream_gpu_memory_used_bytes",
                              "Memory in use on the GPU once the backend was set up (all processes), bytes");
    gpu_memory_total_ = &Gauge(r, "qstream_gpu_memory_total_bytes", "Memory of the GPU, bytes");
    gpu_memory_used_->Set(static_cast<double>(s.device_memory.used_bytes));
    gpu_memory_total_->Set(static_cast<double>(s.device_memory.total_bytes));
  }
  process_cpu_ = &Counter(r, "process_cpu_seconds_total", "User and system CPU time of the process, seconds");
  process_resident_ = &Gauge(r, "process_resident_memory_bytes", "Resident memory size, bytes");
  process_virtual_ = &Gauge(r, "process_virtual_memory_bytes", "Virtual memory size, bytes");
  process_start_time_ =
      &Gauge(r, "process_start_time_seconds", "Start time of the process since the Unix epoch, seconds");
  process_open_fds_ = &Gauge(r, "process_open_fds", "Open file descriptors");
  process_max_fds_ = &Gauge(r, "process_max_fds", "Most open file descriptors (soft limit; -1: unlimited)");
  process_threads_ = &Gauge(r, "process_threads", "Threads of the process");
}

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Create(const MetricsOptions& options, Learner* learner,
                                                         const IngestCounters* counters) {
  if (absl::Status st = ValidateMetricsOptions(options); !st.ok()) return st;
  std::unique_ptr<Metrics> m(new Metrics(options, learner, counters));
  m->exported_ = options.const_labels.empty()
                     ? std::shared_ptr<prometheus::Collectable>(m->registry_)
                     : std::make_shared<ConstLabels>(m->registry_, options.const_labels);
  if (!options.auth_file.empty()) {
    auto auth = MetricsAuth::Load(options.auth_file);
    if (!auth.ok()) return auth.status();
    m->auth_ = std::move(*auth);
  }
  if (!options.listen.empty()) {
    try {
      m->exposer_ = std::make_unique<prometheus::Exposer>(CivetwebOptions(options));
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("--metrics_listen=", options.listen, ": ", e.what()));
    }
    // Auth before the registry: the daemon's metrics are never served
    // unchecked (the Exposer's own scrape counters are, for the instant
    // between its start and this call).
    if (m->auth_) {
      const MetricsAuth* auth = m->auth_.get();
      m->exposer_->RegisterAuth(
          [auth](const std::string& user, const std::string& pass) { return auth->Check(user, pass); },
          kAuthRealm);
    }
    m->exposer_->RegisterCollectable(m->exported_);
    const auto ports = m->exposer_->GetListeningPorts();
    if (ports.empty()) return absl::UnavailableError(absl::StrCat("--metrics_listen=", options.listen, ": not bound"));
    m->port_ = ports.front();
  }
  if (!options.pushgateway.empty()) {
    const std::vector<std::string> parts = absl::StrSplit(options.pushgateway, absl::MaxSplits(':', 1));
    int port = 0;
    if (parts.size() != 2 || parts[0].empty() || !absl::SimpleAtoi(parts[1], &port) || port <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--pushgateway: '", options.pushgateway, "' is not host:port"));
    }
    m->gateway_host_ = parts[0];
    m->gateway_port_ = parts[1];
  }
  return m;
}

Metrics::~Metrics() { Stop(); }

void Metrics::Start(const std::string& instance) {
  if (started_) return;
  started_ = true;
  if (!gateway_host_.empty()) {
    const std::string label = options_.instance.empty() ? instance : options_.instance;
    gateway_ = std::make_unique<prometheus::Gateway>(gateway_host_, gateway_port_, options_.push_job,
                                                     prometheus::Labels{{"instance", label}});
    gateway_->RegisterCollectable(exported_);
  }
  thread_ = std::thread([this] { Run(); });
}

void Metrics::Stop() {
  if (!started_ || stop_.HasBeenNotified()) return;
  stop_.Notify();
  thread_.join();
}

void Metrics::Run() {
  {
    // Counters start at 0 in every process: a restored learner's totals are
    // the baseline, not an increment.
    const LearnerStatus s = learner_->status();
    absl::MutexLock lock(&mu_);
    seen_steps_ = s.steps;
    for (size_t i = 0; i < s.guard_trips.size() && i < seen_guard_trips_.size(); ++i) {
      seen_guard_trips_[i] = s.guard_trips[i];
    }
  }
  absl::Time next_push = absl::Now() + options_.push_interval;
  while (!stop_.WaitForNotificationWithTimeout(options_.poll_interval)) {
    Poll();
    if (gateway_ && absl::Now() >= next_push) {
      Push();
      next_push = absl::Now() + options_.push_interval;
    }
  }
  Poll();
  if (gateway_) Push();
}

int Metrics::Push() {
  if (!gateway_) return -1;
  return gateway_->Push();
}

absl::Status Metrics::ReloadAuth() {
  if (!auth_) return absl::OkStatus();
  return auth_->Reload();
}

double Metrics::recent_step_seconds() const {
  absl::MutexLock lock(&mu_);
  return recent_step_seconds_;
}

void Metrics::Poll() {
  const LearnerStatus s = learner_->status();
  const auto step_times = learner_->DrainStepTimes();
  const auto rejected = counters_->rejected_by_reason();
  const PolicyLagCounts lag = counters_->policy_lag();
  const auto episodes = counters_->episodes();

  absl::MutexLock lock(&mu_);
  // Each window is `count` steps of (mean) `seconds`: all land in one bucket.
  const auto& bounds = StepSecondsBuckets();
  double window_seconds = 0;
  int64_t window_steps = 0;
  for (const auto& [seconds, count] : step_times) {
    std::vector<double> increments(bounds.size() + 1, 0.0);
    const size_t bucket = std::lower_bound(bounds.begin(), bounds.end(), seconds) - bounds.begin();
    increments[bucket] = static_cast<double>(count);
    step_seconds_->ObserveMultiple(increments, seconds * count);
    window_seconds += seconds * count;
    window_steps += count;
  }
  if (window_steps > 0) recent_step_seconds_ = window_seconds / window_steps;

  if (s.steps > seen_steps_) train_steps_->Increment(static_cast<double>(s.steps - seen_steps_));
  seen_steps_ = std::max(seen_steps_, s.steps);
  const int64_t transitions = counters_->transitions();
  if (transitions > seen_transitions_) {
    transitions_ingested_->Increment(static_cast<double>(transitions - seen_transitions_));
  }
  seen_transitions_ = std::max(seen_transitions_, transitions);
  for (const auto& [reason, total] : rejected) {
    int64_t& seen = seen_rejected_[reason];
    auto& counter = ingest_rejected_->Add({{"reason", reason}});
    if (total > seen) counter.Increment(static_cast<double>(total - seen));
    seen = std::max(seen, total);
  }
  for (size_t i = 1; i < s.guard_trips.size() && i < guard_trips_.size(); ++i) {
    if (s.guard_trips[i] > seen_guard_trips_[i]) {
      guard_trips_[i]->Increment(static_cast<double>(s.guard_trips[i] - seen_guard_trips_[i]));
      seen_guard_trips_[i] = s.guard_trips[i];
    }
  }
  std::vector<double> increments;
  if (Increments(lag.buckets, seen_lag_.buckets, &increments)) {
    policy_lag_->ObserveMultiple(increments, lag.sum - seen_lag_.sum);
  }
  seen_lag_ = lag;
  for (const auto& [env, counts] : episodes) {
    EpisodeSeries& series = episode_series_[env];
    if (series.returns == nullptr) {
      series.returns = &episode_return_->Add({{"env", env}}, Bounds(kEpisodeReturnBuckets));
      series.lengths = &episode_length_->Add({{"env", env}}, Bounds(kEpisodeLengthBuckets));
    }
    if (Increments(counts.return_buckets, series.seen.return_buckets, &increments)) {
      series.returns->ObserveMultiple(increments, counts.return_sum - series.seen.return_sum);
    }
    if (Increments(counts.length_buckets, series.seen.length_buckets, &increments)) {
      series.lengths->ObserveMultiple(increments,
                                      static_cast<double>(counts.length_sum - series.seen.length_sum));
    }
    series.seen = counts;
  }

  const CheckpointerStats& c = s.checkpoints;
  if (c.written > seen_checkpoints_) {
    checkpoints_written_->Increment(static_cast<double>(c.written - seen_checkpoints_));
    seen_checkpoints_ = c.written;
    checkpoint_seconds_->Set(c.last_write_seconds);
    checkpoint_snapshot_seconds_->Set(c.last_snapshot_seconds);
    checkpoint_bytes_->Set(static_cast<double>(c.last_bytes));
    checkpoint_last_step_->Set(static_cast<double>(c.last_step));
    checkpoint_last_timestamp_->Set(static_cast<double>(c.last_unix_seconds));
  }
  for (const auto& [reason, total] : c.failures) {
    int64_t& seen = seen_checkpoint_failures_[reason];
    if (total > seen) checkpoint_failures_->Add({{"reason", reason}}).Increment(static_cast<double>(total - seen));
    seen = std::max(seen, total);
  }
  if (s.guard_rollbacks > seen_rollbacks_) {
    guard_rollbacks_->Increment(static_cast<double>(s.guard_rollbacks - seen_rollbacks_));
    seen_rollbacks_ = s.guard_rollbacks;
  }
  learner_halted_->Set(s.halted ? 1 : 0);
  paused_->Set(s.paused ? 1 : 0);
  serving_->Set(serving_source_ && serving_source_() ? 1 : 0);
  checkpoint_interval_->Set(s.checkpoints_enabled ? learner_->config().checkpoint().every_seconds() : 0.0);
  if (auto p = ReadProcessStats(); p.ok()) {
    if (p->cpu_seconds > seen_cpu_seconds_) process_cpu_->Increment(p->cpu_seconds - seen_cpu_seconds_);
    seen_cpu_seconds_ = std::max(seen_cpu_seconds_, p->cpu_seconds);
    process_resident_->Set(p->resident_bytes);
    process_virtual_->Set(p->virtual_bytes);
    process_start_time_->Set(p->start_time_seconds);
    process_open_fds_->Set(p->open_fds);
    process_max_fds_->Set(p->max_fds);
    process_threads_->Set(p->threads);
  }
  replay_size_->Set(static_cast<double>(s.replay_size));
  replay_capacity_->Set(static_cast<double>(s.replay_capacity));
  q_min_->Set(s.last_stats.q_min);
  q_mean_->Set(s.last_stats.q_mean);
  q_max_->Set(s.last_stats.q_max);
  loss_->Set(s.last_stats.loss);
  grad_norm_->Set(s.last_stats.grad_norm);
  target_clip_ratio_->Set(s.last_stats.target_clip_fraction);
  guard_tripped_->Set(s.last_stats.guard != GuardReason::kNone ? 1 : 0);
  policy_version_->Set(static_cast<double>(s.policy_version));
  actor_streams_->Set(counters_->actor_streams());
  samples_per_insert_->Set(s.rate_limiter_inserts > 0 ? static_cast<double>(s.rate_limiter_samples) /
                                                            static_cast<double>(s.rate_limiter_inserts)
                                                      : 0.0);
}

}  // namespace qstream
