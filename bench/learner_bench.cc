// `qstream-bench learner`: time of one whole learner step (DESIGN.md) on a
// replay filled with random transitions, per BENCH.md config and batch, next
// to the step's GEMM FLOPs, minimal memory traffic and the floor they imply.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench.h"
#include "qstream/version.h"
#include "trainer/backends/backend_factory.h"
#include "trainer/config.h"

namespace qstream::bench {
namespace {

// Transitions per Insert while filling (bounds the host staging memory).
constexpr int64_t kFillChunk = 1 << 16;
// Probability that a random transition is terminal (discount 0).
constexpr double kTerminalProbability = 0.05;
// Fill progress is reported on stderr every this many transitions.
constexpr int64_t kFillProgressEvery = 1 << 18;

struct Flags {
  std::vector<std::string> configs = {"small"};
  std::vector<int> batches;  // empty: BENCH.md's batches of each config
  std::string backend = "auto";
  std::vector<std::string> precisions;  // empty: the config's (tf32)
  int64_t replay_capacity = 0;          // 0: the config's
  int64_t steps = 0;    // 0: per backend default
  int64_t warmup = -1;  // -1: steps / 5
  int repeats = 5;
  int64_t fill = 0;  // 0: replay capacity
  uint64_t seed = 1;
  double peak_tflops = 0;  // 0: per backend default
  double peak_gbps = 0;
};

// Default peak rates for the floor: H200 dense TF32-class tensor rate and HBM3e
// bandwidth for CUDA; one AVX2 FMA core and its share of DRAM for the CPU.
constexpr double kCudaPeakTflops = 60;
constexpr double kCudaPeakGbps = 4800;
constexpr double kCpuPeakTflops = 0.1;
constexpr double kCpuPeakGbps = 20;
constexpr int64_t kCudaDefaultSteps = 2000;
constexpr int64_t kCpuDefaultSteps = 100;

std::vector<int> DefaultBatches(const std::string& config) {
  if (config == "h200") return {256, 1024};
  return {64, 256};
}

absl::Status ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return absl::CancelledError("help");
    if (arg.rfind("--", 0) != 0) return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    const size_t eq = arg.find('=');
    if (eq == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("flag needs a value: ", arg));
    const std::string name = arg.substr(2, eq - 2);
    const std::string value = arg.substr(eq + 1);
    auto bad = [&]() { return absl::InvalidArgumentError(absl::StrCat("--", name, ": bad value '", value, "'")); };
    if (name == "config") {
      f->configs = absl::StrSplit(value, ',', absl::SkipEmpty());
    } else if (name == "batch") {
      f->batches.clear();
      for (absl::string_view b : absl::StrSplit(value, ',', absl::SkipEmpty())) {
        int v;
        if (!absl::SimpleAtoi(b, &v) || v < 1) return bad();
        f->batches.push_back(v);
      }
    } else if (name == "backend") {
      f->backend = value;
    } else if (name == "precision") {
      f->precisions = absl::StrSplit(value, ',', absl::SkipEmpty());
      for (const std::string& p : f->precisions) {
        v1::TrainerConfig::MatmulPrecision parsed;
        if (!v1::TrainerConfig::MatmulPrecision_Parse(absl::AsciiStrToUpper(p), &parsed)) return bad();
      }
    } else if (name == "replay_capacity") {
      if (!absl::SimpleAtoi(value, &f->replay_capacity) || f->replay_capacity < 1) return bad();
    } else if (name == "steps") {
      if (!absl::SimpleAtoi(value, &f->steps) || f->steps < 1) return bad();
    } else if (name == "warmup") {
      if (!absl::SimpleAtoi(value, &f->warmup) || f->warmup < 0) return bad();
    } else if (name == "repeats") {
      if (!absl::SimpleAtoi(value, &f->repeats) || f->repeats < 1) return bad();
    } else if (name == "fill") {
      if (!absl::SimpleAtoi(value, &f->fill) || f->fill < 1) return bad();
    } else if (name == "seed") {
      if (!absl::SimpleAtoi(value, &f->seed)) return bad();
    } else if (name == "peak_tflops") {
      if (!absl::SimpleAtod(value, &f->peak_tflops) || f->peak_tflops <= 0) return bad();
    } else if (name == "peak_gbps") {
      if (!absl::SimpleAtod(value, &f->peak_gbps) || f->peak_gbps <= 0) return bad();
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
  }
  return absl::OkStatus();
}

// GEMM FLOPs of one step: online forward on 2B rows (s and s'), target
// forward on B rows (s'), backward dW for every layer and dX for every layer
// but the first, on B rows. Elementwise work (softmax, projection, Adam) is
// O(params + B * outputs) and left out.
double StepGemmFlops(const NetworkSpec& spec, int64_t batch) {
  double flops = 0;
  const std::vector<LinearView> layers = spec.layers();
  for (size_t i = 0; i < layers.size(); ++i) {
    const double mac_per_row = double{1} * layers[i].in * layers[i].out;
    const bool needs_dx = i != 0;  // the observations need no gradient
    const double rows = 2.0 * batch + batch + batch + (needs_dx ? batch : 0);
    flops += 2 * mac_per_row * rows;
  }
  return flops;
}

// Minimal bytes one step must move: parameters, target, gradient and both
// Adam moments read and written once each; the sampled transitions read once;
// the priorities of the whole replay read once by the sampling scan.
double StepMinimalBytes(const NetworkSpec& spec, int64_t batch, int64_t replay_size) {
  constexpr double kFloat = sizeof(float);
  constexpr double kFlatBuffers = 5;  // online, target, grad, adam m, adam v
  constexpr double kReadWrite = 2;
  const double param_bytes = kFlatBuffers * kReadWrite * kFloat * static_cast<double>(spec.num_params);
  const double row_bytes = kFloat * (2.0 * spec.obs_dim + spec.num_branches() + 2);  // s, s', a, R, discount
  const double batch_bytes = static_cast<double>(batch) * row_bytes;
  const double priority_bytes = kFloat * static_cast<double>(replay_size);
  return param_bytes + batch_bytes + priority_bytes;
}

TransitionColumns RandomTransitions(const NetworkSpec& spec, int64_t n, float discount, std::mt19937_64* rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::bernoulli_distribution terminal(kTerminalProbability);
  TransitionColumns t;
  t.n = n;
  t.obs_dim = spec.obs_dim;
  t.num_branches = spec.num_branches();
  t.Reserve(n);
  for (int64_t i = 0; i < n * spec.obs_dim; ++i) t.obs.push_back(normal(*rng));
  for (int64_t i = 0; i < n * spec.obs_dim; ++i) t.next_obs.push_back(normal(*rng));
  for (int64_t i = 0; i < n; ++i) {
    for (int br = 0; br < spec.num_branches(); ++br) {
      std::uniform_int_distribution<int32_t> action(0, spec.branch_actions[br] - 1);
      t.actions.push_back(action(*rng));
    }
    t.rewards.push_back(normal(*rng));
    t.discounts.push_back(terminal(*rng) ? 0.f : discount);
  }
  return t;
}

}  // namespace

absl::Status FillReplay(Backend* backend, int64_t count, float discount, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto start = std::chrono::steady_clock::now();
  int64_t next_report = kFillProgressEvery;
  for (int64_t done = 0; done < count;) {
    const int64_t n = std::min(kFillChunk, count - done);
    if (absl::Status s = backend->Insert(RandomTransitions(backend->spec(), n, discount, &rng)); !s.ok()) return s;
    done += n;
    if (done >= next_report || (done == count && count >= kFillProgressEvery)) {
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "  fill %lld / %lld (%.1f s)\n", static_cast<long long>(done),
                   static_cast<long long>(count), sec);
      next_report += kFillProgressEvery;
    }
  }
  return absl::OkStatus();
}

namespace {

struct Timing {
  double us_per_step = 0;
  std::string timer;  // "host" or "events"
};

// Runs `steps` steps. On a device backend the host clock stops only after
// the device is done (GetParams synchronizes); the backend's own event-timed
// windows are preferred when they cover most of the steps.
absl::StatusOr<Timing> TimeSteps(Backend* backend, int64_t steps) {
  const bool device = backend->name() != "cpu";
  std::vector<std::pair<double, int64_t>> windows;
  if (device) backend->GetParams();
  backend->DrainStepTimes(&windows);
  windows.clear();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < steps; ++i) {
    if (absl::Status s = backend->Step(); !s.ok()) return s;
  }
  if (device) backend->GetParams();
  const auto t1 = std::chrono::steady_clock::now();
  Timing t;
  t.us_per_step = std::chrono::duration<double, std::micro>(t1 - t0).count() / static_cast<double>(steps);
  t.timer = "host";
  if (device) {
    backend->DrainStepTimes(&windows);
    double seconds = 0;
    int64_t counted = 0;
    for (const auto& [sec_per_step, n] : windows) {
      seconds += sec_per_step * static_cast<double>(n);
      counted += n;
    }
    if (2 * counted >= steps && counted > 0) {
      t.us_per_step = 1e6 * seconds / static_cast<double>(counted);
      t.timer = "events";
    }
  }
  return t;
}

std::string Json(const std::map<std::string, std::string>& fields, const std::vector<std::string>& order) {
  std::string out = "{";
  for (size_t i = 0; i < order.size(); ++i) {
    absl::StrAppend(&out, i ? "," : "", "\"", order[i], "\":", fields.at(order[i]));
  }
  return out + "}";
}

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

absl::Status RunCase(const Flags& flags, const std::string& config_name, int batch,
                     const std::string& precision) {
  absl::StatusOr<v1::TrainerConfig> config = BenchConfig(config_name);
  if (!config.ok()) return config.status();
  config->mutable_replay()->set_batch_size(batch);
  if (flags.replay_capacity > 0) config->mutable_replay()->set_capacity(flags.replay_capacity);
  if (!precision.empty()) {
    v1::TrainerConfig::MatmulPrecision p = v1::TrainerConfig::TF32;
    if (!v1::TrainerConfig::MatmulPrecision_Parse(absl::AsciiStrToUpper(precision), &p)) {
      return absl::InvalidArgumentError(absl::StrCat("--precision: unknown '", precision, "'"));
    }
    config->set_matmul_precision(p);
  }
  config->set_seed(flags.seed);
  absl::StatusOr<BackendKind> kind = ParseBackendKind(flags.backend);
  if (!kind.ok()) return kind.status();
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(*config, *kind);
  if (!backend.ok()) return backend.status();
  Backend* b = backend->get();
  const bool cpu = b->name() == "cpu";

  const int64_t fill = flags.fill > 0 ? std::min(flags.fill, b->replay_capacity()) : b->replay_capacity();
  const float discount = std::pow(config->returns().gamma(), config->returns().n_step());
  std::fprintf(stderr, "qstream-bench learner: config=%s batch=%d backend=%s (%s): filling %lld transitions\n",
               config_name.c_str(), batch, b->name().c_str(), b->device().c_str(), static_cast<long long>(fill));
  if (absl::Status s = FillReplay(b, fill, discount, flags.seed); !s.ok()) return s;

  const int64_t steps = flags.steps > 0 ? flags.steps : (cpu ? kCpuDefaultSteps : kCudaDefaultSteps);
  const int64_t warmup = flags.warmup >= 0 ? flags.warmup : std::max<int64_t>(1, steps / 5);
  if (warmup > 0) {
    absl::StatusOr<Timing> w = TimeSteps(b, warmup);
    if (!w.ok()) return w.status();
  }
  std::vector<double> times;
  std::string timer;
  for (int r = 0; r < flags.repeats; ++r) {
    absl::StatusOr<Timing> t = TimeSteps(b, steps);
    if (!t.ok()) return t.status();
    times.push_back(t->us_per_step);
    timer = t->timer;
    std::fprintf(stderr, "  repeat %d: %.2f us/step (%s)\n", r, t->us_per_step, t->timer.c_str());
  }
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const size_t mid = sorted.size() / 2;
  const double median = sorted.size() % 2 ? sorted[mid] : 0.5 * (sorted[mid - 1] + sorted[mid]);

  const double peak_tflops = flags.peak_tflops > 0 ? flags.peak_tflops : (cpu ? kCpuPeakTflops : kCudaPeakTflops);
  const double peak_gbps = flags.peak_gbps > 0 ? flags.peak_gbps : (cpu ? kCpuPeakGbps : kCudaPeakGbps);
  const double flop = StepGemmFlops(b->spec(), batch);
  const double bytes = StepMinimalBytes(b->spec(), batch, b->replay_size());
  const double floor_us = std::max(flop / (peak_tflops * 1e12), bytes / (peak_gbps * 1e9)) * 1e6;

  std::map<std::string, std::string> f;
  f["bench"] = Quote("learner");
  f["config"] = Quote(config_name);
  f["backend"] = Quote(b->name());
  f["device"] = Quote(b->device());
  f["precision"] =
      Quote(absl::AsciiStrToLower(v1::TrainerConfig::MatmulPrecision_Name(MatmulPrecision(*config))));
  f["batch"] = absl::StrCat(batch);
  f["us_per_step"] = absl::StrCat(median);
  f["min"] = absl::StrCat(sorted.front());
  f["max"] = absl::StrCat(sorted.back());
  f["steps"] = absl::StrCat(steps);
  f["repeats"] = absl::StrCat(flags.repeats);
  f["replay_size"] = absl::StrCat(b->replay_size());
  f["timer"] = Quote(timer);
  f["commit"] = Quote(QSTREAM_GIT_COMMIT);
  f["flop_per_step"] = absl::StrCat(flop);
  f["bytes_per_step"] = absl::StrCat(bytes);
  f["peak_tflops"] = absl::StrCat(peak_tflops);
  f["peak_gbps"] = absl::StrCat(peak_gbps);
  f["floor_us"] = absl::StrCat(floor_us);
  f["achieved_tflops"] = absl::StrCat(flop / (median * 1e-6) / 1e12);
  std::printf("%s\n", Json(f, {"bench",          "config",      "backend",   "device",   "precision",
                               "batch",          "us_per_step", "min",       "max",      "steps",
                               "repeats",        "replay_size", "timer",     "commit",   "flop_per_step",
                               "bytes_per_step", "peak_tflops", "peak_gbps", "floor_us", "achieved_tflops"})
                          .c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace

int RunLearnerBench(int argc, char** argv) {
  Flags flags;
  if (absl::Status s = ParseFlags(argc, argv, &flags); !s.ok()) {
    if (!absl::IsCancelled(s)) std::fprintf(stderr, "qstream-bench learner: %s\n", std::string(s.message()).c_str());
    std::fprintf(
        stderr,
        "usage: qstream-bench learner [--config=small,h200] [--batch=64,256] [--backend=auto|cpu|cuda]\n"
        "  [--precision=fp32,tf32,bf16 (the config's: tf32)] [--replay_capacity=N (the config's)]\n"
        "  [--steps=N (cpu %lld, cuda %lld)] [--repeats=R (5)] [--warmup=W (steps/5)] [--fill=N (capacity)]\n"
        "  [--seed=S] [--peak_tflops=T (cpu %g, cuda %g)] [--peak_gbps=G (cpu %g, cuda %g)]\n",
        static_cast<long long>(kCpuDefaultSteps), static_cast<long long>(kCudaDefaultSteps), kCpuPeakTflops,
        kCudaPeakTflops, kCpuPeakGbps, kCudaPeakGbps);
    return absl::IsCancelled(s) ? 0 : 2;
  }
  for (const std::string& config : flags.configs) {
    const std::vector<int> batches = flags.batches.empty() ? DefaultBatches(config) : flags.batches;
    const std::vector<std::string> precisions =
        flags.precisions.empty() ? std::vector<std::string>{""} : flags.precisions;
    for (int batch : batches) {
      for (const std::string& precision : precisions) {
        if (absl::Status s = RunCase(flags, config, batch, precision); !s.ok()) {
          std::fprintf(stderr, "qstream-bench learner: config=%s batch=%d precision=%s: %s\n", config.c_str(),
                       batch, precision.c_str(), s.ToString().c_str());
          return 1;
        }
      }
    }
  }
  return 0;
}

}  // namespace qstream::bench
