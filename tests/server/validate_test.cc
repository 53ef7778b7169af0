#include "server/validate.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <limits>
#include <vector>

#include "absl/strings/string_view.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

#include "gtest/gtest.h"
#include "trainer/config.h"

namespace qstream {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// obs_dim 2, two branches of 3 and 5 actions.
NetworkSpec Spec() {
  v1::NetworkConfig net = DefaultConfig().network();
  net.set_obs_dim(2);
  net.clear_branch_actions();
  net.add_branch_actions(3);
  net.add_branch_actions(5);
  return *NetworkSpec::Create(net);
}

v1::ServerConfig Server(int max_batch = 100) {
  v1::ServerConfig s;
  s.set_max_batch_transitions(max_batch);
  return s;
}

v1::TransitionBatch NStep(int n) {
  v1::TransitionBatch b;
  b.set_kind(v1::TransitionBatch::KIND_NSTEP);
  b.set_count(n);
  for (int i = 0; i < n * 2; ++i) {
    b.add_obs(0.5f * i);
    b.add_next_obs(-0.5f * i);
  }
  for (int i = 0; i < n; ++i) {
    b.add_actions(i % 3);
    b.add_actions(i % 5);
    b.add_rewards(1.0f);
    b.add_discounts(0.9f);
  }
  return b;
}

v1::TransitionBatch Step(int n) {
  v1::TransitionBatch b = NStep(n);
  b.set_kind(v1::TransitionBatch::KIND_STEP);
  b.clear_discounts();
  for (int i = 0; i < n; ++i) b.add_done(false);
  return b;
}

void ExpectError(const v1::TransitionBatch& b, const std::string& field, const std::string& message,
                 v1::Error::Code code = v1::Error::INVALID_FIELD) {
  auto e = ValidateBatch(b, Spec(), Server());
  ASSERT_TRUE(e.has_value()) << "expected an error on " << field;
  EXPECT_EQ(e->field, field);
  EXPECT_EQ(e->message, message);
  EXPECT_EQ(e->code, code);
}

TEST(ValidateBatchTest, AcceptsWellFormedBatches) {
  EXPECT_FALSE(ValidateBatch(NStep(8), Spec(), Server()).has_value());
  EXPECT_FALSE(ValidateBatch(Step(8), Spec(), Server()).has_value());
  v1::TransitionBatch named = NStep(3);
  named.set_stream_id("actor-7.host_a:0@eu/west");
  EXPECT_FALSE(ValidateBatch(named, Spec(), Server()).has_value());
  named.set_stream_id(std::string(128, 'x'));
  EXPECT_FALSE(ValidateBatch(named, Spec(), Server()).has_value());
  v1::TransitionBatch step = Step(3);
  for (int i = 0; i < 3; ++i) {
    step.add_truncated(i == 2);
    step.add_env_ids(7 * i);
  }
  EXPECT_FALSE(ValidateBatch(step, Spec(), Server()).has_value());
  v1::TransitionBatch edges = NStep(2);
  edges.set_discounts(0, 0.0f);
  edges.set_discounts(1, 1.0f);
  edges.set_actions(2, 2);
  edges.set_actions(3, 4);
  EXPECT_FALSE(ValidateBatch(edges, Spec(), Server()).has_value());
}

TEST(ValidateBatchTest, UnknownKind) {
  v1::TransitionBatch b = NStep(2);
  b.set_kind(static_cast<v1::TransitionBatch::Kind>(9));
  ExpectError(b, "kind", "kind: unknown value 9");
}

TEST(ValidateBatchTest, UnspecifiedKindIsAnError) {
  v1::TransitionBatch b = NStep(3);
  b.set_kind(v1::TransitionBatch::KIND_UNSPECIFIED);
  ExpectError(b, "kind", "kind: unspecified; every batch names its kind (KIND_NSTEP or KIND_STEP)");
}

TEST(ValidateBatchTest, StreamIdLengthAndBytes) {
  v1::TransitionBatch b = NStep(2);
  b.set_stream_id(std::string(129, 'a'));
  ExpectError(b, "stream_id", "stream_id: 129 bytes, at most server.max_stream_id_bytes = 128",
              v1::Error::TOO_LARGE);
  b.set_stream_id("actor 7");
  ExpectError(b, "stream_id", "stream_id[5]: byte 0x20 is not one of [A-Za-z0-9._:@/-]");
  b.set_stream_id("a\xc3\xa9");
  ExpectError(b, "stream_id", "stream_id[1]: byte 0xc3 is not one of [A-Za-z0-9._:@/-]");
  b.set_stream_id(std::string("a\0b", 3));
  ExpectError(b, "stream_id", "stream_id[1]: byte 0x00 is not one of [A-Za-z0-9._:@/-]");
}

TEST(ValidateBatchTest, DoneAndTruncatedTogether) {
  v1::TransitionBatch b = Step(4);
  for (int i = 0; i < 4; ++i) b.add_truncated(i >= 2);
  b.set_done(1, true);  // done alone is fine
  EXPECT_FALSE(ValidateBatch(b, Spec(), Server()).has_value());
  b.set_done(3, true);
  ExpectError(b, "done", "done[3] and truncated[3] are both true (an episode ends either terminal or cut)");
}

TEST(ValidateBatchTest, FieldNamesCoverEveryError) {
  const auto& names = BatchFieldNames();
  for (const char* field : {"kind", "stream_id", "count", "obs", "next_obs", "actions", "rewards", "discounts",
                            "done", "truncated", "env_ids", "policy_version", "queued_bytes", "message"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), field), names.end()) << field;
  }
}

TEST(ValidateBatchTest, CountZeroAndTooLarge) {
  v1::TransitionBatch empty;
  empty.set_kind(v1::TransitionBatch::KIND_NSTEP);
  ExpectError(empty, "count", "count: must be > 0");
  ExpectError(NStep(101), "count", "count: 101 exceeds server.max_batch_transitions = 100", v1::Error::TOO_LARGE);
}

TEST(ValidateBatchTest, ObsLength) {
  v1::TransitionBatch b = NStep(4);
  b.mutable_obs()->RemoveLast();
  ExpectError(b, "obs", "obs: 7 values, expected count x obs_dim = 4 x 2 = 8");
  v1::TransitionBatch c = NStep(4);
  c.add_next_obs(1.0f);
  ExpectError(c, "next_obs", "next_obs: 9 values, expected count x obs_dim = 4 x 2 = 8");
}

TEST(ValidateBatchTest, ActionsLengthWithWrongBranchCount) {
  v1::TransitionBatch b = NStep(4);
  b.clear_actions();
  for (int i = 0; i < 4; ++i) b.add_actions(0);  // one branch instead of two
  ExpectError(b, "actions", "actions: 4 values, expected count x branches = 4 x 2 = 8");
}

TEST(ValidateBatchTest, ActionOutOfRangeNamesIndexAndBranch) {
  v1::TransitionBatch b = NStep(8);
  b.set_actions(13, 7);
  ExpectError(b, "actions", "actions[13]: 7 out of range [0, 5) for branch 1");
  v1::TransitionBatch c = NStep(8);
  c.set_actions(4, 3);
  ExpectError(c, "actions", "actions[4]: 3 out of range [0, 3) for branch 0");
  v1::TransitionBatch d = NStep(8);
  d.set_actions(0, -1);
  ExpectError(d, "actions", "actions[0]: -1 out of range [0, 3) for branch 0");
}

TEST(ValidateBatchTest, RewardsLengthAndFinite) {
  v1::TransitionBatch b = NStep(4);
  b.add_rewards(0);
  ExpectError(b, "rewards", "rewards: 5 values, expected count = 4");
  v1::TransitionBatch c = NStep(4);
  c.set_rewards(2, kNaN);
  ExpectError(c, "rewards", "rewards[2]: nan is not finite");
  v1::TransitionBatch d = NStep(4);
  d.set_rewards(3, -kInf);
  ExpectError(d, "rewards", "rewards[3]: -inf is not finite");
}

TEST(ValidateBatchTest, ObservationsFinite) {
  v1::TransitionBatch b = NStep(4);
  b.set_obs(5, kInf);
  ExpectError(b, "obs", "obs[5]: inf is not finite");
  v1::TransitionBatch c = NStep(4);
  c.set_next_obs(7, kNaN);
  ExpectError(c, "next_obs", "next_obs[7]: nan is not finite");
}

TEST(ValidateBatchTest, Discounts) {
  v1::TransitionBatch b = NStep(4);
  b.mutable_discounts()->RemoveLast();
  ExpectError(b, "discounts", "discounts: 3 values, expected count = 4");
  v1::TransitionBatch c = NStep(4);
  c.set_discounts(1, 1.5f);
  ExpectError(c, "discounts", "discounts[1]: 1.5 not in [0, 1]");
  v1::TransitionBatch d = NStep(4);
  d.set_discounts(2, -0.25f);
  ExpectError(d, "discounts", "discounts[2]: -0.25 not in [0, 1]");
  v1::TransitionBatch e = NStep(4);
  e.set_discounts(3, kNaN);
  ExpectError(e, "discounts", "discounts[3]: nan not in [0, 1]");
}

TEST(ValidateBatchTest, NStepRejectsStepColumns) {
  v1::TransitionBatch b = NStep(2);
  b.add_done(true);
  b.add_done(false);
  ExpectError(b, "done", "done: only allowed with KIND_STEP");
  v1::TransitionBatch c = NStep(2);
  c.add_truncated(true);
  ExpectError(c, "truncated", "truncated: only allowed with KIND_STEP");
  v1::TransitionBatch d = NStep(2);
  d.add_env_ids(1);
  ExpectError(d, "env_ids", "env_ids: only allowed with KIND_STEP");
}

TEST(ValidateBatchTest, StepColumns) {
  v1::TransitionBatch b = Step(3);
  b.add_discounts(1.0f);
  ExpectError(b, "discounts", "discounts: must be empty for KIND_STEP (the daemon computes them)");
  v1::TransitionBatch c = Step(3);
  c.mutable_done()->RemoveLast();
  ExpectError(c, "done", "done: 2 values, expected count = 3");
  v1::TransitionBatch d = Step(3);
  d.add_truncated(false);
  ExpectError(d, "truncated", "truncated: 1 values, expected count or 0 = 3");
  v1::TransitionBatch e = Step(3);
  for (int i = 0; i < 4; ++i) e.add_env_ids(i);
  ExpectError(e, "env_ids", "env_ids: 4 values, expected count or 0 = 3");
}

TEST(ValidateBatchTest, NegativePolicyVersion) {
  v1::TransitionBatch b = NStep(2);
  b.set_policy_version(-3);
  ExpectError(b, "policy_version", "policy_version: -3 is negative");
}

// The wire bytes of `b` with a stream_id field (13, length-delimited) of
// raw `id` appended: protobuf would log when serializing invalid UTF-8.
std::string WithRawStreamId(const v1::TransitionBatch& b, const std::string& id) {
  std::string wire = b.SerializeAsString();
  wire.push_back(static_cast<char>((13 << 3) | 2));
  uint64_t length = id.size();
  do {
    wire.push_back(static_cast<char>((length & 0x7f) | (length > 0x7f ? 0x80 : 0)));
    length >>= 7;
  } while (length != 0);
  return wire + id;
}

TEST(DecodeBatchTest, ParsesAValidBatch) {
  v1::TransitionBatch b = NStep(3);
  b.set_sequence(9);
  b.set_stream_id("actor-1/env.2@host:7_x");
  v1::TransitionBatch out;
  out.set_count(77);  // cleared first
  const DecodedBatch d = DecodeBatch(b.SerializeAsString(), Server(), &out);
  EXPECT_EQ(d.result, DecodedBatch::kParsed);
  EXPECT_EQ(out.SerializeAsString(), b.SerializeAsString());
  EXPECT_FALSE(ValidateBatch(out, Spec(), Server()).has_value());
}

TEST(DecodeBatchTest, LongStreamIdIsRejectedFromItsLengthPrefix) {
  v1::TransitionBatch b = NStep(2);
  b.set_sequence(5);
  v1::TransitionBatch out;
  const std::string wire = WithRawStreamId(b, std::string(4 << 20, 'a'));
  const DecodedBatch d = DecodeBatch(wire, Server(), &out);
  ASSERT_EQ(d.result, DecodedBatch::kRejected);
  EXPECT_EQ(d.error.field, "stream_id");
  EXPECT_EQ(d.error.code, v1::Error::TOO_LARGE);
  EXPECT_EQ(d.error.message, "stream_id: 4194304 bytes, at most server.max_stream_id_bytes = 128");
  EXPECT_EQ(out.sequence(), 5u);  // for the ack
  EXPECT_EQ(out.count(), 0u);     // nothing else was parsed
  EXPECT_TRUE(out.stream_id().empty());
  // The limit is the config's.
  v1::ServerConfig small = Server();
  small.set_max_stream_id_bytes(4);
  EXPECT_EQ(DecodeBatch(WithRawStreamId(b, "abcd"), small, &out).result, DecodedBatch::kParsed);
  const DecodedBatch e = DecodeBatch(WithRawStreamId(b, "abcde"), small, &out);
  ASSERT_EQ(e.result, DecodedBatch::kRejected);
  EXPECT_EQ(e.error.message, "stream_id: 5 bytes, at most server.max_stream_id_bytes = 4");
}

TEST(DecodeBatchTest, InvalidUtf8StreamIdIsRejectedBeforeProtobufSeesIt) {
  v1::TransitionBatch b = NStep(2);
  v1::TransitionBatch out;
  ::testing::internal::CaptureStderr();
  const DecodedBatch d = DecodeBatch(WithRawStreamId(b, "ab\xff\xfe"), Server(), &out);
  const DecodedBatch e = DecodeBatch(WithRawStreamId(b, "a\xc3\xa9"), Server(), &out);  // valid UTF-8, not ASCII
  const std::string logged = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(d.result, DecodedBatch::kRejected);
  EXPECT_EQ(d.error.field, "stream_id");
  EXPECT_EQ(d.error.message, "stream_id[2]: byte 0xff is not one of [A-Za-z0-9._:@/-]");
  ASSERT_EQ(e.result, DecodedBatch::kRejected);
  EXPECT_EQ(e.error.message, "stream_id[1]: byte 0xc3 is not one of [A-Za-z0-9._:@/-]");
  EXPECT_EQ(logged, "");
}

TEST(DecodeBatchTest, EveryStreamIdOccurrenceIsChecked) {
  v1::TransitionBatch b = NStep(2);
  b.set_stream_id("good");
  // A later occurrence wins in protobuf; it is checked as well.
  const DecodedBatch d = DecodeBatch(WithRawStreamId(b, "bad id"), Server(), &b);
  ASSERT_EQ(d.result, DecodedBatch::kRejected);
  EXPECT_EQ(d.error.message, "stream_id[3]: byte 0x20 is not one of [A-Za-z0-9._:@/-]");
}

TEST(DecodeBatchTest, MalformedBytesAreUnparsable) {
  v1::TransitionBatch out;
  const std::string wire = NStep(2).SerializeAsString();
  const DecodedBatch truncated = DecodeBatch(absl::string_view(wire).substr(0, wire.size() - 3), Server(), &out);
  EXPECT_EQ(truncated.result, DecodedBatch::kUnparsable);
  EXPECT_EQ(truncated.error.field, "message");
  EXPECT_FALSE(truncated.error.message.empty());
  EXPECT_EQ(DecodeBatch(std::string("\x00\x01", 2), Server(), &out).result, DecodedBatch::kUnparsable);
  EXPECT_EQ(DecodeBatch(std::string("\x6a\x05" "ab", 4), Server(), &out).result, DecodedBatch::kUnparsable);
  // A stream_id field of the wrong wire type is an unknown field, not a string.
  EXPECT_EQ(DecodeBatch(std::string("\x68\x05", 2), Server(), &out).result, DecodedBatch::kParsed);
  EXPECT_EQ(DecodeBatch("", Server(), &out).result, DecodedBatch::kParsed);
}

TEST(DecodeBatchTest, ByteBufferOfManySlicesDecodesLikeTheFlatBytes) {
  v1::TransitionBatch b = NStep(50);
  b.set_sequence(3);
  b.set_stream_id("actor-9");
  const std::string wire = b.SerializeAsString();
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < wire.size(); at += 7) slices.emplace_back(wire.substr(at, 7));
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  v1::TransitionBatch out;
  EXPECT_EQ(DecodeBatch(&buffer, Server(), &out).result, DecodedBatch::kParsed);
  EXPECT_EQ(out.SerializeAsString(), wire);
  grpc::Slice bad_slice(WithRawStreamId(b, std::string(200, 'x')));
  grpc::ByteBuffer bad(&bad_slice, 1);
  const DecodedBatch d = DecodeBatch(&bad, Server(), &out);
  EXPECT_EQ(d.result, DecodedBatch::kRejected);
  EXPECT_EQ(out.sequence(), 3u);
}

TEST(FirstNonFiniteTest, FindsTheFirstBadValue) {
  const float x[] = {0, 1, -2, kNaN, kInf};
  EXPECT_EQ(FirstNonFinite(x, 3), -1);
  EXPECT_EQ(FirstNonFinite(x, 5), 3);
  EXPECT_EQ(FirstNonFinite(x + 4, 1), 0);
  EXPECT_EQ(FirstNonFinite(x, 0), -1);
}

TEST(ValidateBatchTest, ErrorToProto) {
  v1::TransitionBatch b = NStep(8);
  b.set_actions(13, 7);
  const v1::Error e = ValidateBatch(b, Spec(), Server())->ToProto();
  EXPECT_EQ(e.code(), v1::Error::INVALID_FIELD);
  EXPECT_EQ(e.field(), "actions");
  EXPECT_EQ(e.message(), "actions[13]: 7 out of range [0, 5) for branch 1");
}

}  // namespace
}  // namespace qstream
