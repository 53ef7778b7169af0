#include "server/validate.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace qstream {

v1::Error BatchError::ToProto() const {
  v1::Error e;
  e.set_code(code);
  e.set_field(field);
  e.set_message(message);
  return e;
}

const std::vector<std::string>& BatchFieldNames() {
  // "queued_bytes": server.max_queued_bytes was full; "message": the bytes
  // did not parse (the stream ended).
  static const std::vector<std::string> kNames = {
      "kind",    "count",   "obs",       "next_obs", "actions",        "rewards",   "discounts",
      "done",    "truncated", "env_ids", "policy_version", "stream_id", "queued_bytes", "message"};
  return kNames;
}

int64_t FirstNonFinite(const float* x, int64_t n) {
  // Branch-free scan first (vectorizes over the whole column); the index of
  // the offending value is searched only when the column is known to be bad.
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], sizeof(bits));
    bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  if (bad == 0) return -1;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return i;
  }
  return -1;
}

namespace {

BatchError Invalid(const std::string& field, std::string message) {
  return BatchError{v1::Error::INVALID_FIELD, field, std::move(message)};
}

std::optional<BatchError> CheckLength(const char* field, int64_t actual, int64_t expected,
                                      const std::string& expected_how) {
  if (actual == expected) return std::nullopt;
  return Invalid(field, absl::StrCat(field, ": ", actual, " values, expected ", expected_how, " = ", expected));
}

std::optional<BatchError> CheckFinite(const char* field, const float* x, int64_t n) {
  const int64_t i = FirstNonFinite(x, n);
  if (i < 0) return std::nullopt;
  return Invalid(field, absl::StrCat(field, "[", i, "]: ", x[i], " is not finite"));
}

bool StreamIdChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == ':' || c == '@' || c == '/' || c == '-';
}

BatchError StreamIdTooLong(uint64_t bytes, const v1::ServerConfig& server) {
  return BatchError{v1::Error::TOO_LARGE, "stream_id",
                    absl::StrCat("stream_id: ", bytes, " bytes, at most server.max_stream_id_bytes = ",
                                 server.max_stream_id_bytes())};
}

std::optional<BatchError> CheckStreamId(absl::string_view id, const v1::ServerConfig& server) {
  if (static_cast<int64_t>(id.size()) > server.max_stream_id_bytes()) return StreamIdTooLong(id.size(), server);
  for (size_t i = 0; i < id.size(); ++i) {
    if (!StreamIdChar(id[i])) {
      return Invalid("stream_id", absl::StrCat("stream_id[", i, "]: byte 0x",
                                               absl::Hex(static_cast<uint8_t>(id[i]), absl::kZeroPad2),
                                               " is not one of [A-Za-z0-9._:@/-]"));
    }
  }
  return std::nullopt;
}

DecodedBatch Unparsable(std::string why) {
  DecodedBatch d;
  d.result = DecodedBatch::kUnparsable;
  d.error = Invalid("message", std::move(why));
  return d;
}

// The pre-scan: walks the top-level fields, checks every stream_id
// (field 13, length-delimited) and skips everything else; it also reads the
// sequence, so that a rejected batch's ack can name it. A stream_id of
// another wire type is an unknown field to protobuf, never a string.
DecodedBatch ScanStreamIds(google::protobuf::io::ZeroCopyInputStream* bytes, const v1::ServerConfig& server,
                           uint64_t* sequence) {
  using google::protobuf::internal::WireFormatLite;
  google::protobuf::io::CodedInputStream in(bytes);
  const uint32_t stream_id_tag = WireFormatLite::MakeTag(v1::TransitionBatch::kStreamIdFieldNumber,
                                                         WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
  const uint32_t sequence_tag =
      WireFormatLite::MakeTag(v1::TransitionBatch::kSequenceFieldNumber, WireFormatLite::WIRETYPE_VARINT);
  std::optional<BatchError> rejected;
  std::string id;
  for (;;) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) {
      if (!in.ConsumedEntireMessage()) return Unparsable("invalid field tag");
      if (!rejected) return DecodedBatch{};
      DecodedBatch d;
      d.result = DecodedBatch::kRejected;
      d.error = std::move(*rejected);
      return d;
    }
    if (tag == sequence_tag) {
      if (!in.ReadVarint64(sequence)) return Unparsable("sequence is malformed");
      continue;
    }
    if (tag != stream_id_tag) {
      if (!WireFormatLite::SkipField(&in, tag)) {
        return Unparsable(
            absl::StrCat("field ", WireFormatLite::GetTagFieldNumber(tag), " is truncated or malformed"));
      }
      continue;
    }
    uint32_t length;
    if (!in.ReadVarint32(&length)) return Unparsable("stream_id length is malformed");
    if (static_cast<int64_t>(length) > server.max_stream_id_bytes()) {
      if (!rejected) rejected = StreamIdTooLong(length, server);
      if (!in.Skip(static_cast<int>(length))) return Unparsable("stream_id is truncated");
      continue;
    }
    if (!in.ReadString(&id, static_cast<int>(length))) return Unparsable("stream_id is truncated");
    if (!rejected) rejected = CheckStreamId(id, server);
  }
}

template <typename Open>
DecodedBatch Decode(Open open, size_t size, const v1::ServerConfig& server, v1::TransitionBatch* out) {
  out->Clear();
  {
    auto scan = open();
    uint64_t sequence = 0;
    DecodedBatch d = ScanStreamIds(&scan, server, &sequence);
    if (d.result == DecodedBatch::kRejected) out->set_sequence(sequence);
    if (d.result == DecodedBatch::kUnparsable) {
      d.error.message = absl::StrCat("TransitionBatch: message does not parse (", size, " bytes): ", d.error.message);
    }
    if (d.result != DecodedBatch::kParsed) return d;
  }
  auto parse = open();
  if (!out->ParseFromZeroCopyStream(&parse)) {
    out->Clear();
    return Unparsable(absl::StrCat("TransitionBatch: message does not parse (", size, " bytes)"));
  }
  return DecodedBatch{};
}

}  // namespace

DecodedBatch DecodeBatch(absl::string_view bytes, const v1::ServerConfig& server, v1::TransitionBatch* out) {
  if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return Unparsable(absl::StrCat("TransitionBatch: message does not parse (", bytes.size(),
                                   " bytes): more than protobuf parses"));
  }
  return Decode([bytes] { return google::protobuf::io::ArrayInputStream(bytes.data(), static_cast<int>(bytes.size())); },
                bytes.size(), server, out);
}

DecodedBatch DecodeBatch(grpc::ByteBuffer* bytes, const v1::ServerConfig& server, v1::TransitionBatch* out) {
  const size_t size = bytes->Length();
  return Decode([bytes] { return grpc::ProtoBufferReader(bytes); }, size, server, out);
}

std::optional<BatchError> ValidateBatch(const v1::TransitionBatch& batch, const NetworkSpec& spec,
                                        const v1::ServerConfig& server) {
  const auto kind = batch.kind();
  if (kind == v1::TransitionBatch::KIND_UNSPECIFIED) {
    return Invalid("kind", "kind: unspecified; every batch names its kind (KIND_NSTEP or KIND_STEP)");
  }
  if (kind != v1::TransitionBatch::KIND_NSTEP && kind != v1::TransitionBatch::KIND_STEP) {
    return Invalid("kind", absl::StrCat("kind: unknown value ", static_cast<int>(kind)));
  }
  if (auto e = CheckStreamId(batch.stream_id(), server)) return e;
  const bool step = kind == v1::TransitionBatch::KIND_STEP;
  const int64_t n = batch.count();
  if (n == 0) return Invalid("count", "count: must be > 0");
  if (n > server.max_batch_transitions()) {
    return BatchError{v1::Error::TOO_LARGE, "count",
                      absl::StrCat("count: ", n, " exceeds server.max_batch_transitions = ",
                                   server.max_batch_transitions())};
  }
  const int64_t obs_len = n * spec.obs_dim;
  const std::string obs_how = absl::StrCat("count x obs_dim = ", n, " x ", spec.obs_dim);
  if (auto e = CheckLength("obs", batch.obs_size(), obs_len, obs_how)) return e;
  if (auto e = CheckLength("next_obs", batch.next_obs_size(), obs_len, obs_how)) return e;
  const int branches = spec.num_branches();
  if (auto e = CheckLength("actions", batch.actions_size(), n * branches,
                           absl::StrCat("count x branches = ", n, " x ", branches))) {
    return e;
  }
  if (auto e = CheckLength("rewards", batch.rewards_size(), n, "count")) return e;
  if (step) {
    if (batch.discounts_size() != 0) {
      return Invalid("discounts", "discounts: must be empty for KIND_STEP (the daemon computes them)");
    }
    if (auto e = CheckLength("done", batch.done_size(), n, "count")) return e;
    if (batch.truncated_size() != 0) {
      if (auto e = CheckLength("truncated", batch.truncated_size(), n, "count or 0")) return e;
    }
    if (batch.env_ids_size() != 0) {
      if (auto e = CheckLength("env_ids", batch.env_ids_size(), n, "count or 0")) return e;
    }
    if (batch.truncated_size() != 0) {
      for (int64_t i = 0; i < n; ++i) {
        if (batch.done(i) && batch.truncated(i)) {
          return Invalid("done", absl::StrCat("done[", i, "] and truncated[", i,
                                              "] are both true (an episode ends either terminal or cut)"));
        }
      }
    }
  } else {
    if (auto e = CheckLength("discounts", batch.discounts_size(), n, "count")) return e;
    if (batch.done_size() != 0) return Invalid("done", "done: only allowed with KIND_STEP");
    if (batch.truncated_size() != 0) return Invalid("truncated", "truncated: only allowed with KIND_STEP");
    if (batch.env_ids_size() != 0) return Invalid("env_ids", "env_ids: only allowed with KIND_STEP");
  }

  if (auto e = CheckFinite("obs", batch.obs().data(), obs_len)) return e;
  if (auto e = CheckFinite("next_obs", batch.next_obs().data(), obs_len)) return e;
  if (auto e = CheckFinite("rewards", batch.rewards().data(), n)) return e;
  const int32_t* actions = batch.actions().data();
  for (int64_t i = 0; i < n; ++i) {
    for (int b = 0; b < branches; ++b) {
      const int32_t a = actions[i * branches + b];
      if (a < 0 || a >= spec.branch_actions[b]) {
        return Invalid("actions", absl::StrCat("actions[", i * branches + b, "]: ", a, " out of range [0, ",
                                               spec.branch_actions[b], ") for branch ", b));
      }
    }
  }
  if (!step) {
    const float* d = batch.discounts().data();
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(d[i]) || d[i] < 0.0f || d[i] > 1.0f) {
        return Invalid("discounts", absl::StrCat("discounts[", i, "]: ", d[i], " not in [0, 1]"));
      }
    }
  }
  if (batch.policy_version() < 0) {
    return Invalid("policy_version", absl::StrCat("policy_version: ", batch.policy_version(), " is negative"));
  }
  return std::nullopt;
}

}  // namespace qstream
