#include "server/validate.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace qstream {

v1::Error BatchError::ToProto() const {
  v1::Error e;
  e.set_code(code);
  e.set_field(field);
  e.set_message(message);
  return e;
}

const std::vector<std::string>& BatchFieldNames() {
  static const std::vector<std::string> kNames = {"kind",    "count",     "obs",       "next_obs",
                                                  "actions", "rewards",   "discounts", "done",
                                                  "truncated", "env_ids", "policy_version", "stream_id"};
  return kNames;
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

// Branch-free scan first (vectorizes over the whole column); the index of the
// offending value is searched only when the column is known to be bad.
bool AllFinite(const float* x, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], sizeof(bits));
    bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

std::optional<BatchError> CheckFinite(const char* field, const float* x, int64_t n) {
  if (AllFinite(x, n)) return std::nullopt;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return Invalid(field, absl::StrCat(field, "[", i, "]: ", x[i], " is not finite"));
  }
  return std::nullopt;
}

constexpr size_t kMaxStreamIdBytes = 128;

bool StreamIdChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == ':' || c == '@' || c == '/' || c == '-';
}

}  // namespace

std::optional<BatchError> ValidateBatch(const v1::TransitionBatch& batch, const NetworkSpec& spec,
                                        const v1::ServerConfig& server) {
  const auto kind = batch.kind();
  if (kind == v1::TransitionBatch::KIND_UNSPECIFIED) {
    return Invalid("kind", "kind: unspecified; every batch names its kind (KIND_NSTEP or KIND_STEP)");
  }
  if (kind != v1::TransitionBatch::KIND_NSTEP && kind != v1::TransitionBatch::KIND_STEP) {
    return Invalid("kind", absl::StrCat("kind: unknown value ", static_cast<int>(kind)));
  }
  const std::string& stream_id = batch.stream_id();
  if (stream_id.size() > kMaxStreamIdBytes) {
    return Invalid("stream_id", absl::StrCat("stream_id: ", stream_id.size(), " bytes, at most ", kMaxStreamIdBytes));
  }
  for (size_t i = 0; i < stream_id.size(); ++i) {
    if (!StreamIdChar(stream_id[i])) {
      return Invalid("stream_id", absl::StrCat("stream_id[", i, "]: byte 0x", absl::Hex(static_cast<uint8_t>(stream_id[i]),
                                                                                         absl::kZeroPad2),
                                               " is not one of [A-Za-z0-9._:@/-]"));
    }
  }
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
