// Decoding and validation of an incoming TransitionBatch against the network
// shape and the server limits. Pure functions: the RPC layer calls them
// before anything of the batch is converted or inserted, and a failure
// becomes an error Ack (or, for bytes that do not parse, the end of the
// stream).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "grpcpp/support/byte_buffer.h"
#include "qstream/v1/config.pb.h"
#include "qstream/v1/experience.pb.h"
#include "server/episode_reports.h"
#include "trainer/network_spec.h"
#include "trainer/transitions.h"

namespace qstream {

struct BatchError {
  v1::Error::Code code = v1::Error::INVALID_FIELD;
  // Name of the proto field that failed, e.g. "actions" (also the metric label).
  std::string field;
  // Names the field and the offending index, e.g.
  // "actions[13]: 7 out of range [0, 5) for branch 1".
  std::string message;

  v1::Error ToProto() const;
};

// Every value BatchError::field can take (the ingest-rejected metric's
// reason label values).
const std::vector<std::string>& BatchFieldNames();

// What DecodeBatch made of a message's bytes.
struct DecodedBatch {
  enum Result {
    kParsed,      // the batch is in *out (not validated yet: ValidateBatch)
    kRejected,    // `error` is the Ack's error; the stream carries on
    kUnparsable,  // the bytes are no TransitionBatch; `error.message` says why
  };
  Result result = kParsed;
  BatchError error;
};

// Parses one TransitionBatch from its wire bytes, after a pre-scan of the
// top-level fields: every stream_id occurrence must be at most
// server.max_stream_id_bytes long (checked from its length prefix, before a
// byte of it is copied) and of [A-Za-z0-9._:@/-], and every env occurrence
// at most wire::kMaxEnvBytes of [A-Za-z0-9_.:/-] (so both are valid UTF-8
// and protobuf's parser never logs about them). Other fields are skipped by
// the scan and parsed by protobuf. `out` is cleared first; when the batch is
// rejected it holds only its sequence (for the Ack).
DecodedBatch DecodeBatch(absl::string_view bytes, const v1::ServerConfig& server, v1::TransitionBatch* out);
// The same over a received gRPC message, read twice (scan, parse) without
// flattening it.
DecodedBatch DecodeBatch(grpc::ByteBuffer* bytes, const v1::ServerConfig& server, v1::TransitionBatch* out);

// Index of the first non-finite value of x[0, n), or -1.
int64_t FirstNonFinite(const float* x, int64_t n);

// A validated batch as the ingest session takes it: the wire tensors copied
// into typed columns, one memcpy per column.
struct IncomingBatch {
  uint64_t sequence = 0;
  v1::TransitionBatch::Kind kind = v1::TransitionBatch::KIND_UNSPECIFIED;
  int64_t policy_version = 0;
  std::string stream_id;
  // obs, next_obs, actions, rewards; discounts for KIND_NSTEP only; next_obs
  // empty for a KIND_STEP batch in the step-stream form.
  TransitionColumns columns;
  // KIND_STEP only, one byte (0/1) per transition; truncated and env_ids are
  // empty when the batch left them unset (all false / all env 0).
  std::vector<uint8_t> done;
  std::vector<uint8_t> truncated;
  std::vector<uint32_t> env_ids;
  // KIND_STEP in the step-stream form: ends x obs_dim, the final observation
  // of each row with done or truncated, in row order.
  std::vector<float> final_obs;
  // The batch's episode reports and env label (counted once the batch
  // commits; see IngestOutcome::episodes).
  EpisodeReports episodes;

  int64_t count() const { return columns.n; }
  // Heap bytes it holds (what server.max_queued_bytes counts for it).
  int64_t bytes() const;
};

// Checks, in order: kind (KIND_NSTEP or KIND_STEP; KIND_UNSPECIFIED is an
// error), stream_id (at most server.max_stream_id_bytes of [A-Za-z0-9._:@/-]),
// count (> 0, <= server.max_batch_transitions; 0 only with episodes and
// every column unset), policy_version >= 0, env (at most wire::kMaxEnvBytes
// of [A-Za-z0-9_.:/-]; TOO_LARGE beyond), episodes (at most
// wire::kMaxEpisodesPerBatch, TOO_LARGE beyond; each with a finite
// episode_return of at most wire::kMaxAbsEpisodeReturn in magnitude, a
// length in [1, wire::kMaxEpisodeLength] and policy_version >= 0; the error's
// field is "episodes", its message names the report: "episodes[3].length: 0
// is not in [1, 1000000000]"), then every column's tensor:
// present when required, absent when the kind forbids it, its dtype, its
// shape (obs, next_obs: [count, obs_dim]; actions: [count, branches];
// rewards, discounts, done, truncated, env_ids: [count]; final_obs: [ends,
// obs_dim], ends = rows with done or truncated, KIND_STEP without next_obs
// only, may be unset when ends = 0) and its byte length (product of the
// shape x the dtype's size); then values (obs, next_obs, final_obs,
// rewards finite; actions in range of their branch; discounts finite and in
// [0, 1]; flags 0 or 1; never done[i] and truncated[i] both true). (The
// number of env_ids per session is the ingest
// session's to check.) Returns nullopt when the batch is valid; then `out`
// (when given) holds its columns. Errors name the field: "obs: shape [3],
// expected [count, obs_dim] = [3, 48]".
std::optional<BatchError> ValidateBatch(const v1::TransitionBatch& batch, const NetworkSpec& spec,
                                        const v1::ServerConfig& server, IncomingBatch* out = nullptr);

}  // namespace qstream
