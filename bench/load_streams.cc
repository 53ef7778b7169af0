#include "bench/load_streams.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/tensor.h"
#include "qstream/v1/experience.pb.h"

namespace qstream::bench {
namespace {

constexpr char kStreamMethod[] = "/qstream.v1.ExperienceService/Stream";
// Distinct batch bodies per stream (content does not matter, variety does not either).
constexpr int kBodiesPerStream = 4;
// Probability that a generated transition ends its episode.
constexpr double kTerminalProbability = 0.02;

// A batch body without its sequence number, serialized once.
std::string MakeBody(const NetworkSpec& spec, int count, bool step_kind, bool step_stream,
                     std::mt19937_64* rng) {
  std::uniform_real_distribution<float> u(-1, 1);
  std::bernoulli_distribution terminal(kTerminalProbability);
  const int64_t n = count;
  const int64_t obs_dim = spec.obs_dim;
  const int64_t branches = static_cast<int64_t>(spec.branch_actions.size());
  std::vector<float> obs(n * obs_dim), next_obs(n * obs_dim), rewards(n), discounts(n);
  std::vector<int32_t> actions(n * branches);
  std::vector<uint8_t> done(n);
  std::vector<uint32_t> env_ids(n);
  for (int64_t i = 0; i < n * obs_dim; ++i) {
    obs[i] = u(*rng);
    next_obs[i] = u(*rng);
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < branches; ++j) {
      actions[i * branches + j] = static_cast<int32_t>((*rng)() % spec.branch_actions[j]);
    }
    rewards[i] = u(*rng);
    const bool end = terminal(*rng);
    done[i] = end ? 1 : 0;
    discounts[i] = end ? 0.0f : 0.97f;
    env_ids[i] = static_cast<uint32_t>(i % 16);
  }
  v1::TransitionBatch b;
  b.set_kind(step_kind ? v1::TransitionBatch::KIND_STEP : v1::TransitionBatch::KIND_NSTEP);
  b.set_count(count);
  wire::SetTensor(b.mutable_obs(), obs, {n, obs_dim});
  if (step_kind && step_stream) {
    // The step-stream form: the final obs of the rows that end, no next_obs.
    std::vector<float> final_obs;
    for (int64_t i = 0; i < n; ++i) {
      if (done[i] != 0)
        final_obs.insert(final_obs.end(), &next_obs[i * obs_dim], &next_obs[(i + 1) * obs_dim]);
    }
    const auto ends = static_cast<int64_t>(final_obs.size()) / obs_dim;
    if (ends > 0) wire::SetTensor(b.mutable_final_obs(), final_obs, {ends, obs_dim});
  } else {
    wire::SetTensor(b.mutable_next_obs(), next_obs, {n, obs_dim});
  }
  wire::SetTensor(b.mutable_actions(), actions, {n, branches});
  wire::SetTensor(b.mutable_rewards(), rewards, {n});
  if (step_kind) {
    wire::SetTensor(b.mutable_done(), done, {n});
    wire::SetTensor(b.mutable_env_ids(), env_ids, {n});
  } else {
    wire::SetTensor(b.mutable_discounts(), discounts, {n});
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

}  // namespace

// One actor stream: keeps up to `in_flight` batches written but not yet
// acknowledged (one write outstanding at a time, one read always pending);
// on stop it sends nothing more, waits for the last ack and half-closes.
class BenchStream final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  BenchStream(grpc::GenericStub* stub, std::vector<grpc::Slice> bodies, int in_flight,
              const std::atomic<bool>* stop, const std::atomic<bool>* measuring)
      : bodies_(std::move(bodies)), in_flight_(in_flight), stop_(stop), measuring_(measuring) {
    stub->PrepareBidiStreamingCall(&context_, kStreamMethod, grpc::StubOptions(), this);
    StartRead(&in_);
    StartCall();
    Pump();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the read fails too and ends the stream
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
    }
    Pump();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    grpc::Slice slice;
    v1::Ack ack;
    if (in_.DumpToSingleSlice(&slice).ok() &&
        ack.ParseFromArray(slice.begin(), static_cast<int>(slice.size()))) {
      accepted_.fetch_add(ack.accepted(), std::memory_order_relaxed);
      acks_.fetch_add(1, std::memory_order_relaxed);
      if (ack.has_error()) errors_.fetch_add(1, std::memory_order_relaxed);
    }
    {
      absl::MutexLock lock(&mu_);
      ++acked_;
      if (!sent_at_.empty()) {
        if (measuring_->load(std::memory_order_relaxed)) {
          rtt_us_.push_back(
              std::chrono::duration<double, std::micro>(Clock::now() - sent_at_.front()).count());
        }
        sent_at_.pop_front();
      }
    }
    StartRead(&in_);  // fails once the server ends the stream
    Pump();
  }

  void OnDone(const grpc::Status& status) override {
    status_ = status;
    done_.Notify();
  }

  void WaitDone() { done_.WaitForNotification(); }
  int64_t accepted() const { return accepted_.load(std::memory_order_relaxed); }
  int64_t acks() const { return acks_.load(std::memory_order_relaxed); }
  int64_t errors() const { return errors_.load(std::memory_order_relaxed); }
  // Read only after WaitDone().
  std::vector<double> rtt_us() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return rtt_us_;
  }
  const grpc::Status& status() const { return status_; }

 private:
  // Sends the next batch while the window has room; after stop, half-closes
  // once every batch sent is acknowledged.
  void Pump() {
    enum { kNothing, kSend, kClose } action = kNothing;
    {
      absl::MutexLock lock(&mu_);
      if (writing_ || closed_) return;
      if (stop_->load(std::memory_order_relaxed)) {
        if (acked_ == sequence_) {
          closed_ = true;
          action = kClose;
        }
      } else if (sequence_ - acked_ < static_cast<uint64_t>(in_flight_)) {
        writing_ = true;
        ++sequence_;
        grpc::Slice parts[2] = {grpc::Slice(SequencePrefix(sequence_)), bodies_[sequence_ % bodies_.size()]};
        out_ = grpc::ByteBuffer(parts, 2);
        sent_at_.push_back(Clock::now());
        action = kSend;
      }
    }
    if (action == kSend) StartWrite(&out_);
    if (action == kClose) StartWritesDone();
  }

  grpc::ClientContext context_;
  const std::vector<grpc::Slice> bodies_;
  const int in_flight_;
  const std::atomic<bool>* const stop_;
  const std::atomic<bool>* const measuring_;
  grpc::ByteBuffer out_;  // the write in progress (one at a time)
  grpc::ByteBuffer in_;
  absl::Mutex mu_;
  uint64_t sequence_ ABSL_GUARDED_BY(mu_) = 0;  // batches sent (the last one's sequence)
  uint64_t acked_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Clock::time_point> sent_at_ ABSL_GUARDED_BY(mu_);  // of the unacknowledged batches
  std::atomic<int64_t> accepted_{0};
  std::atomic<int64_t> acks_{0};
  std::atomic<int64_t> errors_{0};
  std::vector<double> rtt_us_ ABSL_GUARDED_BY(mu_);
  grpc::Status status_;
  absl::Notification done_;
};

LoadStreams::LoadStreams(const NetworkSpec& spec, const LoadOptions& options) {
  std::mt19937_64 rng(options.seed);
  for (int s = 0; s < options.streams; ++s) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxSendMessageSize(-1);
    channels_.push_back(grpc::CreateCustomChannel(options.address, grpc::InsecureChannelCredentials(), args));
    stubs_.push_back(std::make_unique<grpc::GenericStub>(channels_.back()));
    std::vector<grpc::Slice> bodies;
    bodies.reserve(kBodiesPerStream);
    for (int k = 0; k < kBodiesPerStream; ++k) {
      bodies.emplace_back(
          MakeBody(spec, options.items_per_message, options.step_kind, options.step_stream, &rng));
    }
    streams_.push_back(std::make_unique<BenchStream>(stubs_.back().get(), std::move(bodies),
                                                     options.in_flight, &stop_, &measuring_));
  }
}

LoadStreams::~LoadStreams() { Stop().IgnoreError(); }

int64_t LoadStreams::accepted() const {
  int64_t n = 0;
  for (const auto& s : streams_) n += s->accepted();
  return n;
}

int64_t LoadStreams::acks() const {
  int64_t n = 0;
  for (const auto& s : streams_) n += s->acks();
  return n;
}

absl::Status LoadStreams::Stop() {
  if (stopped_) return stop_status_;
  stopped_ = true;
  measuring_ = false;
  stop_ = true;
  for (auto& s : streams_) {
    s->WaitDone();
    error_acks_ += s->errors();
    const std::vector<double> rtt = s->rtt_us();
    rtt_us_.insert(rtt_us_.end(), rtt.begin(), rtt.end());
    if (!s->status().ok() && stop_status_.ok()) {
      stop_status_ = absl::InternalError(absl::StrCat("stream ended with ", s->status().error_message()));
    }
  }
  std::sort(rtt_us_.begin(), rtt_us_.end());
  return stop_status_;
}

}  // namespace qstream::bench
