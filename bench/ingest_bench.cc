// `qstream-bench ingest`: N actor streams on loopback push TransitionBatches
// of the h200 shape into an in-process daemon while its learner trains
// (BENCH.md "Ingest"). Reports accepted transitions per second, the batch
// round trip (write to ack) p50/p99, and the learner's step time during
// ingest against its step time idle, as one JSON line.
//
// The clients are callback reactors (no thread per stream) that send
// pre-serialized batch bodies: each message is a 1-field prefix carrying the
// sequence number followed by a shared body slice (protobuf merges the
// concatenation), so the client costs almost nothing and the measured rate is
// the daemon's.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "bench/bench.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "qstream/v1/experience.pb.h"
#include "server/daemon.h"
#include "trainer/config.h"
#include "qstream/version.h"

namespace qstream::bench {
namespace {

constexpr char kStreamMethod[] = "/qstream.v1.ExperienceService/Stream";
// Distinct batch bodies per stream (content does not matter, variety does not either).
constexpr int kBodiesPerStream = 4;
// Probability that a generated transition ends its episode.
constexpr double kTerminalProbability = 0.02;

struct Flags {
  std::string config = "h200";
  std::string backend = "cpu";
  int streams = 64;
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
  std::fprintf(stderr,
               "usage: qstream-bench ingest [--config=h200|small] [--backend=cpu|cuda|auto] [--streams=64]\n"
               "         [--batch=256] [--kind=nstep|step] [--seconds=5] [--repeats=3] [--warmup_seconds=3]\n"
               "         [--idle_seconds=5] [--learner_batch=256] [--replay_capacity=N] [--samples_per_insert=0]\n"
               "         [--seed=1]\n");
}

absl::Status ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return absl::CancelledError("help");
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("expected --name=value, got '", arg, "'"));
    }
    const std::string name = arg.substr(2, eq - 2);
    const std::string value = arg.substr(eq + 1);
    bool ok = true;
    if (name == "config") {
      f->config = value;
    } else if (name == "backend") {
      f->backend = value;
    } else if (name == "kind") {
      f->kind = value;
      ok = value == "nstep" || value == "step";
    } else if (name == "streams") {
      ok = absl::SimpleAtoi(value, &f->streams) && f->streams > 0;
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
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    if (!ok) return absl::InvalidArgumentError(absl::StrCat("--", name, ": bad value '", value, "'"));
  }
  return absl::OkStatus();
}

// A batch body without its sequence number, serialized once.
std::string MakeBody(const NetworkSpec& spec, int count, bool step_kind, std::mt19937_64* rng) {
  std::uniform_real_distribution<float> u(-1, 1);
  std::bernoulli_distribution terminal(kTerminalProbability);
  v1::TransitionBatch b;
  b.set_kind(step_kind ? v1::TransitionBatch::KIND_STEP : v1::TransitionBatch::KIND_NSTEP);
  b.set_count(count);
  for (int64_t i = 0; i < int64_t{count} * spec.obs_dim; ++i) {
    b.add_obs(u(*rng));
    b.add_next_obs(u(*rng));
  }
  for (int i = 0; i < count; ++i) {
    for (int n : spec.branch_actions) b.add_actions(static_cast<int32_t>((*rng)() % n));
    b.add_rewards(u(*rng));
    if (step_kind) {
      b.add_done(terminal(*rng));
      b.add_env_ids(i % 16);
    } else {
      b.add_discounts(terminal(*rng) ? 0.0f : 0.97f);
    }
  }
  return b.SerializeAsString();
}

// Field 1 (sequence, varint) of TransitionBatch.
std::string SequencePrefix(uint64_t sequence) {
  std::string out(1, static_cast<char>(0x08));
  do {
    uint8_t byte = sequence & 0x7f;
    sequence >>= 7;
    if (sequence) byte |= 0x80;
    out.push_back(static_cast<char>(byte));
  } while (sequence);
  return out;
}

using Clock = std::chrono::steady_clock;

// One actor stream: write a batch, wait for both the write and its ack, repeat.
class BenchStream final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  BenchStream(grpc::GenericStub* stub, std::vector<grpc::Slice> bodies, const std::atomic<bool>* stop,
              const std::atomic<bool>* measuring)
      : bodies_(std::move(bodies)), stop_(stop), measuring_(measuring) {
    stub->PrepareBidiStreamingCall(&context_, kStreamMethod, grpc::StubOptions(), this);
    StartCall();
    Send();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the read fails too and ends the stream
    Advance();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    grpc::Slice slice;
    v1::Ack ack;
    if (in_.DumpToSingleSlice(&slice).ok() &&
        ack.ParseFromArray(slice.begin(), static_cast<int>(slice.size()))) {
      accepted_.fetch_add(ack.accepted(), std::memory_order_relaxed);
      if (ack.has_error()) errors_.fetch_add(1, std::memory_order_relaxed);
    }
    if (measuring_->load(std::memory_order_relaxed)) {
      rtt_us_.push_back(std::chrono::duration<double, std::micro>(Clock::now() - sent_at_).count());
    }
    Advance();
  }

  void OnDone(const grpc::Status& status) override {
    status_ = status;
    done_.Notify();
  }

  void WaitDone() { done_.WaitForNotification(); }
  int64_t accepted() const { return accepted_.load(std::memory_order_relaxed); }
  int64_t errors() const { return errors_.load(std::memory_order_relaxed); }
  // Read only after WaitDone().
  const std::vector<double>& rtt_us() const { return rtt_us_; }
  const grpc::Status& status() const { return status_; }

 private:
  // Both the write and the ack of the batch in flight completed: send the next.
  void Advance() {
    {
      absl::MutexLock lock(&mu_);
      if (++completions_ < 2) return;
      completions_ = 0;
    }
    if (stop_->load(std::memory_order_relaxed)) {
      StartWritesDone();
      return;
    }
    Send();
  }

  void Send() {
    ++sequence_;
    grpc::Slice parts[2] = {grpc::Slice(SequencePrefix(sequence_)), bodies_[sequence_ % bodies_.size()]};
    out_ = grpc::ByteBuffer(parts, 2);
    sent_at_ = Clock::now();
    StartRead(&in_);
    StartWrite(&out_);
  }

  grpc::ClientContext context_;
  const std::vector<grpc::Slice> bodies_;
  const std::atomic<bool>* const stop_;
  const std::atomic<bool>* const measuring_;
  grpc::ByteBuffer out_;
  grpc::ByteBuffer in_;
  uint64_t sequence_ = 0;
  Clock::time_point sent_at_;
  absl::Mutex mu_;
  int completions_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> accepted_{0};
  std::atomic<int64_t> errors_{0};
  std::vector<double> rtt_us_;
  grpc::Status status_;
  absl::Notification done_;
};

// Learner progress at one instant: steps taken and the step-time histogram.
struct LearnerMark {
  int64_t steps = 0;
  uint64_t timed_steps = 0;
  double step_seconds = 0;
  absl::Time at;
};

LearnerMark Mark(Daemon* daemon) {
  LearnerMark m;
  m.steps = daemon->learner()->status().steps;
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
};

LearnerRate Rate(const LearnerMark& a, const LearnerMark& b) {
  LearnerRate r;
  r.steps_per_s = static_cast<double>(b.steps - a.steps) / absl::ToDoubleSeconds(b.at - a.at);
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

  // One channel (one HTTP/2 connection) per stream, as separate actors have.
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  std::atomic<bool> stop{false};
  std::atomic<bool> measuring{false};
  std::vector<std::unique_ptr<BenchStream>> streams;
  std::mt19937_64 rng(flags.seed);
  for (int s = 0; s < flags.streams; ++s) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxSendMessageSize(-1);
    channels.push_back(grpc::CreateCustomChannel(d->grpc_address(), grpc::InsecureChannelCredentials(), args));
    stubs.push_back(std::make_unique<grpc::GenericStub>(channels.back()));
    std::vector<grpc::Slice> bodies;
    for (int k = 0; k < kBodiesPerStream; ++k) bodies.emplace_back(MakeBody(*spec, flags.batch, flags.kind == "step", &rng));
    streams.push_back(std::make_unique<BenchStream>(stubs.back().get(), std::move(bodies), &stop, &measuring));
  }
  auto total_accepted = [&] {
    int64_t n = 0;
    for (const auto& s : streams) n += s->accepted();
    return n;
  };

  absl::SleepFor(absl::Seconds(flags.warmup_seconds));
  measuring = true;
  std::vector<double> rates, steps_ingest, step_us_ingest;
  for (int r = 0; r < flags.repeats; ++r) {
    const int64_t a0 = total_accepted();
    const LearnerMark m0 = Mark(d);
    absl::SleepFor(absl::Seconds(flags.seconds));
    const int64_t a1 = total_accepted();
    const LearnerMark m1 = Mark(d);
    const double rate = static_cast<double>(a1 - a0) / absl::ToDoubleSeconds(m1.at - m0.at);
    const LearnerRate lr = Rate(m0, m1);
    rates.push_back(rate);
    steps_ingest.push_back(lr.steps_per_s);
    step_us_ingest.push_back(lr.step_us);
    std::fprintf(stderr, "  repeat %d: %.0f transitions/s, learner %.1f steps/s (%.0f us/step)\n", r, rate,
                 lr.steps_per_s, lr.step_us);
  }
  measuring = false;
  stop = true;
  int64_t errors = 0;
  std::vector<double> rtt;
  for (auto& s : streams) {
    s->WaitDone();
    errors += s->errors();
    rtt.insert(rtt.end(), s->rtt_us().begin(), s->rtt_us().end());
    if (!s->status().ok()) {
      return absl::InternalError(absl::StrCat("stream ended with ", s->status().error_message()));
    }
  }
  std::sort(rtt.begin(), rtt.end());

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
      "{\"bench\":\"ingest\",\"config\":%s,\"backend\":%s,\"device\":%s,\"streams\":%d,\"batch\":%d,\"kind\":%s,"
      "\"learner_batch\":%d,\"samples_per_insert\":%g,\"seconds\":%g,\"repeats\":%d,"
      "\"transitions_per_s\":%.0f,\"transitions_per_s_min\":%.0f,\"transitions_per_s_max\":%.0f,"
      "\"rtt_p50_us\":%.0f,\"rtt_p99_us\":%.0f,\"acks\":%zu,\"error_acks\":%lld,"
      "\"step_us_ingest\":%.1f,\"step_us_idle\":%.1f,\"step_time_ratio\":%.3f,"
      "\"steps_per_s_ingest\":%.2f,\"steps_per_s_idle\":%.2f,\"step_rate_ratio\":%.3f,"
      "\"replay_size\":%lld,\"transitions_inserted\":%lld,\"commit\":%s}\n",
      Quote(flags.config).c_str(), Quote(initial.backend).c_str(), Quote(initial.device).c_str(), flags.streams,
      flags.batch, Quote(flags.kind).c_str(), flags.learner_batch, flags.samples_per_insert, flags.seconds,
      flags.repeats, Median(rates), *std::min_element(rates.begin(), rates.end()),
      *std::max_element(rates.begin(), rates.end()), Percentile(&rtt, 0.5), Percentile(&rtt, 0.99), rtt.size(),
      static_cast<long long>(errors), ingest_us, idle_us, idle_us > 0 ? ingest_us / idle_us : 0.0, ingest_steps,
      idle_steps, ingest_steps > 0 ? idle_steps / ingest_steps : 0.0,
      static_cast<long long>(final_status.replay_size), static_cast<long long>(final_status.transitions_inserted),
      Quote(QSTREAM_GIT_COMMIT).c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace

int RunIngestBench(int argc, char** argv) {
  Flags flags;
  if (absl::Status s = ParseFlags(argc, argv, &flags); !s.ok()) {
    if (!absl::IsCancelled(s)) std::fprintf(stderr, "qstream-bench ingest: %s\n", std::string(s.message()).c_str());
    Usage();
    return absl::IsCancelled(s) ? 0 : 2;
  }
  if (absl::Status s = Run(flags); !s.ok()) {
    std::fprintf(stderr, "qstream-bench ingest: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace qstream::bench
