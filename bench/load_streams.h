// Load generator of the ingest and end-to-end benches: N actor streams, one
// channel (HTTP/2 connection) each, pushing pre-serialized TransitionBatches
// of a config's shape to a daemon's ExperienceService and counting the acks.
//
// The streams are callback reactors (no thread per stream) that send
// pre-serialized batch bodies: each message is a 1-field prefix carrying the
// sequence number followed by a shared body slice (protobuf merges the
// concatenation), so the client costs almost nothing and the measured rate is
// the daemon's.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "trainer/network_spec.h"

namespace qstream::bench {

struct LoadOptions {
  std::string address;  // host:port, plaintext (loopback)
  int streams = 1;
  int items_per_message = 256;  // transitions per TransitionBatch
  bool step_kind = false;       // KIND_STEP (server-side n-step) instead of KIND_NSTEP
  bool step_stream = false;     // with step_kind: the step-stream form (final_obs at ends, no next_obs)
  int in_flight = 1;            // batches sent but not yet acknowledged, per stream
  uint64_t seed = 1;
};

class BenchStream;

class LoadStreams {
 public:
  // Opens every stream and starts sending at once.
  LoadStreams(const NetworkSpec& spec, const LoadOptions& options);
  ~LoadStreams();  // Stop() when not stopped yet

  // Transitions acknowledged as accepted so far, all streams.
  int64_t accepted() const;
  // Acks received so far (one per message), all streams.
  int64_t acks() const;
  // From now until StopMeasuring() or Stop(), every round trip (write to ack) is recorded.
  void StartMeasuring() { measuring_ = true; }
  void StopMeasuring() { measuring_ = false; }
  // Ends every stream after its batches in flight and waits for them; an
  // error when a stream ended with a non-OK status.
  absl::Status Stop();
  // After Stop(): acks with an error, and the recorded round trips (µs, sorted).
  int64_t error_acks() const { return error_acks_; }
  const std::vector<double>& rtt_us() const { return rtt_us_; }

 private:
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> measuring_{false};
  std::vector<std::unique_ptr<BenchStream>> streams_;
  bool stopped_ = false;
  absl::Status stop_status_;
  int64_t error_acks_ = 0;
  std::vector<double> rtt_us_;
};

}  // namespace qstream::bench
