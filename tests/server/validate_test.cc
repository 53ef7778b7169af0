#include "server/validate.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"
#include "proto/episode_limits.h"
#include "proto/tensor.h"
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
  std::vector<float> obs, next_obs, rewards(n, 1.0f), discounts(n, 0.9f);
  std::vector<int32_t> actions;
  for (int i = 0; i < n * 2; ++i) {
    obs.push_back(0.5f * i);
    next_obs.push_back(-0.5f * i);
  }
  for (int i = 0; i < n; ++i) {
    actions.push_back(i % 3);
    actions.push_back(i % 5);
  }
  v1::TransitionBatch b;
  b.set_kind(v1::TransitionBatch::KIND_NSTEP);
  b.set_count(n);
  wire::SetTensor(b.mutable_obs(), obs, {n, 2});
  wire::SetTensor(b.mutable_next_obs(), next_obs, {n, 2});
  wire::SetTensor(b.mutable_actions(), actions, {n, 2});
  wire::SetTensor(b.mutable_rewards(), rewards, {n});
  wire::SetTensor(b.mutable_discounts(), discounts, {n});
  return b;
}

v1::TransitionBatch Step(int n) {
  v1::TransitionBatch b = NStep(n);
  b.set_kind(v1::TransitionBatch::KIND_STEP);
  b.clear_discounts();
  wire::SetBoolTensor(b.mutable_done(), std::vector<bool>(n, false));
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
  wire::SetBoolTensor(step.mutable_truncated(), {false, false, true});
  wire::SetTensor(step.mutable_env_ids(), std::vector<uint32_t>{0, 7, 14}, {3});
  EXPECT_FALSE(ValidateBatch(step, Spec(), Server()).has_value());
  v1::TransitionBatch edges = NStep(2);
  wire::SetElement(edges.mutable_discounts(), 0, 0.0f);
  wire::SetElement(edges.mutable_discounts(), 1, 1.0f);
  wire::SetElement(edges.mutable_actions(), 2, int32_t{2});
  wire::SetElement(edges.mutable_actions(), 3, int32_t{4});
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
  wire::SetBoolTensor(b.mutable_truncated(), {false, false, true, true});
  wire::SetElement(b.mutable_done(), 1, uint8_t{1});  // done alone is fine
  EXPECT_FALSE(ValidateBatch(b, Spec(), Server()).has_value());
  wire::SetElement(b.mutable_done(), 3, uint8_t{1});
  ExpectError(b, "done", "done[3] and truncated[3] are both true (an episode ends either terminal or cut)");
}

TEST(ValidateBatchTest, FieldNamesCoverEveryError) {
  const auto& names = BatchFieldNames();
  for (const char* field : {"kind", "stream_id", "count", "obs", "next_obs", "actions", "rewards",
                            "discounts", "done", "truncated", "env_ids", "env", "episodes", "policy_version",
                            "queued_bytes", "message", "final_obs"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), field), names.end()) << field;
  }
}

TEST(ValidateBatchTest, CountZeroAndTooLarge) {
  v1::TransitionBatch empty;
  empty.set_kind(v1::TransitionBatch::KIND_NSTEP);
  ExpectError(empty, "count", "count: must be > 0 (0 only in a batch that carries episodes and no column)");
  ExpectError(NStep(101), "count", "count: 101 exceeds server.max_batch_transitions = 100",
              v1::Error::TOO_LARGE);
}

TEST(ValidateBatchTest, TruncatedBytes) {
  v1::TransitionBatch b = NStep(4);
  b.mutable_obs()->mutable_data()->resize(31);
  ExpectError(b, "obs", "obs: data holds 31 bytes, shape [4, 2] of DTYPE_FLOAT32 needs 32 (truncated)");
  v1::TransitionBatch c = NStep(4);
  c.mutable_next_obs()->mutable_data()->append(4, '\0');
  ExpectError(c, "next_obs", "next_obs: data holds 36 bytes, shape [4, 2] of DTYPE_FLOAT32 needs 32");
  v1::TransitionBatch d = Step(4);
  d.mutable_done()->mutable_data()->clear();
  ExpectError(d, "done", "done: data holds 0 bytes, shape [4] of DTYPE_BOOL needs 4 (truncated)");
}

TEST(ValidateBatchTest, ShapeMismatchNamesTheExpectedShape) {
  v1::TransitionBatch b = NStep(4);
  b.mutable_obs()->set_shape(1, 1);
  ExpectError(b, "obs", "obs: shape [4, 1], expected [count, obs_dim] = [4, 2]");
  b.mutable_obs()->clear_shape();
  b.mutable_obs()->add_shape(8);
  ExpectError(b, "obs", "obs: shape [8], expected [count, obs_dim] = [4, 2]");
  v1::TransitionBatch c = NStep(4);
  c.mutable_actions()->set_shape(0, 5);
  ExpectError(c, "actions", "actions: shape [5, 2], expected [count, branches] = [4, 2]");
  // One branch's worth of actions where the network has two.
  wire::SetTensor(c.mutable_actions(), std::vector<int32_t>(4, 0), {4, 1});
  ExpectError(c, "actions", "actions: shape [4, 1], expected [count, branches] = [4, 2]");
  v1::TransitionBatch d = NStep(4);
  d.mutable_rewards()->add_shape(1);
  ExpectError(d, "rewards", "rewards: shape [4, 1], expected [count] = [4]");
  v1::TransitionBatch e = NStep(3);
  e.set_count(4);  // every column holds 3 rows
  ExpectError(e, "obs", "obs: shape [3, 2], expected [count, obs_dim] = [4, 2]");
}

TEST(ValidateBatchTest, WrongDTypeIsNamed) {
  v1::TransitionBatch b = NStep(4);
  b.mutable_actions()->set_dtype(v1::Tensor::DTYPE_UINT32);
  ExpectError(b, "actions", "actions: dtype DTYPE_UINT32, expected DTYPE_INT32");
  v1::TransitionBatch c = NStep(4);
  c.mutable_obs()->set_dtype(v1::Tensor::DTYPE_UNSPECIFIED);
  ExpectError(c, "obs", "obs: dtype DTYPE_UNSPECIFIED, expected DTYPE_FLOAT32");
  v1::TransitionBatch d = NStep(4);
  d.mutable_rewards()->set_dtype(static_cast<v1::Tensor::DType>(42));
  ExpectError(d, "rewards", "rewards: dtype an unknown dtype, expected DTYPE_FLOAT32");
  v1::TransitionBatch e = Step(4);
  wire::SetTensor(e.mutable_env_ids(), std::vector<int32_t>{0, 1, 2, 3}, {4});
  ExpectError(e, "env_ids", "env_ids: dtype DTYPE_INT32, expected DTYPE_UINT32");
}

TEST(ValidateBatchTest, MissingRequiredColumnsAreNamed) {
  v1::TransitionBatch b = NStep(4);
  b.clear_next_obs();
  ExpectError(b, "next_obs", "next_obs: missing; a DTYPE_FLOAT32 tensor [count, obs_dim] is required");
  v1::TransitionBatch c = NStep(4);
  c.clear_discounts();
  ExpectError(c, "discounts", "discounts: missing; a DTYPE_FLOAT32 tensor [count] is required");
  v1::TransitionBatch d = Step(4);
  d.clear_done();
  ExpectError(d, "done", "done: missing; a DTYPE_BOOL tensor [count] is required");
}

TEST(ValidateBatchTest, FlagsMustBeZeroOrOne) {
  v1::TransitionBatch b = Step(4);
  wire::SetElement(b.mutable_done(), 2, uint8_t{2});
  ExpectError(b, "done", "done[2]: byte 2 is not a bool (0 or 1)");
  v1::TransitionBatch c = Step(4);
  wire::SetBoolTensor(c.mutable_truncated(), std::vector<bool>(4, false));
  wire::SetElement(c.mutable_truncated(), 3, uint8_t{255});
  ExpectError(c, "truncated", "truncated[3]: byte 255 is not a bool (0 or 1)");
}

// Fresh random columns come out of ValidateBatch bit for bit.
TEST(ValidateBatchTest, ColumnsAreTheWireBytes) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (const bool step : {false, true}) {
    const int n = 1 + static_cast<int>(rng() % 100);
    const size_t n2 = static_cast<size_t>(n) * 2;
    std::vector<float> obs(n2), next_obs(n2), rewards(n), discounts(n);
    std::vector<int32_t> actions(n2);
    std::vector<uint32_t> env_ids(n);
    std::vector<bool> done(n), truncated(n);
    for (float& x : obs) x = normal(rng);
    for (float& x : next_obs) x = normal(rng);
    for (float& x : rewards) x = normal(rng);
    for (float& x : discounts) x = static_cast<float>(rng() % 1001) / 1000.0f;
    for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
      actions[2 * i] = static_cast<int32_t>(rng() % 3);
      actions[2 * i + 1] = static_cast<int32_t>(rng() % 5);
      env_ids[i] = rng();
      done[i] = rng() % 5 == 0;
      truncated[i] = !done[i] && rng() % 7 == 0;
    }
    v1::TransitionBatch b;
    b.set_kind(step ? v1::TransitionBatch::KIND_STEP : v1::TransitionBatch::KIND_NSTEP);
    b.set_count(n);
    b.set_sequence(rng());
    b.set_policy_version(rng() % 1000);
    b.set_stream_id("s-1");
    wire::SetTensor(b.mutable_obs(), obs, {n, 2});
    wire::SetTensor(b.mutable_next_obs(), next_obs, {n, 2});
    wire::SetTensor(b.mutable_actions(), actions, {n, 2});
    wire::SetTensor(b.mutable_rewards(), rewards, {n});
    if (step) {
      wire::SetBoolTensor(b.mutable_done(), done);
      wire::SetBoolTensor(b.mutable_truncated(), truncated);
      wire::SetTensor(b.mutable_env_ids(), env_ids, {n});
    } else {
      wire::SetTensor(b.mutable_discounts(), discounts, {n});
    }
    v1::TransitionBatch parsed;
    ASSERT_EQ(DecodeBatch(b.SerializeAsString(), Server(), &parsed).result, DecodedBatch::kParsed);
    IncomingBatch in;
    ASSERT_FALSE(ValidateBatch(parsed, Spec(), Server(), &in).has_value());
    EXPECT_EQ(in.count(), n);
    EXPECT_EQ(in.sequence, b.sequence());
    EXPECT_EQ(in.policy_version, b.policy_version());
    EXPECT_EQ(in.stream_id, "s-1");
    EXPECT_EQ(in.kind, b.kind());
    EXPECT_EQ(in.columns.obs, obs);
    EXPECT_EQ(in.columns.next_obs, next_obs);
    EXPECT_EQ(in.columns.actions, actions);
    EXPECT_EQ(in.columns.rewards, rewards);
    if (step) {
      EXPECT_TRUE(in.columns.discounts.empty());
      EXPECT_EQ(in.done, std::vector<uint8_t>(done.begin(), done.end()));
      EXPECT_EQ(in.truncated, std::vector<uint8_t>(truncated.begin(), truncated.end()));
      EXPECT_EQ(in.env_ids, env_ids);
    } else {
      EXPECT_EQ(in.columns.discounts, discounts);
      EXPECT_TRUE(in.done.empty() && in.truncated.empty() && in.env_ids.empty());
    }
  }
}

TEST(ValidateBatchTest, ActionOutOfRangeNamesIndexAndBranch) {
  v1::TransitionBatch b = NStep(8);
  wire::SetElement(b.mutable_actions(), 13, int32_t{7});
  ExpectError(b, "actions", "actions[13]: 7 out of range [0, 5) for branch 1");
  v1::TransitionBatch c = NStep(8);
  wire::SetElement(c.mutable_actions(), 4, int32_t{3});
  ExpectError(c, "actions", "actions[4]: 3 out of range [0, 3) for branch 0");
  v1::TransitionBatch d = NStep(8);
  wire::SetElement(d.mutable_actions(), 0, int32_t{-1});
  ExpectError(d, "actions", "actions[0]: -1 out of range [0, 3) for branch 0");
}

TEST(ValidateBatchTest, RewardsLengthAndFinite) {
  v1::TransitionBatch b = NStep(4);
  wire::SetTensor(b.mutable_rewards(), std::vector<float>(5, 0.0f), {5});
  ExpectError(b, "rewards", "rewards: shape [5], expected [count] = [4]");
  v1::TransitionBatch c = NStep(4);
  wire::SetElement(c.mutable_rewards(), 2, kNaN);
  ExpectError(c, "rewards", "rewards[2]: nan is not finite");
  v1::TransitionBatch d = NStep(4);
  wire::SetElement(d.mutable_rewards(), 3, -kInf);
  ExpectError(d, "rewards", "rewards[3]: -inf is not finite");
}

TEST(ValidateBatchTest, ObservationsFinite) {
  v1::TransitionBatch b = NStep(4);
  wire::SetElement(b.mutable_obs(), 5, kInf);
  ExpectError(b, "obs", "obs[5]: inf is not finite");
  v1::TransitionBatch c = NStep(4);
  wire::SetElement(c.mutable_next_obs(), 7, kNaN);
  ExpectError(c, "next_obs", "next_obs[7]: nan is not finite");
}

TEST(ValidateBatchTest, Discounts) {
  v1::TransitionBatch b = NStep(4);
  b.mutable_discounts()->mutable_data()->resize(12);
  ExpectError(b, "discounts",
              "discounts: data holds 12 bytes, shape [4] of DTYPE_FLOAT32 needs 16 (truncated)");
  v1::TransitionBatch c = NStep(4);
  wire::SetElement(c.mutable_discounts(), 1, 1.5f);
  ExpectError(c, "discounts", "discounts[1]: 1.5 not in [0, 1]");
  v1::TransitionBatch d = NStep(4);
  wire::SetElement(d.mutable_discounts(), 2, -0.25f);
  ExpectError(d, "discounts", "discounts[2]: -0.25 not in [0, 1]");
  v1::TransitionBatch e = NStep(4);
  wire::SetElement(e.mutable_discounts(), 3, kNaN);
  ExpectError(e, "discounts", "discounts[3]: nan not in [0, 1]");
}

TEST(ValidateBatchTest, NStepRejectsStepColumns) {
  v1::TransitionBatch b = NStep(2);
  wire::SetBoolTensor(b.mutable_done(), {true, false});
  ExpectError(b, "done", "done: only allowed with KIND_STEP");
  v1::TransitionBatch c = NStep(2);
  wire::SetBoolTensor(c.mutable_truncated(), {true, false});
  ExpectError(c, "truncated", "truncated: only allowed with KIND_STEP");
  v1::TransitionBatch d = NStep(2);
  wire::SetTensor(d.mutable_env_ids(), std::vector<uint32_t>{1, 1}, {2});
  ExpectError(d, "env_ids", "env_ids: only allowed with KIND_STEP");
}

TEST(ValidateBatchTest, StepColumns) {
  v1::TransitionBatch b = Step(3);
  wire::SetTensor(b.mutable_discounts(), std::vector<float>(3, 1.0f), {3});
  ExpectError(b, "discounts", "discounts: must be unset for KIND_STEP (the daemon computes them)");
  v1::TransitionBatch c = Step(3);
  wire::SetBoolTensor(c.mutable_done(), {false, false});
  ExpectError(c, "done", "done: shape [2], expected [count] = [3]");
  v1::TransitionBatch d = Step(3);
  wire::SetBoolTensor(d.mutable_truncated(), {false});
  ExpectError(d, "truncated", "truncated: shape [1], expected [count] = [3]");
  v1::TransitionBatch e = Step(3);
  wire::SetTensor(e.mutable_env_ids(), std::vector<uint32_t>{0, 1, 2, 3}, {4});
  ExpectError(e, "env_ids", "env_ids: shape [4], expected [count] = [3]");
}

TEST(ValidateBatchTest, NegativePolicyVersion) {
  v1::TransitionBatch b = NStep(2);
  b.set_policy_version(-3);
  ExpectError(b, "policy_version", "policy_version: -3 is negative");
}

v1::EpisodeReport Episode(double episode_return, uint32_t length, int64_t policy_version = 0) {
  v1::EpisodeReport r;
  r.set_episode_return(episode_return);
  r.set_length(length);
  r.set_policy_version(policy_version);
  return r;
}

TEST(ValidateBatchTest, EpisodeReportsAndEnvAreTakenOff) {
  v1::TransitionBatch b = Step(3);
  b.set_env("CartPole-v1");
  *b.add_episodes() = Episode(21.5, 22, 4);
  *b.add_episodes() = Episode(-wire::kMaxAbsEpisodeReturn, 1, 0);
  *b.add_episodes() = Episode(wire::kMaxAbsEpisodeReturn, wire::kMaxEpisodeLength, 9);
  IncomingBatch in;
  ASSERT_FALSE(ValidateBatch(b, Spec(), Server(), &in).has_value());
  EXPECT_EQ(in.count(), 3);
  EXPECT_EQ(in.episodes.env, "CartPole-v1");
  ASSERT_EQ(in.episodes.reports.size(), 3u);
  EXPECT_EQ(in.episodes.reports[0].episode_return, 21.5);
  EXPECT_EQ(in.episodes.reports[0].length, 22);
  EXPECT_EQ(in.episodes.reports[0].policy_version, 4);
  EXPECT_EQ(in.episodes.reports[2].length, wire::kMaxEpisodeLength);
  // The largest env label and the most reports per batch.
  b.set_env("Acrobot_v1.a:b/c-" + std::string(wire::kMaxEnvBytes - 17, 'x'));
  while (b.episodes_size() < wire::kMaxEpisodesPerBatch) *b.add_episodes() = Episode(1, 1);
  ASSERT_FALSE(ValidateBatch(b, Spec(), Server(), &in).has_value());
  EXPECT_EQ(in.episodes.reports.size(), static_cast<size_t>(wire::kMaxEpisodesPerBatch));
  // None at all: an empty list, env as named.
  v1::TransitionBatch plain = NStep(2);
  ASSERT_FALSE(ValidateBatch(plain, Spec(), Server(), &in).has_value());
  EXPECT_TRUE(in.episodes.empty());
  EXPECT_EQ(in.episodes.env, "");
}

TEST(ValidateBatchTest, EpisodeReturnMustBeFiniteAndBounded) {
  v1::TransitionBatch b = NStep(2);
  *b.add_episodes() = Episode(1, 1);
  *b.add_episodes() = Episode(std::numeric_limits<double>::quiet_NaN(), 5);
  ExpectError(b, "episodes", "episodes[1].episode_return: nan is not finite");
  b.mutable_episodes(1)->set_episode_return(-std::numeric_limits<double>::infinity());
  ExpectError(b, "episodes", "episodes[1].episode_return: -inf is not finite");
  b.mutable_episodes(1)->set_episode_return(2e12);
  ExpectError(b, "episodes", "episodes[1].episode_return: 2e+12 is outside [-1e12, 1e12]");
}

TEST(ValidateBatchTest, EpisodeLengthRange) {
  v1::TransitionBatch b = Step(2);
  *b.add_episodes() = Episode(1, 1);
  *b.add_episodes() = Episode(1, 1);
  *b.add_episodes() = Episode(1, 0);
  ExpectError(b, "episodes", "episodes[2].length: 0 is not in [1, 1000000000]");
  b.mutable_episodes(2)->set_length(1'000'000'001);
  ExpectError(b, "episodes", "episodes[2].length: 1000000001 is not in [1, 1000000000]");
}

TEST(ValidateBatchTest, EpisodePolicyVersionNotNegative) {
  v1::TransitionBatch b = NStep(2);
  *b.add_episodes() = Episode(1, 1, -1);
  ExpectError(b, "episodes", "episodes[0].policy_version: -1 is negative");
}

TEST(ValidateBatchTest, TooManyEpisodes) {
  v1::TransitionBatch b = NStep(2);
  for (int i = 0; i <= wire::kMaxEpisodesPerBatch; ++i) *b.add_episodes() = Episode(1, 1);
  ExpectError(b, "episodes", "episodes: 4097 reports, at most 4096 per batch", v1::Error::TOO_LARGE);
}

TEST(ValidateBatchTest, EnvLengthAndBytes) {
  v1::TransitionBatch b = NStep(2);
  b.set_env(std::string(wire::kMaxEnvBytes + 1, 'a'));
  ExpectError(b, "env", "env: 65 bytes, at most 64", v1::Error::TOO_LARGE);
  b.set_env("Cart Pole");
  ExpectError(b, "env", "env[4]: byte 0x20 is not one of [A-Za-z0-9_.:/-]");
  b.set_env("env@host");  // '@' is a stream_id byte, not an env label's
  ExpectError(b, "env", "env[3]: byte 0x40 is not one of [A-Za-z0-9_.:/-]");
  b.set_env("a\xc3\xa9");
  ExpectError(b, "env", "env[1]: byte 0xc3 is not one of [A-Za-z0-9_.:/-]");
}

TEST(ValidateBatchTest, CountZeroCarriesEpisodeReportsAlone) {
  for (auto kind : {v1::TransitionBatch::KIND_STEP, v1::TransitionBatch::KIND_NSTEP}) {
    v1::TransitionBatch b;
    b.set_kind(kind);
    b.set_sequence(4);
    b.set_stream_id("actor-1");
    b.set_env("MountainCar-v0");
    *b.add_episodes() = Episode(-200, 200, 3);
    IncomingBatch in;
    ASSERT_FALSE(ValidateBatch(b, Spec(), Server(), &in).has_value());
    EXPECT_EQ(in.count(), 0);
    EXPECT_EQ(in.sequence, 4u);
    EXPECT_EQ(in.stream_id, "actor-1");
    EXPECT_TRUE(in.columns.obs.empty());
    EXPECT_TRUE(in.done.empty());
    ASSERT_EQ(in.episodes.reports.size(), 1u);
    EXPECT_EQ(in.episodes.reports[0].episode_return, -200);
    EXPECT_EQ(in.episodes.env, "MountainCar-v0");
  }
  // A column in a batch of count 0, even an empty one, is an error naming it.
  v1::TransitionBatch b;
  b.set_kind(v1::TransitionBatch::KIND_STEP);
  *b.add_episodes() = Episode(1, 1);
  wire::SetTensor(b.mutable_rewards(), std::vector<float>{}, {0});
  ExpectError(b, "rewards", "rewards: must be unset in a batch of count 0 (episode reports only)");
  b.clear_rewards();
  wire::SetBoolTensor(b.mutable_done(), {});
  ExpectError(b, "done", "done: must be unset in a batch of count 0 (episode reports only)");
  // Its reports are validated like any.
  b.clear_done();
  b.mutable_episodes(0)->set_length(0);
  ExpectError(b, "episodes", "episodes[0].length: 0 is not in [1, 1000000000]");
}

// The step-stream form: KIND_STEP without next_obs, final_obs [ends, obs_dim]
// for the rows with done or truncated, in row order.
v1::TransitionBatch StepStream(int n, const std::vector<bool>& done, const std::vector<bool>& truncated) {
  v1::TransitionBatch b = Step(n);
  b.clear_next_obs();
  wire::SetBoolTensor(b.mutable_done(), done);
  wire::SetBoolTensor(b.mutable_truncated(), truncated);
  return b;
}

TEST(ValidateBatchTest, StepStreamFormTakesFinalObsOfTheRowsThatEnd) {
  v1::TransitionBatch b = StepStream(4, {false, true, false, false}, {false, false, false, true});
  wire::SetTensor(b.mutable_final_obs(), std::vector<float>{1, 2, 3, 4}, {2, 2});
  IncomingBatch in;
  ASSERT_FALSE(ValidateBatch(b, Spec(), Server(), &in).has_value());
  EXPECT_TRUE(in.columns.next_obs.empty());
  EXPECT_EQ(in.final_obs, (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(in.columns.obs.size(), 8u);
  // No row ends: final_obs may be unset, or empty of shape [0, obs_dim].
  v1::TransitionBatch c = StepStream(3, {false, false, false}, {false, false, false});
  ASSERT_FALSE(ValidateBatch(c, Spec(), Server(), &in).has_value());
  EXPECT_TRUE(in.final_obs.empty());
  wire::SetTensor(c.mutable_final_obs(), std::vector<float>{}, {0, 2});
  EXPECT_FALSE(ValidateBatch(c, Spec(), Server()).has_value());
  // A full-form batch after a step-stream one into the same IncomingBatch leaves no final_obs behind.
  ASSERT_FALSE(ValidateBatch(b, Spec(), Server(), &in).has_value());
  ASSERT_FALSE(ValidateBatch(Step(2), Spec(), Server(), &in).has_value());
  EXPECT_TRUE(in.final_obs.empty());
  EXPECT_EQ(in.columns.next_obs.size(), 4u);
}

TEST(ValidateBatchTest, StepStreamFinalObsErrorsNameTheField) {
  const v1::TransitionBatch ends = StepStream(3, {true, false, false}, {false, false, true});
  ExpectError(ends, "final_obs", "final_obs: missing; a DTYPE_FLOAT32 tensor [ends, obs_dim] is required");
  v1::TransitionBatch rows = ends;
  wire::SetTensor(rows.mutable_final_obs(), std::vector<float>{1, 2}, {1, 2});
  ExpectError(rows, "final_obs", "final_obs: shape [1, 2], expected [ends, obs_dim] = [2, 2]");
  v1::TransitionBatch width = ends;
  wire::SetTensor(width.mutable_final_obs(), std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  ExpectError(width, "final_obs", "final_obs: shape [2, 3], expected [ends, obs_dim] = [2, 2]");
  v1::TransitionBatch dtype = ends;
  wire::SetTensor(dtype.mutable_final_obs(), std::vector<int32_t>{1, 2, 3, 4}, {2, 2});
  ExpectError(dtype, "final_obs", "final_obs: dtype DTYPE_INT32, expected DTYPE_FLOAT32");
  v1::TransitionBatch cut = ends;
  wire::SetTensor(cut.mutable_final_obs(), std::vector<float>{1, 2, 3, 4}, {2, 2});
  cut.mutable_final_obs()->mutable_data()->resize(15);
  ExpectError(cut, "final_obs",
              "final_obs: data holds 15 bytes, shape [2, 2] of DTYPE_FLOAT32 needs 16 (truncated)");
  v1::TransitionBatch nan = ends;
  wire::SetTensor(nan.mutable_final_obs(), std::vector<float>{1, 2, kInf, 4}, {2, 2});
  ExpectError(nan, "final_obs", "final_obs[2]: inf is not finite");
  // Not with next_obs (the full form), not with KIND_NSTEP, not in a batch of count 0.
  v1::TransitionBatch full = Step(2);
  wire::SetTensor(full.mutable_final_obs(), std::vector<float>{}, {0, 2});
  ExpectError(full, "final_obs",
              "final_obs: only in the step-stream form (next_obs unset); this batch has next_obs");
  v1::TransitionBatch nstep = NStep(2);
  wire::SetTensor(nstep.mutable_final_obs(), std::vector<float>{}, {0, 2});
  ExpectError(nstep, "final_obs", "final_obs: only allowed with KIND_STEP");
  v1::TransitionBatch reports;
  reports.set_kind(v1::TransitionBatch::KIND_STEP);
  *reports.add_episodes() = Episode(1, 1);
  wire::SetTensor(reports.mutable_final_obs(), std::vector<float>{}, {0, 2});
  ExpectError(reports, "final_obs", "final_obs: must be unset in a batch of count 0 (episode reports only)");
  // KIND_NSTEP still needs next_obs.
  v1::TransitionBatch no_next = NStep(2);
  no_next.clear_next_obs();
  ExpectError(no_next, "next_obs", "next_obs: missing; a DTYPE_FLOAT32 tensor [count, obs_dim] is required");
}

// The wire bytes of `b` with a string field `number` (length-delimited) of
// raw `text` appended: protobuf would log when serializing invalid UTF-8.
std::string WithRawString(const v1::TransitionBatch& b, int number, const std::string& text) {
  std::string wire = b.SerializeAsString();
  uint64_t tag = (static_cast<uint64_t>(number) << 3) | 2;
  do {
    wire.push_back(static_cast<char>((tag & 0x7f) | (tag > 0x7f ? 0x80 : 0)));
    tag >>= 7;
  } while (tag != 0);
  uint64_t length = text.size();
  do {
    wire.push_back(static_cast<char>((length & 0x7f) | (length > 0x7f ? 0x80 : 0)));
    length >>= 7;
  } while (length != 0);
  return wire + text;
}

// The same for stream_id (field 13).
std::string WithRawStreamId(const v1::TransitionBatch& b, const std::string& id) {
  return WithRawString(b, v1::TransitionBatch::kStreamIdFieldNumber, id);
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
  const DecodedBatch e =
      DecodeBatch(WithRawStreamId(b, "a\xc3\xa9"), Server(), &out);  // valid UTF-8, not ASCII
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

TEST(DecodeBatchTest, EnvIsCheckedBeforeProtobufSeesIt) {
  v1::TransitionBatch b = Step(2);
  b.set_sequence(6);
  *b.add_episodes() = Episode(3, 3);
  const int env = v1::TransitionBatch::kEnvFieldNumber;
  v1::TransitionBatch out;
  EXPECT_EQ(DecodeBatch(WithRawString(b, env, "CartPole-v1"), Server(), &out).result, DecodedBatch::kParsed);
  EXPECT_EQ(out.env(), "CartPole-v1");
  EXPECT_EQ(out.episodes_size(), 1);
  ::testing::internal::CaptureStderr();
  const DecodedBatch bad = DecodeBatch(WithRawString(b, env, "Cart\xff"), Server(), &out);
  const std::string logged = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(bad.result, DecodedBatch::kRejected);
  EXPECT_EQ(bad.error.field, "env");
  EXPECT_EQ(bad.error.message, "env[4]: byte 0xff is not one of [A-Za-z0-9_.:/-]");
  EXPECT_EQ(out.sequence(), 6u);
  EXPECT_EQ(logged, "");
  const DecodedBatch long_env = DecodeBatch(WithRawString(b, env, std::string(1 << 20, 'a')), Server(), &out);
  ASSERT_EQ(long_env.result, DecodedBatch::kRejected);
  EXPECT_EQ(long_env.error.code, v1::Error::TOO_LARGE);
  EXPECT_EQ(long_env.error.message, "env: 1048576 bytes, at most 64");
  EXPECT_EQ(out.episodes_size(), 0);  // nothing else was parsed
}

TEST(DecodeBatchTest, MalformedBytesAreUnparsable) {
  v1::TransitionBatch out;
  const std::string wire = NStep(2).SerializeAsString();
  const DecodedBatch truncated =
      DecodeBatch(absl::string_view(wire).substr(0, wire.size() - 3), Server(), &out);
  EXPECT_EQ(truncated.result, DecodedBatch::kUnparsable);
  EXPECT_EQ(truncated.error.field, "message");
  EXPECT_FALSE(truncated.error.message.empty());
  EXPECT_EQ(DecodeBatch(std::string("\x00\x01", 2), Server(), &out).result, DecodedBatch::kUnparsable);
  EXPECT_EQ(DecodeBatch(std::string("\x6a\x05"
                                    "ab",
                                    4),
                        Server(), &out)
                .result,
            DecodedBatch::kUnparsable);
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

// The blocked scan: every length around its block size, a bad value (NaN,
// +-inf, a NaN payload) at every position, in the blocks and in the tail;
// the largest finite values and denormals are fine.
TEST(FirstNonFiniteTest, EveryPositionAndLengthAroundTheBlocks) {
  uint32_t payload_bits = 0x7fc01234u;
  float payload_nan;
  std::memcpy(&payload_nan, &payload_bits, sizeof(payload_nan));
  const float bad_values[] = {kNaN, kInf, -kInf, payload_nan};
  for (int64_t n = 0; n <= 50; ++n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      x[i] = i % 3 == 0
                 ? std::numeric_limits<float>::max()
                 : (i % 3 == 1 ? -std::numeric_limits<float>::denorm_min() : 0.5f * static_cast<float>(i));
    }
    EXPECT_EQ(FirstNonFinite(x.data(), n), -1) << "n " << n;
    for (int64_t at = 0; at < n; ++at) {
      for (float bad : bad_values) {
        std::vector<float> y = x;
        y[at] = bad;
        if (at + 1 < n) y[n - 1] = kNaN;  // a later bad value does not hide the first
        ASSERT_EQ(FirstNonFinite(y.data(), n), at) << "n " << n << " at " << at;
      }
    }
  }
}

TEST(ValidateBatchTest, ErrorToProto) {
  v1::TransitionBatch b = NStep(8);
  wire::SetElement(b.mutable_actions(), 13, int32_t{7});
  const v1::Error e = ValidateBatch(b, Spec(), Server())->ToProto();
  EXPECT_EQ(e.code(), v1::Error::INVALID_FIELD);
  EXPECT_EQ(e.field(), "actions");
  EXPECT_EQ(e.message(), "actions[13]: 7 out of range [0, 5) for branch 1");
}

}  // namespace
}  // namespace qstream
