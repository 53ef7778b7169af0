// `qstream-bench e2e`: the learner's speed inside the daemon while it ingests.
// qstreamd runs as a real child process on loopback (plaintext) with a config
// generated from a bench config; N load streams (bench/load_streams.h) in this
// process push batches at it flat out; the learner starts once the replay
// holds --prefill transitions. Over the measure window /metrics is scraped at
// the start and the end (each scrape taken just after the daemon's metrics
// poll, so both ends of the window sit on a poll) and every second for a
// progress line on stderr. One JSON line on stdout: learner steps/s, ingested
// and acked transitions/s, step-time p50/p99 from the qstream_train_step_seconds
// histogram's buckets over the window, daemon and bench CPU, and — when a
// reference is measured (`qstream-bench learner`, same config and batch, run
// as a child process before the daemon starts) or given — the ratio of the
// daemon's learner rate to the graph-only rate.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench.h"
#include "bench/load_streams.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "nlohmann/json.hpp"
#include "qstream/version.h"
#include "tests/server/e2e_support.h"
#include "trainer/config.h"
#include "trainer/network_spec.h"

namespace qstream::bench {
namespace {

using qstream::testing::ChildProcess;

// The daemon's metrics poll period is 500 ms; an aligned scrape waits at most this long for the next poll.
constexpr absl::Duration kAlignTimeout = absl::Milliseconds(1500);
constexpr absl::Duration kAlignPollEvery = absl::Milliseconds(5);
constexpr absl::Duration kShutdownTimeout = absl::Seconds(30);
constexpr absl::Duration kReferenceTimeout = absl::Seconds(600);
// BENCH.md's goal: the daemon's learner within 10 % of the graph-only rate while ingesting 1M transitions/s.
constexpr double kGoalStepRateRatio = 0.9;
constexpr double kGoalIngestPerS = 1e6;

struct Flags {
  std::string qstreamd;  // empty: next to this binary
  std::string backend = "cuda";
  std::string config = "h200";
  int batch = 1024;  // learner batch
  int streams = 8;
  int in_flight = 8;
  int items_per_message = 1024;
  std::string kind = "nstep";
  double seconds = 20;
  double warmup_seconds = 3;
  int64_t replay_capacity = 0;           // 0: the config's (h200: 2^20)
  int64_t prefill = 0;                   // 0: capacity / 4
  double samples_per_insert = 0;         // <= 0: no rate limit, learner and ingest flat out
  std::string reference = "auto";        // auto (cuda only) | on | off
  double learner_rate_reference_us = 0;  // > 0: given, not measured
  double startup_timeout_seconds = 180;
  uint64_t seed = 1;
};

void Usage() {
  std::fprintf(stderr,
               "usage: qstream-bench e2e [--qstreamd=PATH (next to this binary)] [--backend=cuda|cpu]\n"
               "         [--config=h200|small] [--batch=1024] [--streams=8] [--in_flight=8] "
               "[--items_per_message=1024]\n"
               "         [--kind=nstep|step|step_stream] [--seconds=20] [--warmup_seconds=3] "
               "[--replay_capacity=N (config's)]\n"
               "         [--prefill=N (capacity/4)] [--samples_per_insert=0 (no rate limit)]\n"
               "         [--reference=auto|on|off (auto: on for cuda)] [--learner_rate_reference_us=US]\n"
               "         [--startup_timeout_seconds=180] [--seed=1]\n");
}

absl::Status ParseFlags(int argc, char** argv, Flags* f) {
  return ParseFlagArgs(argc, argv, [f](const std::string& name, const std::string& value) {
    bool ok = true;
    if (name == "qstreamd") {
      f->qstreamd = value;
    } else if (name == "backend") {
      f->backend = value;
      ok = value == "cuda" || value == "cpu";
    } else if (name == "config") {
      f->config = value;
    } else if (name == "batch") {
      ok = absl::SimpleAtoi(value, &f->batch) && f->batch > 0;
    } else if (name == "streams") {
      ok = absl::SimpleAtoi(value, &f->streams) && f->streams > 0;
    } else if (name == "in_flight") {
      ok = absl::SimpleAtoi(value, &f->in_flight) && f->in_flight > 0;
    } else if (name == "items_per_message") {
      ok = absl::SimpleAtoi(value, &f->items_per_message) && f->items_per_message > 0;
    } else if (name == "kind") {
      f->kind = value;
      ok = value == "nstep" || value == "step" || value == "step_stream";
    } else if (name == "seconds") {
      ok = absl::SimpleAtod(value, &f->seconds) && f->seconds > 0;
    } else if (name == "warmup_seconds") {
      ok = absl::SimpleAtod(value, &f->warmup_seconds) && f->warmup_seconds >= 0;
    } else if (name == "replay_capacity") {
      ok = absl::SimpleAtoi(value, &f->replay_capacity) && f->replay_capacity >= 0;
    } else if (name == "prefill") {
      ok = absl::SimpleAtoi(value, &f->prefill) && f->prefill >= 0;
    } else if (name == "samples_per_insert") {
      ok = absl::SimpleAtod(value, &f->samples_per_insert);
    } else if (name == "reference") {
      f->reference = value;
      ok = value == "auto" || value == "on" || value == "off";
    } else if (name == "learner_rate_reference_us") {
      ok = absl::SimpleAtod(value, &f->learner_rate_reference_us) && f->learner_rate_reference_us > 0;
    } else if (name == "startup_timeout_seconds") {
      ok = absl::SimpleAtod(value, &f->startup_timeout_seconds) && f->startup_timeout_seconds > 0;
    } else if (name == "seed") {
      ok = absl::SimpleAtoi(value, &f->seed);
    } else {
      return FlagValue::kUnknown;
    }
    return ok ? FlagValue::kOk : FlagValue::kBad;
  });
}

// Children a SIGINT or SIGTERM of the bench passes SIGTERM on to (a daemon
// left behind would hold the GPU), then the bench exits.
volatile sig_atomic_t g_child_pid = 0;

void ForwardSignalAndExit(int signal_number) {
  if (g_child_pid > 0) kill(g_child_pid, SIGTERM);
  _exit(128 + signal_number);
}

std::filesystem::path SelfPath() {
  std::error_code ec;
  return std::filesystem::read_symlink("/proc/self/exe", ec);
}

std::string DefaultQstreamd() {
  const std::filesystem::path dir = SelfPath().parent_path();
  for (const std::filesystem::path& p : {dir / "qstreamd", dir / "server" / "qstreamd"}) {
    if (access(p.c_str(), X_OK) == 0) return p.string();
  }
  return "build/server/qstreamd";
}

// User + system CPU seconds of process `pid` from /proc/<pid>/stat (-1 when unreadable).
double ProcessCpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');  // the command name may hold spaces
  if (paren == std::string::npos) return -1;
  const std::vector<std::string> fields = absl::StrSplit(stat.substr(paren + 2), ' ');
  // Fields 14 and 15 of stat(5), utime and stime; the list starts at field 3.
  constexpr size_t kUtime = 14 - 3, kStime = 15 - 3;
  double utime, stime;
  if (fields.size() <= kStime || !absl::SimpleAtod(fields[kUtime], &utime) ||
      !absl::SimpleAtod(fields[kStime], &stime)) {
    return -1;
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double SelfCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto seconds = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec);
  };
  return seconds(u.ru_utime) + seconds(u.ru_stime);
}

// An error with the child's output when it has exited.
absl::Status CheckAlive(ChildProcess* child, const std::string& what) {
  if (const std::optional<int> rc = child->Wait(absl::Milliseconds(1))) {
    return absl::AbortedError(
        absl::StrCat(what, " exited with status ", *rc, "; its output:\n", child->output()));
  }
  return absl::OkStatus();
}

// Everything the window needs at one instant.
struct Sample {
  std::map<std::string, double> metrics;
  absl::Time at;
  int64_t acked = 0;
  double daemon_cpu_s = 0;
  double bench_cpu_s = 0;

  double Get(const std::string& name) const {
    auto it = metrics.find(name);
    return it == metrics.end() ? 0 : it->second;
  }
};

class Scraper {
 public:
  Scraper(int metrics_port, pid_t daemon_pid, const LoadStreams* load)
      : port_(metrics_port), pid_(daemon_pid), load_(load) {}

  absl::StatusOr<Sample> Now() const {
    Sample s;
    const std::string page = qstream::testing::HttpGet(port_, "/metrics");
    s.at = absl::Now();
    s.acked = load_ ? load_->accepted() : 0;
    s.daemon_cpu_s = ProcessCpuSeconds(pid_);
    s.bench_cpu_s = SelfCpuSeconds();
    if (page.empty()) return absl::UnavailableError(absl::StrCat("GET 127.0.0.1:", port_, "/metrics failed"));
    s.metrics = qstream::testing::ParseMetrics(page);
    return s;
  }

  // The first scrape after the daemon's next metrics poll (its counters
  // moved), so the instant is the poll's within a few ms.
  absl::StatusOr<Sample> AfterNextPoll() const {
    absl::StatusOr<Sample> first = Now();
    if (!first.ok()) return first;
    const absl::Time deadline = absl::Now() + kAlignTimeout;
    for (;;) {
      absl::SleepFor(kAlignPollEvery);
      absl::StatusOr<Sample> s = Now();
      if (!s.ok()) return s;
      if (Moved(*first, *s) || s->at >= deadline) return s;
    }
  }

 private:
  static bool Moved(const Sample& a, const Sample& b) {
    for (const char* name : {"qstream_train_steps_total", "qstream_transitions_ingested_total",
                             "qstream_train_step_seconds_count"}) {
      if (a.Get(name) != b.Get(name)) return true;
    }
    return false;
  }

  const int port_;
  const pid_t pid_;
  const LoadStreams* const load_;
};

// (upper bound, cumulative count) of histogram `name`, by bound.
std::vector<std::pair<double, double>> Buckets(const Sample& s, const std::string& name) {
  const std::string prefix = name + "_bucket{le=\"";
  std::vector<std::pair<double, double>> out;
  for (auto it = s.metrics.lower_bound(prefix); it != s.metrics.end() && it->first.rfind(prefix, 0) == 0;
       ++it) {
    const std::string le =
        it->first.substr(prefix.size(), it->first.find('"', prefix.size()) - prefix.size());
    double bound;
    if (le == "+Inf") {
      bound = std::numeric_limits<double>::infinity();
    } else if (!absl::SimpleAtod(le, &bound)) {
      continue;
    }
    out.emplace_back(bound, it->second);
  }
  std::sort(out.begin(), out.end());
  return out;
}

struct Quantile {
  double value = 0;  // linear within the bucket, as Prometheus' histogram_quantile
  double lower = 0;  // the bucket it fell in
  double upper = 0;
};

// Quantile q of the observations histogram `name` gained from a to b.
std::optional<Quantile> WindowQuantile(const Sample& a, const Sample& b, const std::string& name, double q) {
  const auto before = Buckets(a, name);
  const auto after = Buckets(b, name);
  if (after.empty() || before.size() != after.size()) return std::nullopt;
  const double total = after.back().second - before.back().second;
  if (total <= 0) return std::nullopt;
  const double rank = q * total;
  double lower = 0, below = 0;
  for (size_t i = 0; i < after.size(); ++i) {
    const double cumulative = after[i].second - before[i].second;
    if (cumulative >= rank) {
      Quantile out{lower, lower, after[i].first};
      if (std::isinf(after[i].first)) return out;  // above the last finite bound: that bound
      if (cumulative > below)
        out.value = lower + (after[i].first - lower) * (rank - below) / (cumulative - below);
      return out;
    }
    lower = after[i].first;
    below = cumulative;
  }
  return std::nullopt;
}

// `qstream-bench learner` on the same config and batch, as a child process
// (so its device memory is gone before the daemon starts): µs per step.
absl::StatusOr<nlohmann::json> MeasureReference(const Flags& f) {
  const std::vector<std::string> argv = {SelfPath().string(),
                                         "learner",
                                         "--backend=" + f.backend,
                                         "--config=" + f.config,
                                         absl::StrCat("--batch=", f.batch),
                                         absl::StrCat("--seed=", f.seed)};
  std::fprintf(stderr, "qstream-bench e2e: reference: %s learner --backend=%s --config=%s --batch=%d\n",
               argv[0].c_str(), f.backend.c_str(), f.config.c_str(), f.batch);
  std::unique_ptr<ChildProcess> child = ChildProcess::Spawn(argv);
  if (!child) return absl::InternalError("cannot start the reference learner bench");
  g_child_pid = child->pid();
  const std::optional<std::string> line = child->WaitForLine("{\"bench\":\"learner\"", kReferenceTimeout);
  const std::optional<int> rc = child->Wait(absl::Seconds(30));
  g_child_pid = 0;
  if (!line || rc != 0) {
    return absl::InternalError(absl::StrCat("the reference learner bench failed (status ", rc.value_or(-1),
                                            "); its output:\n", child->output()));
  }
  nlohmann::json j = nlohmann::json::parse(*line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("us_per_step")) {
    return absl::InternalError(absl::StrCat("unparsable reference line: ", *line));
  }
  std::fprintf(stderr, "  reference: %.1f us/step (%.0f steps/s) at replay %lld\n",
               j["us_per_step"].get<double>(), 1e6 / j["us_per_step"].get<double>(),
               static_cast<long long>(j.value("replay_size", int64_t{0})));
  return j;
}

struct StartedDaemon {
  std::unique_ptr<ChildProcess> process;
  std::string grpc_address;
  int metrics_port = 0;
  std::string startup_line;
};

absl::StatusOr<StartedDaemon> StartDaemon(const std::string& qstreamd, const std::string& config_path,
                                          const std::string& backend, absl::Duration timeout) {
  if (access(qstreamd.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("no qstreamd at ", qstreamd, " (pass --qstreamd=PATH)"));
  }
  StartedDaemon d;
  d.process = ChildProcess::Spawn({qstreamd, "--backend=" + backend, "--config=" + config_path,
                                   "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0"});
  if (!d.process) return absl::InternalError(absl::StrCat("cannot start ", qstreamd));
  g_child_pid = d.process->pid();
  const std::optional<std::string> line = d.process->WaitForLine("listening grpc=", timeout);
  std::smatch m;
  if (!line) {
    if (absl::Status st = CheckAlive(d.process.get(), "qstreamd"); !st.ok()) return st;
  }
  if (!line || !std::regex_search(*line, m, std::regex(R"(grpc=(\S+) metrics=127\.0\.0\.1:(\d+))"))) {
    return absl::UnavailableError(absl::StrCat("qstreamd did not start within ",
                                               absl::FormatDuration(timeout), "; its output:\n",
                                               d.process->output()));
  }
  d.grpc_address = m[1];
  d.metrics_port = std::stoi(m[2]);
  d.startup_line = *line;

  auto channel = grpc::CreateChannel(d.grpc_address, grpc::InsecureChannelCredentials());
  const absl::Time deadline = absl::Now() + timeout;
  while (qstream::testing::HealthStatus(channel) != 1) {
    if (absl::Status st = CheckAlive(d.process.get(), "qstreamd"); !st.ok()) return st;
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(
          absl::StrCat("qstreamd never reported SERVING; its output:\n", d.process->output()));
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return d;
}

// A field of the start-up line: key=value or key="value".
std::string StartupField(const std::string& line, const std::string& key) {
  std::smatch m;
  if (std::regex_search(line, m, std::regex(key + R"(=(?:"([^"]*)\"|(\S+)))")))
    return m[1].matched ? m[1] : m[2];
  return "";
}

std::string DaemonCommit(const std::string& line) {
  std::smatch m;
  return std::regex_search(line, m, std::regex(R"(^qstreamd \S+ \(([^)]*)\))")) ? std::string(m[1]) : "";
}

void Progress(const Sample& a, const Sample& b, const char* phase, double since_start) {
  const double dt = absl::ToDoubleSeconds(b.at - a.at);
  if (dt <= 0) return;
  std::fprintf(
      stderr,
      "[%5.1fs %s] learner %8.1f steps/s  ingest %10.0f /s  acked %10.0f /s  replay %9.0f  daemon %.2f "
      "cores\n",
      since_start, phase, (b.Get("qstream_train_steps_total") - a.Get("qstream_train_steps_total")) / dt,
      (b.Get("qstream_transitions_ingested_total") - a.Get("qstream_transitions_ingested_total")) / dt,
      static_cast<double>(b.acked - a.acked) / dt, b.Get("qstream_replay_size"),
      (b.daemon_cpu_s - a.daemon_cpu_s) / dt);
}

// Sleeps `seconds`, a progress line and a liveness check each second.
absl::Status Watch(double seconds, const Scraper& scraper, ChildProcess* daemon, const char* phase,
                   absl::Time started) {
  const absl::Time end = absl::Now() + absl::Seconds(seconds);
  absl::StatusOr<Sample> last = scraper.Now();
  if (!last.ok()) return last.status();
  while (absl::Now() < end) {
    absl::SleepFor(std::min(absl::Seconds(1), end - absl::Now()));
    if (absl::Status st = CheckAlive(daemon, "qstreamd"); !st.ok()) return st;
    absl::StatusOr<Sample> now = scraper.Now();
    if (!now.ok()) return now.status();
    Progress(*last, *now, phase, absl::ToDoubleSeconds(now->at - started));
    last = std::move(now);
  }
  return absl::OkStatus();
}

absl::Status Run(const Flags& flags) {
  absl::StatusOr<v1::TrainerConfig> config = BenchConfig(flags.config);
  if (!config.ok()) return config.status();
  config->mutable_replay()->set_batch_size(flags.batch);
  if (flags.replay_capacity > 0) config->mutable_replay()->set_capacity(flags.replay_capacity);
  const int64_t capacity = config->replay().capacity();
  const int64_t prefill = std::min<int64_t>(
      capacity, std::max<int64_t>(flags.prefill > 0 ? flags.prefill : capacity / 4, flags.batch));
  config->mutable_rate_limiter()->set_samples_per_insert(static_cast<float>(flags.samples_per_insert));
  config->mutable_rate_limiter()->set_min_size_to_sample(prefill);
  config->mutable_server()->set_max_streams(std::max(config->server().max_streams(), flags.streams));
  config->set_seed(flags.seed);
  absl::StatusOr<NetworkSpec> spec = NetworkSpec::Create(config->network());
  if (!spec.ok()) return spec.status();
  std::signal(SIGINT, ForwardSignalAndExit);
  std::signal(SIGTERM, ForwardSignalAndExit);

  // The graph-only reference first, while the device is free.
  nlohmann::json reference;
  if (flags.learner_rate_reference_us > 0) {
    reference = {{"us_per_step", flags.learner_rate_reference_us}, {"source", "flag"}};
  } else if (flags.reference == "on" || (flags.reference == "auto" && flags.backend == "cuda")) {
    absl::StatusOr<nlohmann::json> r = MeasureReference(flags);
    if (!r.ok()) return r.status();
    reference = std::move(*r);
    reference["source"] = "qstream-bench learner";
  }

  std::string config_text;
  google::protobuf::TextFormat::PrintToString(*config, &config_text);
  const std::string config_path = qstream::testing::WriteTempFile("e2e_bench_config.pbtxt", config_text);
  const std::string qstreamd = flags.qstreamd.empty() ? DefaultQstreamd() : flags.qstreamd;
  const absl::Duration startup_timeout = absl::Seconds(flags.startup_timeout_seconds);
  absl::StatusOr<StartedDaemon> daemon = StartDaemon(qstreamd, config_path, flags.backend, startup_timeout);
  std::remove(config_path.c_str());
  if (!daemon.ok()) return daemon.status();
  ChildProcess* process = daemon->process.get();
  std::fprintf(stderr,
               "qstream-bench e2e: %s\n  %d streams x %d transitions (%s), prefill %lld, window %gs\n",
               daemon->startup_line.c_str(), flags.streams, flags.items_per_message, flags.kind.c_str(),
               static_cast<long long>(prefill), flags.seconds);

  LoadOptions load_options;
  load_options.address = daemon->grpc_address;
  load_options.streams = flags.streams;
  load_options.items_per_message = flags.items_per_message;
  load_options.in_flight = flags.in_flight;
  load_options.step_kind = flags.kind != "nstep";
  load_options.step_stream = flags.kind == "step_stream";
  load_options.seed = flags.seed;
  LoadStreams load(*spec, load_options);
  const Scraper scraper(daemon->metrics_port, process->pid(), &load);
  const absl::Time started = absl::Now();

  // Prefill: the learner starts at min_size_to_sample = prefill.
  for (;;) {
    if (absl::Status st = CheckAlive(process, "qstreamd"); !st.ok()) return st;
    absl::StatusOr<Sample> s = scraper.Now();
    if (!s.ok()) return s.status();
    if (s->Get("qstream_replay_size") >= static_cast<double>(prefill) &&
        s->Get("qstream_train_steps_total") > 0)
      break;
    if (absl::Now() - started > startup_timeout) {
      return absl::DeadlineExceededError(absl::StrCat(
          "replay at ", s->Get("qstream_replay_size"), " of ", prefill, " and ",
          s->Get("qstream_train_steps_total"), " learner steps after ", flags.startup_timeout_seconds, " s"));
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  std::fprintf(stderr, "  prefilled in %.1f s\n", absl::ToDoubleSeconds(absl::Now() - started));
  if (absl::Status st = Watch(flags.warmup_seconds, scraper, process, "warmup", started); !st.ok()) return st;

  load.StartMeasuring();
  absl::StatusOr<Sample> first = scraper.AfterNextPoll();
  if (!first.ok()) return first.status();
  if (absl::Status st = Watch(flags.seconds, scraper, process, "measure", started); !st.ok()) return st;
  absl::StatusOr<Sample> last = scraper.AfterNextPoll();
  if (!last.ok()) return last.status();
  if (absl::Status st = CheckAlive(process, "qstreamd"); !st.ok()) return st;

  absl::Status load_status = load.Stop();
  process->Signal(SIGTERM);
  const std::optional<int> exit_status = process->Wait(kShutdownTimeout);
  g_child_pid = 0;

  const Sample& a = *first;
  const Sample& b = *last;
  const double dt = absl::ToDoubleSeconds(b.at - a.at);
  auto rate = [&](const std::string& name) { return (b.Get(name) - a.Get(name)) / dt; };
  const double steps_per_s = rate("qstream_train_steps_total");
  const double ingest_per_s = rate("qstream_transitions_ingested_total");
  const double timed_steps =
      b.Get("qstream_train_step_seconds_count") - a.Get("qstream_train_step_seconds_count");
  const double timed_seconds =
      b.Get("qstream_train_step_seconds_sum") - a.Get("qstream_train_step_seconds_sum");
  const std::optional<Quantile> p50 = WindowQuantile(a, b, "qstream_train_step_seconds", 0.5);
  const std::optional<Quantile> p99 = WindowQuantile(a, b, "qstream_train_step_seconds", 0.99);
  const std::vector<double>& rtt = load.rtt_us();
  auto rtt_at = [&](double q) {
    return rtt.empty()
               ? 0.0
               : rtt[std::min(rtt.size() - 1, static_cast<size_t>(q * static_cast<double>(rtt.size())))];
  };
  auto us = [](const std::optional<Quantile>& q) {
    return q ? nlohmann::json(1e6 * q->value) : nlohmann::json();
  };
  auto range_us = [](const std::optional<Quantile>& q) {
    return q ? nlohmann::json::array({1e6 * q->lower, std::isinf(q->upper) ? -1.0 : 1e6 * q->upper})
             : nlohmann::json();
  };

  nlohmann::ordered_json j;
  j["bench"] = "e2e";
  j["config"] = flags.config;
  j["backend"] = StartupField(daemon->startup_line, "backend");
  j["device"] = StartupField(daemon->startup_line, "device");
  j["batch"] = flags.batch;
  j["streams"] = flags.streams;
  j["items_per_message"] = flags.items_per_message;
  j["in_flight"] = flags.in_flight;
  j["kind"] = flags.kind;
  j["replay_capacity"] = capacity;
  j["prefill"] = prefill;
  j["samples_per_insert"] = flags.samples_per_insert;
  j["seconds"] = dt;
  j["learner_steps_per_s"] = steps_per_s;
  j["ingest_transitions_per_s"] = ingest_per_s;
  j["acked_transitions_per_s"] = static_cast<double>(b.acked - a.acked) / dt;
  j["sampled_per_inserted"] = ingest_per_s > 0 ? steps_per_s * flags.batch / ingest_per_s : 0.0;
  j["step_p50_us"] = us(p50);
  j["step_p99_us"] = us(p99);
  // The histogram's 1-2-5 buckets: the quantiles are only as fine as these.
  j["step_p50_bucket_us"] = range_us(p50);
  j["step_p99_bucket_us"] = range_us(p99);
  j["step_mean_us"] = timed_steps > 0 ? 1e6 * timed_seconds / timed_steps : 0.0;
  // Fraction of the window the timed steps cover (1: the learner never waits between steps).
  j["learner_busy_fraction"] = timed_seconds / dt;
  j["daemon_cpu_s"] = b.daemon_cpu_s - a.daemon_cpu_s;
  j["daemon_cpu_cores"] = (b.daemon_cpu_s - a.daemon_cpu_s) / dt;
  j["bench_cpu_cores"] = (b.bench_cpu_s - a.bench_cpu_s) / dt;
  j["host_cores"] = std::thread::hardware_concurrency();
  j["rtt_p50_us"] = rtt_at(0.5);
  j["rtt_p99_us"] = rtt_at(0.99);
  j["error_acks"] = load.error_acks();
  j["rejected_batches"] = [&] {
    double n = 0;
    for (const auto& [name, value] : b.metrics) {
      if (name.rfind("qstream_ingest_rejected_total", 0) == 0) n += value - a.Get(name);
    }
    return n;
  }();
  j["replay_size"] = b.Get("qstream_replay_size");
  if (reference.contains("us_per_step")) {
    const double ref_steps_per_s = 1e6 / reference["us_per_step"].get<double>();
    j["reference_us_per_step"] = reference["us_per_step"];
    j["reference_steps_per_s"] = ref_steps_per_s;
    j["reference_source"] = reference["source"];
    j["reference_replay_size"] =
        reference.contains("replay_size") ? reference["replay_size"] : nlohmann::json();
    j["step_rate_ratio"] = steps_per_s / ref_steps_per_s;
    j["goal_met"] = steps_per_s / ref_steps_per_s >= kGoalStepRateRatio && ingest_per_s >= kGoalIngestPerS;
  } else {
    j["reference_us_per_step"] = nullptr;
    j["reference_steps_per_s"] = nullptr;
    j["reference_source"] = nullptr;
    j["reference_replay_size"] = nullptr;
    j["step_rate_ratio"] = nullptr;
    j["goal_met"] = nullptr;
  }
  j["daemon_exit_status"] = exit_status ? nlohmann::json(*exit_status) : nlohmann::json("timeout");
  j["daemon_commit"] = DaemonCommit(daemon->startup_line);
  j["commit"] = QSTREAM_GIT_COMMIT;
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);

  if (!load_status.ok()) return load_status;
  if (exit_status != 0) {
    return absl::InternalError(
        absl::StrCat("qstreamd did not shut down cleanly on SIGTERM (",
                     exit_status ? absl::StrCat("status ", *exit_status) : "still running",
                     "); its output:\n", process->output()));
  }
  return absl::OkStatus();
}

}  // namespace

int RunE2eBench(int argc, char** argv) { return RunSubcommand("e2e", argc, argv, ParseFlags, Usage, Run); }

}  // namespace qstream::bench
