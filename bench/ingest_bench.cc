// `qstream-bench ingest`: N actor streams on loopback push TransitionBatches
// of the h200 shape into an in-process daemon while its learner trains
// (BENCH.md "Ingest"). Reports accepted transitions per second, the batch
// round trip (write to ack) p50/p99, and the learner's step time during
// ingest against its step time idle, as one JSON line. The clients are
// bench/load_streams.h's.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/bench.h"
#include "bench/load_streams.h"
#include "qstream/version.h"
#include "server/daemon.h"
#include "trainer/config.h"

namespace qstream::bench {
namespace {

struct Flags {
  std::string config = "h200";
  std::string backend = "cpu";
  int streams = 64;
  int in_flight = 8;
  int batch = 256;  // transitions per TransitionBatch
  std::string kind = "nstep";
  double seconds = 5;  // per timed repeat
  int repeats = 3;
  double warmup_seconds = 3;
  double idle_seconds = 5;
  int learner_batch = 256;
  int64_t replay_capacity = 0;  // 0: the config's
  double samples_per_insert = 0;  // learner flat out
  uint64_t seed = 1;
};

void Usage() {
  std::fprintf(
      stderr,
      "usage: qstream-bench ingest [--config=h200|small] [--backend=cpu|cuda|auto] [--streams=64] "
      "[--in_flight=8]\n"
      "         [--batch=256] [--kind=nstep|step|step_stream] [--seconds=5] [--repeats=3] "
      "[--warmup_seconds=3]\n"
      "         [--idle_seconds=5] [--learner_batch=256] [--replay_capacity=N] [--samples_per_insert=0]\n"
      "         [--seed=1]\n");
}

absl::Status ParseFlags(int argc, char** argv, Flags* f) {
  return ParseFlagArgs(argc, argv, [f](const std::string& name, const std::string& value) {
    bool ok = true;
    if (name == "config") {
      f->config = value;
    } else if (name == "backend") {
      f->backend = value;
    } else if (name == "kind") {
      f->kind = value;
      ok = value == "nstep" || value == "step" || value == "step_stream";
    } else if (name == "streams") {
      ok = absl::SimpleAtoi(value, &f->streams) && f->streams > 0;
    } else if (name == "in_flight") {
      ok = absl::SimpleAtoi(value, &f->in_flight) && f->in_flight > 0;
    } else if (name == "batch") {
      ok = absl::SimpleAtoi(value, &f->batch) && f->batch > 0;
    } else if (name == "seconds") {
      ok = absl::SimpleAtod(value, &f->seconds) && f->seconds > 0;
    } else if (name == "repeats") {
      ok = absl::SimpleAtoi(value, &f->repeats) && f->repeats > 0;
    } else if (name == "warmup_seconds") {
      ok = absl::SimpleAtod(value, &f->warmup_seconds) && f->warmup_seconds >= 0;
    } else if (name == "idle_seconds") {
      ok = absl::SimpleAtod(value, &f->idle_seconds) && f->idle_seconds > 0;
    } else if (name == "learner_batch") {
      ok = absl::SimpleAtoi(value, &f->learner_batch) && f->learner_batch > 0;
    } else if (name == "replay_capacity") {
      ok = absl::SimpleAtoi(value, &f->replay_capacity) && f->replay_capacity >= 0;
    } else if (name == "samples_per_insert") {
      ok = absl::SimpleAtod(value, &f->samples_per_insert);
    } else if (name == "seed") {
      ok = absl::SimpleAtoi(value, &f->seed);
    } else {
      return FlagValue::kUnknown;
    }
    return ok ? FlagValue::kOk : FlagValue::kBad;
  });
}

// Learner progress at one instant: steps taken and the step-time histogram.
struct LearnerMark {
  int64_t steps = 0;
  int64_t rounds = 0;
  double round_seconds = 0;
  int64_t round_budget = 0;
  int64_t batches = 0;
  int64_t pending = 0;
  uint64_t timed_steps = 0;
  double step_seconds = 0;
  absl::Time at;
};

LearnerMark Mark(Daemon* daemon) {
  LearnerMark m;
  const LearnerStatus status = daemon->learner()->status();
  m.steps = status.steps;
  m.rounds = status.insert_rounds;
  m.round_seconds = status.insert_round_seconds;
  m.round_budget = status.insert_round_budget;
  m.batches = status.batches_inserted;
  m.pending = status.pending_batches;
  for (const auto& family : daemon->metrics().registry()->Collect()) {
    if (family.name != "qstream_train_step_seconds" || family.metric.empty()) continue;
    m.timed_steps = family.metric[0].histogram.sample_count;
    m.step_seconds = family.metric[0].histogram.sample_sum;
  }
  m.at = absl::Now();
  return m;
}

struct LearnerRate {
  double steps_per_s = 0;
  double step_us = 0;  // mean of the timed steps (the backend's own step timer)
  double rounds_per_s = 0;
  double round_us = 0;  // mean insert round
  double batches_per_round = 0;
};

LearnerRate Rate(const LearnerMark& a, const LearnerMark& b) {
  LearnerRate r;
  const double seconds = absl::ToDoubleSeconds(b.at - a.at);
  r.steps_per_s = static_cast<double>(b.steps - a.steps) / seconds;
  const auto rounds = static_cast<double>(b.rounds - a.rounds);
  r.rounds_per_s = rounds / seconds;
  if (rounds > 0) {
    r.round_us = 1e6 * (b.round_seconds - a.round_seconds) / rounds;
    r.batches_per_round = static_cast<double>(b.batches - a.batches) / rounds;
  }
  if (b.timed_steps > a.timed_steps) {
    r.step_us = 1e6 * (b.step_seconds - a.step_seconds) / static_cast<double>(b.timed_steps - a.timed_steps);
  }
  return r;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Percentile(std::vector<double>* sorted, double p) {
  if (sorted->empty()) return 0;
  const size_t i = std::min(sorted->size() - 1, static_cast<size_t>(p * static_cast<double>(sorted->size())));
  return (*sorted)[i];
}

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

absl::Status Run(const Flags& flags) {
  auto config = BenchConfig(flags.config);
  if (!config.ok()) return config.status();
  config->mutable_replay()->set_batch_size(flags.learner_batch);
  if (flags.replay_capacity > 0) config->mutable_replay()->set_capacity(flags.replay_capacity);
  config->mutable_rate_limiter()->set_samples_per_insert(static_cast<float>(flags.samples_per_insert));
  config->mutable_rate_limiter()->set_min_size_to_sample(
      std::min<int64_t>(config->replay().capacity(), std::max<int64_t>(flags.learner_batch, flags.batch)));
  config->mutable_server()->set_max_streams(std::max(config->server().max_streams(), flags.streams));
  config->set_seed(flags.seed);
  auto backend = ParseBackendKind(flags.backend);
  if (!backend.ok()) return backend.status();
  auto spec = NetworkSpec::Create(config->network());
  if (!spec.ok()) return spec.status();

  DaemonOptions options;
  options.config = *config;
  options.backend = *backend;
  options.listen = "127.0.0.1:0";
  auto daemon = Daemon::Start(options);
  if (!daemon.ok()) return daemon.status();
  Daemon* d = daemon->get();
  const LearnerStatus initial = d->learner()->status();
  std::fprintf(stderr, "qstream-bench ingest: %s; %d streams x %d transitions (%s)\n", d->StartupLine().c_str(),
               flags.streams, flags.batch, flags.kind.c_str());

  LoadOptions load;
  load.address = d->grpc_address();
  load.streams = flags.streams;
  load.in_flight = flags.in_flight;
  load.items_per_message = flags.batch;
  load.step_kind = flags.kind != "nstep";
  load.step_stream = flags.kind == "step_stream";
  load.seed = flags.seed;
  LoadStreams streams(*spec, load);

  absl::SleepFor(absl::Seconds(flags.warmup_seconds));
  streams.StartMeasuring();
  std::vector<double> rates, steps_ingest, step_us_ingest;
  for (int r = 0; r < flags.repeats; ++r) {
    const int64_t a0 = streams.accepted();
    const LearnerMark m0 = Mark(d);
    absl::SleepFor(absl::Seconds(flags.seconds));
    const int64_t a1 = streams.accepted();
    const LearnerMark m1 = Mark(d);
    const double rate = static_cast<double>(a1 - a0) / absl::ToDoubleSeconds(m1.at - m0.at);
    const LearnerRate lr = Rate(m0, m1);
    rates.push_back(rate);
    steps_ingest.push_back(lr.steps_per_s);
    step_us_ingest.push_back(lr.step_us);
    std::fprintf(stderr,
                 "  repeat %d: %.0f transitions/s, learner %.1f steps/s (%.0f us/step), insert rounds %.0f/s "
                 "of %.1f us, %.1f batches each, row budget %lld, %lld batches pending\n",
                 r, rate, lr.steps_per_s, lr.step_us, lr.rounds_per_s, lr.round_us, lr.batches_per_round,
                 static_cast<long long>(m1.round_budget), static_cast<long long>(m1.pending));
  }
  if (absl::Status st = streams.Stop(); !st.ok()) return st;
  const int64_t errors = streams.error_acks();
  std::vector<double> rtt = streams.rtt_us();

  // Idle: the same learner on the same replay, no ingest.
  std::vector<double> steps_idle, step_us_idle;
  const int idle_repeats = std::max(1, flags.repeats);
  for (int r = 0; r < idle_repeats; ++r) {
    const LearnerMark m0 = Mark(d);
    absl::SleepFor(absl::Seconds(flags.idle_seconds / idle_repeats));
    const LearnerRate lr = Rate(m0, Mark(d));
    steps_idle.push_back(lr.steps_per_s);
    step_us_idle.push_back(lr.step_us);
  }
  const LearnerStatus final_status = d->learner()->status();
  d->Shutdown(absl::Seconds(1));

  const double ingest_us = Median(step_us_ingest);
  const double idle_us = Median(step_us_idle);
  const double ingest_steps = Median(steps_ingest);
  const double idle_steps = Median(steps_idle);
  std::printf(
      "{\"bench\":\"ingest\",\"config\":%s,\"backend\":%s,\"device\":%s,\"streams\":%d,\"in_flight\":%d,"
      "\"batch\":%d,\"kind\":%s,"
      "\"learner_batch\":%d,\"samples_per_insert\":%g,\"seconds\":%g,\"repeats\":%d,"
      "\"transitions_per_s\":%.0f,\"transitions_per_s_min\":%.0f,\"transitions_per_s_max\":%.0f,"
      "\"rtt_p50_us\":%.0f,\"rtt_p99_us\":%.0f,\"acks\":%zu,\"error_acks\":%lld,"
      "\"step_us_ingest\":%.1f,\"step_us_idle\":%.1f,\"step_time_ratio\":%.3f,"
      "\"steps_per_s_ingest\":%.2f,\"steps_per_s_idle\":%.2f,\"step_rate_ratio\":%.3f,"
      "\"replay_size\":%lld,\"transitions_inserted\":%lld,\"commit\":%s}\n",
      Quote(flags.config).c_str(), Quote(initial.backend).c_str(), Quote(initial.device).c_str(),
      flags.streams, flags.in_flight, flags.batch, Quote(flags.kind).c_str(), flags.learner_batch,
      flags.samples_per_insert, flags.seconds, flags.repeats, Median(rates),
      *std::min_element(rates.begin(), rates.end()), *std::max_element(rates.begin(), rates.end()),
      Percentile(&rtt, 0.5), Percentile(&rtt, 0.99), rtt.size(), static_cast<long long>(errors), ingest_us,
      idle_us, idle_us > 0 ? ingest_us / idle_us : 0.0, ingest_steps, idle_steps,
      ingest_steps > 0 ? idle_steps / ingest_steps : 0.0, static_cast<long long>(final_status.replay_size),
      static_cast<long long>(final_status.transitions_inserted), Quote(QSTREAM_GIT_COMMIT).c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace

int RunIngestBench(int argc, char** argv) {
  return RunSubcommand("ingest", argc, argv, ParseFlags, Usage, Run);
}

}  // namespace qstream::bench
