// `qstream-bench load`: one client process of the process-level ingest bench
// (bench/ingest_compare.py). It opens --streams actor streams to a running
// qstreamd (bench/load_streams.h: pre-serialized bodies of --config's shape),
// sends flat out from start-up, and counts acks at the wall-clock instants
// --start_at + k * --window_seconds (k = 0..--repeats), so every client
// process of a run measures the same windows as the driver's /metrics and
// /proc scrapes. Round trips are recorded inside the windows only. Prints one
// JSON line: acked transitions and acks per window, totals over the whole
// run (the driver's acked == ingested check), error acks, round-trip
// p50/p99.
//
// `qstream-bench daemon_config --config=h200 [--learner_batch=256]`: the
// bench config as a text-format TrainerConfig, for qstreamd --config.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench.h"
#include "bench/load_streams.h"
#include "google/protobuf/text_format.h"
#include "nlohmann/json.hpp"
#include "trainer/config.h"
#include "trainer/network_spec.h"

namespace qstream::bench {
namespace {

struct LoadFlags {
  std::string address;
  std::string config = "h200";
  int streams = 1;
  int in_flight = 8;
  int items_per_message = 64;
  std::string kind = "nstep";
  double start_at = 0;  // Unix seconds; 0: now + 1 s
  double window_seconds = 5;
  int repeats = 3;
  uint64_t seed = 1;
};

void LoadUsage() {
  std::fprintf(
      stderr,
      "usage: qstream-bench load --address=HOST:PORT [--config=h200|small] [--streams=1] [--in_flight=8]\n"
      "         [--items_per_message=64] [--kind=nstep|step|step_stream] [--start_at=UNIX_SECONDS (now+1)]\n"
      "         [--window_seconds=5] [--repeats=3] [--seed=1]\n");
}

absl::Status ParseLoadFlags(int argc, char** argv, LoadFlags* f) {
  absl::Status st = ParseFlagArgs(argc, argv, [f](const std::string& name, const std::string& value) {
    bool ok = true;
    if (name == "address") {
      f->address = value;
    } else if (name == "config") {
      f->config = value;
    } else if (name == "streams") {
      ok = absl::SimpleAtoi(value, &f->streams) && f->streams > 0;
    } else if (name == "in_flight") {
      ok = absl::SimpleAtoi(value, &f->in_flight) && f->in_flight > 0;
    } else if (name == "items_per_message") {
      ok = absl::SimpleAtoi(value, &f->items_per_message) && f->items_per_message > 0;
    } else if (name == "kind") {
      f->kind = value;
      ok = value == "nstep" || value == "step" || value == "step_stream";
    } else if (name == "start_at") {
      ok = absl::SimpleAtod(value, &f->start_at) && f->start_at >= 0;
    } else if (name == "window_seconds") {
      ok = absl::SimpleAtod(value, &f->window_seconds) && f->window_seconds > 0;
    } else if (name == "repeats") {
      ok = absl::SimpleAtoi(value, &f->repeats) && f->repeats > 0;
    } else if (name == "seed") {
      ok = absl::SimpleAtoi(value, &f->seed);
    } else {
      return FlagValue::kUnknown;
    }
    return ok ? FlagValue::kOk : FlagValue::kBad;
  });
  if (st.ok() && f->address.empty()) return absl::InvalidArgumentError("--address is required");
  return st;
}

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  return sorted[std::min(sorted.size() - 1, static_cast<size_t>(p * static_cast<double>(sorted.size())))];
}

absl::Status RunLoad(const LoadFlags& flags) {
  absl::StatusOr<v1::TrainerConfig> config = BenchConfig(flags.config);
  if (!config.ok()) return config.status();
  absl::StatusOr<NetworkSpec> spec = NetworkSpec::Create(config->network());
  if (!spec.ok()) return spec.status();
  const absl::Time start = flags.start_at > 0
                               ? absl::FromUnixNanos(static_cast<int64_t>(flags.start_at * 1e9))
                               : absl::Now() + absl::Seconds(1);

  LoadOptions options;
  options.address = flags.address;
  options.streams = flags.streams;
  options.in_flight = flags.in_flight;
  options.items_per_message = flags.items_per_message;
  options.step_kind = flags.kind != "nstep";
  options.step_stream = flags.kind == "step_stream";
  options.seed = flags.seed;
  LoadStreams load(*spec, options);

  nlohmann::ordered_json windows = nlohmann::json::array();
  int64_t acked0 = 0, acks0 = 0;
  for (int k = 0; k <= flags.repeats; ++k) {
    absl::SleepFor(start + absl::Seconds(k * flags.window_seconds) - absl::Now());
    const int64_t acked = load.accepted(), acks = load.acks();
    if (k == 0) {
      load.StartMeasuring();
    } else {
      windows.push_back({{"acked", acked - acked0}, {"acks", acks - acks0}});
    }
    acked0 = acked;
    acks0 = acks;
  }
  load.StopMeasuring();
  absl::Status stopped = load.Stop();

  nlohmann::ordered_json j;
  j["client"] = "cpp";
  j["streams"] = flags.streams;
  j["in_flight"] = flags.in_flight;
  j["items_per_message"] = flags.items_per_message;
  j["window_seconds"] = flags.window_seconds;
  j["windows"] = windows;
  j["acked_total"] = load.accepted();
  j["acks_total"] = load.acks();
  j["error_acks"] = load.error_acks();
  j["rtt_count"] = load.rtt_us().size();
  j["rtt_p50_us"] = Percentile(load.rtt_us(), 0.5);
  j["rtt_p99_us"] = Percentile(load.rtt_us(), 0.99);
  j["status"] = stopped.ok() ? "ok" : std::string(stopped.message());
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
  return stopped;
}

struct ConfigFlags {
  std::string config = "h200";
  int learner_batch = 0;  // 0: the config's
};

void ConfigUsage() {
  std::fprintf(stderr, "usage: qstream-bench daemon_config [--config=h200|small] [--learner_batch=N]\n");
}

absl::Status ParseConfigFlags(int argc, char** argv, ConfigFlags* f) {
  return ParseFlagArgs(argc, argv, [f](const std::string& name, const std::string& value) {
    bool ok = true;
    if (name == "config") {
      f->config = value;
    } else if (name == "learner_batch") {
      ok = absl::SimpleAtoi(value, &f->learner_batch) && f->learner_batch >= 0;
    } else {
      return FlagValue::kUnknown;
    }
    return ok ? FlagValue::kOk : FlagValue::kBad;
  });
}

absl::Status RunConfig(const ConfigFlags& flags) {
  absl::StatusOr<v1::TrainerConfig> config = BenchConfig(flags.config);
  if (!config.ok()) return config.status();
  if (flags.learner_batch > 0) config->mutable_replay()->set_batch_size(flags.learner_batch);
  std::string text;
  google::protobuf::TextFormat::PrintToString(*config, &text);
  std::fputs(text.c_str(), stdout);
  return absl::OkStatus();
}

}  // namespace

int RunLoadClient(int argc, char** argv) {
  return RunSubcommand("load", argc, argv, ParseLoadFlags, LoadUsage, RunLoad);
}

int RunDaemonConfig(int argc, char** argv) {
  return RunSubcommand("daemon_config", argc, argv, ParseConfigFlags, ConfigUsage, RunConfig);
}

}  // namespace qstream::bench
