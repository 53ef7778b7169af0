// TransitionBatch ingest as the daemon runs it on every message of a stream:
// DecodeBatch (stream_id pre-scan, protobuf parse), ValidateBatch, and for
// valid KIND_STEP batches the n-step assembly of one ingest session, whose
// windows carry from batch to batch and survive a Save/Load round trip.
//
// Input: the messages of one stream, each as a varint length and that many
// bytes (protobuf's delimited format); a length beyond the input takes the
// rest. Each message is decoded twice, from one flat buffer and from a gRPC
// ByteBuffer of two slices (as a message arrives), and both must agree.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_init.h"
#include "google/protobuf/io/coded_stream.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "qstream/v1/checkpoint.pb.h"
#include "qstream/v1/config.pb.h"
#include "server/nstep.h"
#include "server/validate.h"
#include "trainer/network_spec.h"
#include "trainer/transitions.h"

namespace qstream {
namespace {

constexpr int kMaxMessages = 16;
constexpr int kNStep = 3;
constexpr float kGamma = 0.9f;

struct Setup {
  NetworkSpec spec;
  v1::ServerConfig server;
  NStepAssembler assembler;
};

const Setup& GetSetup() {
  static const Setup* setup = [] {
    v1::NetworkConfig net;
    net.set_obs_dim(4);
    net.add_trunk_hidden(8);
    net.set_head_hidden(8);
    net.set_num_atoms(5);
    net.add_branch_actions(2);
    absl::StatusOr<NetworkSpec> spec = NetworkSpec::Create(net);
    FUZZ_CHECK(spec.ok());
    v1::ServerConfig server;
    // Small limits, so the fuzzer reaches them.
    server.set_max_batch_transitions(64);
    server.set_max_stream_id_bytes(32);
    server.set_max_envs_per_stream(4);
    return new Setup{*spec, server, NStepAssembler(*spec, kNStep, kGamma, server.max_envs_per_stream())};
  }();
  return *setup;
}

// Every column of `c` holds c.n rows of the network's shape.
// Columns the replay takes (with_discounts) or a validated KIND_STEP batch's
// (no discounts: the assembler computes them; next_obs may be empty in the
// step-stream form, which validation allows only for KIND_STEP).
void CheckColumns(const TransitionColumns& c, const NetworkSpec& spec, bool with_discounts = true) {
  FUZZ_CHECK(c.obs.size() == static_cast<size_t>(c.n) * spec.obs_dim);
  FUZZ_CHECK(c.next_obs.size() == c.obs.size() || (!with_discounts && c.next_obs.empty()));
  FUZZ_CHECK(c.actions.size() == static_cast<size_t>(c.n) * spec.num_branches());
  FUZZ_CHECK(c.rewards.size() == static_cast<size_t>(c.n));
  FUZZ_CHECK(c.discounts.size() == (with_discounts ? static_cast<size_t>(c.n) : 0));
  for (float d : c.discounts) FUZZ_CHECK(d >= 0 && d <= 1);
}

// Save, Load, Save again: the same checkpoint form, and the same pending steps.
void CheckSaveLoad(const NStepAssembler& assembler, const NStepWindows& windows) {
  v1::IngestSessionState saved;
  assembler.Save(windows, saved.mutable_windows());
  NStepWindows loaded;
  const absl::Status st = assembler.Load(saved.windows(), &loaded);
  FUZZ_CHECK(st.ok());
  FUZZ_CHECK(NStepAssembler::Pending(loaded) == NStepAssembler::Pending(windows));
  v1::IngestSessionState again;
  assembler.Save(loaded, again.mutable_windows());
  FUZZ_CHECK(again.SerializeAsString() == saved.SerializeAsString());
}

void OneMessage(absl::string_view bytes, size_t split, NStepWindows* committed) {
  const Setup& s = GetSetup();
  v1::TransitionBatch batch;
  const DecodedBatch decoded = DecodeBatch(bytes, s.server, &batch);

  // The daemon's overload, over a message in two slices.
  grpc::Slice slices[2] = {grpc::Slice(bytes.data(), split),
                           grpc::Slice(bytes.data() + split, bytes.size() - split)};
  grpc::ByteBuffer buffer(slices, 2);
  v1::TransitionBatch from_buffer;
  const DecodedBatch decoded_buffer = DecodeBatch(&buffer, s.server, &from_buffer);
  FUZZ_CHECK(decoded.result == decoded_buffer.result);
  FUZZ_CHECK(decoded.error.field == decoded_buffer.error.field);
  FUZZ_CHECK(from_buffer.SerializeAsString() == batch.SerializeAsString());
  if (decoded.result != DecodedBatch::kParsed) return;

  IncomingBatch incoming;
  if (ValidateBatch(batch, s.spec, s.server, &incoming)) return;
  CheckColumns(incoming.columns, s.spec, /*with_discounts=*/batch.kind() == v1::TransitionBatch::KIND_NSTEP);
  // final_obs: one row per episode end, only in the step-stream form.
  if (incoming.columns.next_obs.empty() && incoming.columns.n > 0) {
    size_t ends = 0;
    for (size_t i = 0; i < static_cast<size_t>(incoming.columns.n); ++i) {
      const bool truncated = i < incoming.truncated.size() && incoming.truncated[i] != 0;
      ends += (incoming.done[i] != 0 || truncated) ? 1 : 0;
    }
    FUZZ_CHECK(incoming.final_obs.size() == ends * s.spec.obs_dim);
  } else {
    FUZZ_CHECK(incoming.final_obs.empty());
  }
  if (batch.kind() != v1::TransitionBatch::KIND_STEP) return;

  // Add advances a copy (the session's issued windows), Replay the committed
  // windows: both must end equal; a rejected batch changes nothing.
  NStepWindows issued = *committed;
  TransitionColumns out;
  out.obs_dim = s.spec.obs_dim;
  out.num_branches = s.spec.num_branches();
  const int64_t pending = NStepAssembler::Pending(*committed);
  v1::IngestSessionState before;
  s.assembler.Save(*committed, before.mutable_windows());
  if (s.assembler.Add(incoming, &issued, &out)) {
    v1::IngestSessionState after;
    s.assembler.Save(issued, after.mutable_windows());
    FUZZ_CHECK(out.n == 0 && after.SerializeAsString() == before.SerializeAsString());
    return;
  }
  CheckColumns(out, s.spec);
  s.assembler.Replay(incoming, committed);
  {
    v1::IngestSessionState a, b;
    s.assembler.Save(issued, a.mutable_windows());
    s.assembler.Save(*committed, b.mutable_windows());
    FUZZ_CHECK(a.SerializeAsString() == b.SerializeAsString());
  }
  // Every step is either still waiting or left as an item.
  FUZZ_CHECK(pending + batch.count() == NStepAssembler::Pending(*committed) + out.n);
  FUZZ_CHECK(static_cast<int64_t>(committed->size()) <= s.server.max_envs_per_stream());
  // An awaiting window (step-stream form) holds its n-th step until the next obs comes.
  for (const auto& [id, w] : *committed)
    FUZZ_CHECK(w.size > 0 && w.size <= (w.awaiting ? kNStep : kNStep - 1));
  CheckSaveLoad(s.assembler, *committed);
}

}  // namespace
}  // namespace qstream

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  qstream::QuietProtobufLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace qstream;
  google::protobuf::io::CodedInputStream in(data, static_cast<int>(size));
  NStepWindows committed;
  for (int m = 0; m < kMaxMessages; ++m) {
    uint32_t length;
    if (!in.ReadVarint32(&length)) break;
    const size_t at = static_cast<size_t>(in.CurrentPosition());
    const size_t n = std::min<size_t>(length, size - at);
    const absl::string_view bytes(reinterpret_cast<const char*>(data) + at, n);
    // A split point that moves with the content, so both slice layouts get exercised.
    const size_t split = n == 0 ? 0 : (static_cast<size_t>(length) * 7 + m) % (n + 1);
    OneMessage(bytes, split, &committed);
    if (!in.Skip(static_cast<int>(n))) break;
  }
  const Setup& s = GetSetup();
  TransitionColumns flushed;
  flushed.obs_dim = s.spec.obs_dim;
  flushed.num_branches = s.spec.num_branches();
  s.assembler.Flush(committed, &flushed);
  CheckColumns(flushed, s.spec);
  // An awaiting window's newest step has no next obs yet: the flush drops it.
  int64_t awaiting = 0;
  for (const auto& [id, w] : committed) awaiting += w.awaiting ? 1 : 0;
  FUZZ_CHECK(flushed.n == NStepAssembler::Pending(committed) - awaiting);
  return 0;
}
