#include "server/nstep.h"

#include <optional>
#include <vector>

#include "gtest/gtest.h"
#include "server/batch_columns.h"
#include "trainer/config.h"

namespace qstream {
namespace {

// obs_dim 1, one branch of 4 actions: step t of env e has obs = 100 e + t,
// next_obs = 100 e + t + 1, action = t % 4.
NetworkSpec Spec() {
  v1::NetworkConfig net = DefaultConfig().network();
  net.set_obs_dim(1);
  net.clear_branch_actions();
  net.add_branch_actions(4);
  return *NetworkSpec::Create(net);
}

struct StepIn {
  uint32_t env = 0;
  int t = 0;
  float reward = 0;
  bool done = false;
  bool truncated = false;
};

IncomingBatch Batch(const std::vector<StepIn>& steps) {
  IncomingBatch b;
  b.kind = v1::TransitionBatch::KIND_STEP;
  b.columns.n = static_cast<int64_t>(steps.size());
  b.columns.obs_dim = 1;
  b.columns.num_branches = 1;
  for (const StepIn& s : steps) {
    b.columns.obs.push_back(100.0f * s.env + s.t);
    b.columns.next_obs.push_back(100.0f * s.env + s.t + 1);
    b.columns.actions.push_back(s.t % 4);
    b.columns.rewards.push_back(s.reward);
    b.done.push_back(s.done ? 1 : 0);
    b.truncated.push_back(s.truncated ? 1 : 0);
    b.env_ids.push_back(s.env);
  }
  return b;
}

// The checkpoint form of `windows` (by ascending env_id): equal windows give
// equal bytes.
std::string Saved(const NStepAssembler& a, const NStepWindows& windows) {
  v1::IngestSessionState s;
  a.Save(windows, s.mutable_windows());
  return s.SerializeAsString();
}

// An assembler with an ingest session's two window sets: Add advances the
// issued windows, Replay the committed ones (as the session does once the
// items are inserted); after every batch both must be equal.
class Assembler {
 public:
  Assembler(const NetworkSpec& spec, int n_step, float gamma, int64_t max_envs)
      : a_(spec, n_step, gamma, max_envs) {}
  std::optional<BatchError> Add(const IncomingBatch& batch, TransitionColumns* out) {
    auto error = a_.Add(batch, &windows_, out);
    if (!error) a_.Replay(batch, &committed_);
    EXPECT_EQ(Saved(a_, windows_), Saved(a_, committed_)) << "Replay differs from Add";
    return error;
  }
  int64_t pending() const { return NStepAssembler::Pending(windows_); }
  int64_t num_envs() const { return static_cast<int64_t>(windows_.size()); }
  const NStepAssembler& assembler() const { return a_; }
  NStepWindows& windows() { return windows_; }
  // Both sets from a checkpoint (a restore).
  absl::Status Load(const google::protobuf::RepeatedPtrField<v1::NStepWindowState>& saved) {
    if (absl::Status st = a_.Load(saved, &windows_); !st.ok()) return st;
    return a_.Load(saved, &committed_);
  }

 private:
  NStepAssembler a_;
  NStepWindows windows_;
  NStepWindows committed_;
};

struct Item {
  float obs, reward, discount, next_obs;
  int action;
};

std::vector<Item> Items(const TransitionColumns& c) {
  std::vector<Item> items;
  for (int64_t i = 0; i < c.n; ++i) {
    items.push_back({c.obs[i], c.rewards[i], c.discounts[i], c.next_obs[i], c.actions[i]});
  }
  return items;
}

void ExpectItem(const Item& item, float obs, float reward, float discount, float next_obs) {
  EXPECT_FLOAT_EQ(item.obs, obs);
  EXPECT_FLOAT_EQ(item.reward, reward);
  EXPECT_FLOAT_EQ(item.discount, discount);
  EXPECT_FLOAT_EQ(item.next_obs, next_obs);
  EXPECT_EQ(item.action, static_cast<int>(obs) % 100 % 4);
}

TEST(NStepAssemblerTest, EmitsOnceNStepsArePresent) {
  Assembler a(Spec(), /*n_step=*/3, /*gamma=*/0.5f, /*max_envs=*/16);
  TransitionColumns out = EmptyColumns(Spec());
  ASSERT_FALSE(a.Add(Batch({{0, 0, 1}, {0, 1, 2}}), &out).has_value());
  EXPECT_EQ(out.n, 0);
  EXPECT_EQ(a.pending(), 2);
  ASSERT_FALSE(a.Add(Batch({{0, 2, 3}, {0, 3, 4}, {0, 4, 5}}), &out).has_value());
  ASSERT_EQ(out.n, 3);
  const auto items = Items(out);
  // R_t = r_t + 0.5 r_{t+1} + 0.25 r_{t+2}, bootstrap 0.5^3 from s_{t+3}.
  ExpectItem(items[0], 0, 1 + 0.5f * 2 + 0.25f * 3, 0.125f, 3);
  ExpectItem(items[1], 1, 2 + 0.5f * 3 + 0.25f * 4, 0.125f, 4);
  ExpectItem(items[2], 2, 3 + 0.5f * 4 + 0.25f * 5, 0.125f, 5);
  EXPECT_EQ(a.pending(), 2);
}

TEST(NStepAssemblerTest, DoneFlushesEverythingWithZeroDiscount) {
  Assembler a(Spec(), 3, 0.5f, 16);
  TransitionColumns out = EmptyColumns(Spec());
  ASSERT_FALSE(a.Add(Batch({{0, 0, 1}, {0, 1, 2, /*done=*/true}}), &out).has_value());
  ASSERT_EQ(out.n, 2);
  const auto items = Items(out);
  ExpectItem(items[0], 0, 1 + 0.5f * 2, 0, 2);
  ExpectItem(items[1], 1, 2, 0, 2);
  EXPECT_EQ(a.pending(), 0);
  // The next episode starts with an empty window.
  ASSERT_FALSE(a.Add(Batch({{0, 10, 7}, {0, 11, 0}}), &out).has_value());
  EXPECT_EQ(out.n, 2);
  EXPECT_EQ(a.pending(), 2);
}

TEST(NStepAssemblerTest, DoneOnAFullWindow) {
  Assembler a(Spec(), 2, 0.9f, 16);
  TransitionColumns out = EmptyColumns(Spec());
  ASSERT_FALSE(a.Add(Batch({{0, 0, 1}, {0, 1, 2}, {0, 2, 4, /*done=*/true}}), &out).has_value());
  ASSERT_EQ(out.n, 3);
  const auto items = Items(out);
  ExpectItem(items[0], 0, 1 + 0.9f * 2, 0.81f, 2);
  ExpectItem(items[1], 1, 2 + 0.9f * 4, 0, 3);
  ExpectItem(items[2], 2, 4, 0, 3);
}

TEST(NStepAssemblerTest, TruncationBootstrapsFromLastNextObs) {
  Assembler a(Spec(), 3, 0.5f, 16);
  TransitionColumns out = EmptyColumns(Spec());
  ASSERT_FALSE(a.Add(Batch({{0, 0, 1}, {0, 1, 2, /*done=*/false, /*truncated=*/true}}), &out).has_value());
  ASSERT_EQ(out.n, 2);
  const auto items = Items(out);
  ExpectItem(items[0], 0, 1 + 0.5f * 2, 0.25f, 2);
  ExpectItem(items[1], 1, 2, 0.5f, 2);
  EXPECT_EQ(a.pending(), 0);
}

TEST(NStepAssemblerTest, DoneWinsOverTruncated) {
  Assembler a(Spec(), 3, 0.5f, 16);
  TransitionColumns out = EmptyColumns(Spec());
  ASSERT_FALSE(a.Add(Batch({{0, 0, 1, true, true}}), &out).has_value());
  ASSERT_EQ(out.n, 1);
  ExpectItem(Items(out)[0], 0, 1, 0, 1);
}

TEST(NStepAssemblerTest, OneStepReturnsEmitImmediately) {
  Assembler a(Spec(), 1, 0.99f, 16);
  TransitionColumns out = EmptyColumns(Spec());
  ASSERT_FALSE(a.Add(Batch({{0, 0, 3}, {0, 1, -1, true}}), &out).has_value());
  ASSERT_EQ(out.n, 2);
  const auto items = Items(out);
  ExpectItem(items[0], 0, 3, 0.99f, 1);
  ExpectItem(items[1], 1, -1, 0, 2);
}

TEST(NStepAssemblerTest, EnvironmentsHaveSeparateWindows) {
  Assembler a(Spec(), 2, 0.5f, 16);
  TransitionColumns out = EmptyColumns(Spec());
  // Interleaved env 1 and env 2; env 2 ends after one step.
  ASSERT_FALSE(
      a.Add(Batch({{1, 0, 1}, {2, 0, 10, true}, {1, 1, 2}, {2, 5, 20}, {1, 2, 4}}), &out).has_value());
  ASSERT_EQ(out.n, 3);
  const auto items = Items(out);
  ExpectItem(items[0], 200, 10, 0, 201);                // env 2, terminal
  ExpectItem(items[1], 100, 1 + 0.5f * 2, 0.25f, 102);  // env 1 window full at t=1
  ExpectItem(items[2], 101, 2 + 0.5f * 4, 0.25f, 103);
  EXPECT_EQ(a.pending(), 2);  // env 1 t=2, env 2 t=5
  EXPECT_EQ(a.num_envs(), 2);
}

TEST(NStepAssemblerTest, MissingEnvIdsAndTruncatedMeanEnvZeroNotTruncated) {
  Assembler a(Spec(), 2, 0.5f, 16);
  TransitionColumns out = EmptyColumns(Spec());
  IncomingBatch b = Batch({{0, 0, 1}, {0, 1, 2}, {0, 2, 3}});
  b.env_ids.clear();
  b.truncated.clear();
  ASSERT_FALSE(a.Add(b, &out).has_value());
  ASSERT_EQ(out.n, 2);
  ExpectItem(Items(out)[1], 1, 2 + 0.5f * 3, 0.25f, 3);
}

TEST(NStepAssemblerTest, TooManyEnvironmentsRejectsTheWholeBatch) {
  Assembler a(Spec(), 3, 0.5f, /*max_envs=*/2);
  TransitionColumns out = EmptyColumns(Spec());
  ASSERT_FALSE(a.Add(Batch({{1, 0, 1}, {2, 0, 1}}), &out).has_value());
  const auto error = a.Add(Batch({{1, 1, 1, true}, {2, 1, 1}, {3, 0, 1}}), &out);
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->field, "env_ids");
  EXPECT_EQ(error->code, v1::Error::TOO_LARGE);
  EXPECT_EQ(error->message,
            "env_ids[2]: 3 opens more than server.max_envs_per_stream = 2 environments on this stream");
  EXPECT_EQ(out.n, 0);
  EXPECT_EQ(a.pending(), 2);  // env 1's done was not applied
  EXPECT_EQ(a.num_envs(), 2);
}

// A batch without env_ids is env 0, counted against the limit like any other
// (found by the transition_batch fuzzer: it used to open one window too many).
TEST(NStepAssemblerTest, ABatchWithoutEnvIdsCountsAsEnvZero) {
  Assembler a(Spec(), 3, 0.5f, /*max_envs=*/2);
  TransitionColumns out = EmptyColumns(Spec());
  ASSERT_FALSE(a.Add(Batch({{1, 0, 1}, {2, 0, 1}}), &out).has_value());
  IncomingBatch no_ids = Batch({{7, 0, 1}});
  no_ids.env_ids.clear();
  const auto error = a.Add(no_ids, &out);
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->field, "env_ids");
  EXPECT_EQ(error->message,
            "env 0 (no env_ids) opens more than server.max_envs_per_stream = 2 environments on this stream");
  EXPECT_EQ(a.num_envs(), 2);
  // With room, env 0 is one window, however many rows.
  Assembler b(Spec(), 3, 0.5f, /*max_envs=*/1);
  IncomingBatch rows = Batch({{7, 0, 1}, {7, 1, 1}, {7, 2, 1}});
  rows.env_ids.clear();
  ASSERT_FALSE(b.Add(rows, &out).has_value());
  EXPECT_EQ(b.num_envs(), 1);
  ASSERT_FALSE(b.Add(rows, &out).has_value());
}

TEST(NStepAssemblerTest, EnvironmentsThatEndTheirEpisodeFreeTheirSlot) {
  Assembler a(Spec(), 3, 0.5f, /*max_envs=*/2);
  TransitionColumns out = EmptyColumns(Spec());
  ASSERT_FALSE(a.Add(Batch({{1, 0, 1}, {2, 0, 1, true}}), &out).has_value());  // env 2 ends at once
  EXPECT_EQ(a.num_envs(), 1);
  ASSERT_FALSE(a.Add(Batch({{3, 0, 1}}), &out).has_value());
  EXPECT_EQ(a.num_envs(), 2);
  // Within one batch, ids are counted once however often they repeat.
  ASSERT_FALSE(a.Add(Batch({{1, 1, 1}, {3, 1, 1}, {1, 2, 1}, {3, 2, 1}}), &out).has_value());
  EXPECT_TRUE(a.Add(Batch({{4, 0, 1}}), &out).has_value());
}

TEST(NStepAssemblerTest, AddCountsOpenedWindowsAndReplayTheWindowsGainedAndLost) {
  const NStepAssembler a(Spec(), 3, 0.5f, 16);
  NStepWindows issued, committed;
  TransitionColumns out = EmptyColumns(Spec());
  int64_t opened = -1;
  const IncomingBatch first = Batch({{1, 0, 1}, {2, 0, 1}, {3, 0, 1, true}});
  ASSERT_FALSE(a.Add(first, &issued, &out, &opened).has_value());
  EXPECT_EQ(opened, 3);  // env 3 opened and closed in the batch
  EXPECT_EQ(issued.size(), 2u);
  EXPECT_EQ(a.Replay(first, &committed), 2);
  const IncomingBatch second = Batch({{1, 1, 1, true}, {4, 0, 1}});
  ASSERT_FALSE(a.Add(second, &issued, &out, &opened).has_value());
  EXPECT_EQ(opened, 1);
  EXPECT_EQ(a.Replay(second, &committed), 0);  // env 1 gone, env 4 new
  EXPECT_EQ(committed.size(), 2u);
  EXPECT_EQ(Saved(a, issued), Saved(a, committed));
  // What server.max_queued_bytes counts per window: at least its columns.
  EXPECT_GE(a.window_bytes(), static_cast<int64_t>((3 * 1 + 1 + 3) * sizeof(float) + 3 * sizeof(int32_t)));
}

TEST(NStepAssemblerTest, MultiBranchActionsTravelWithTheirStep) {
  v1::NetworkConfig net = DefaultConfig().network();
  net.set_obs_dim(2);
  net.clear_branch_actions();
  net.add_branch_actions(3);
  net.add_branch_actions(5);
  const NetworkSpec spec = *NetworkSpec::Create(net);
  Assembler a(spec, 2, 1.0f, 4);
  IncomingBatch b;
  b.kind = v1::TransitionBatch::KIND_STEP;
  b.columns = EmptyColumns(spec);
  b.columns.n = 3;
  for (int t = 0; t < 3; ++t) {
    b.columns.obs.insert(b.columns.obs.end(), {static_cast<float>(t), static_cast<float>(-t)});
    b.columns.next_obs.insert(b.columns.next_obs.end(), {t + 1.0f, -t - 1.0f});
    b.columns.actions.insert(b.columns.actions.end(), {t % 3, 4 - t});
    b.columns.rewards.push_back(1);
    b.done.push_back(0);
  }
  TransitionColumns out = EmptyColumns(spec);
  ASSERT_FALSE(a.Add(b, &out).has_value());
  ASSERT_EQ(out.n, 2);
  EXPECT_EQ(out.obs, (std::vector<float>{0, 0, 1, -1}));
  EXPECT_EQ(out.next_obs, (std::vector<float>{2, -2, 3, -3}));
  EXPECT_EQ(out.actions, (std::vector<int32_t>{0, 4, 1, 3}));
  EXPECT_EQ(out.rewards, (std::vector<float>{2, 2}));
  EXPECT_EQ(out.discounts, (std::vector<float>{1, 1}));
}

TEST(NStepAssemblerTest, AFailedInsertRestartsFromTheCommittedWindows) {
  NStepAssembler a(Spec(), 3, 0.5f, 16);
  NStepWindows issued, committed;
  TransitionColumns out = EmptyColumns(Spec());
  const IncomingBatch first = Batch({{0, 0, 1}, {0, 1, 2}});
  ASSERT_FALSE(a.Add(first, &issued, &out).has_value());
  a.Replay(first, &committed);
  // The next batch's insert fails: the committed windows never saw it, and
  // issuing it again from them gives the same items and windows.
  const IncomingBatch second = Batch({{0, 2, 3}, {1, 0, 5}});
  TransitionColumns failed = EmptyColumns(Spec());
  ASSERT_FALSE(a.Add(second, &issued, &failed).has_value());
  EXPECT_EQ(NStepAssembler::Pending(committed), 2);
  NStepWindows again = committed;
  TransitionColumns retried = EmptyColumns(Spec());
  ASSERT_FALSE(a.Add(second, &again, &retried).has_value());
  EXPECT_EQ(Items(retried).size(), Items(failed).size());
  EXPECT_EQ(retried.obs, failed.obs);
  EXPECT_EQ(retried.rewards, failed.rewards);
  EXPECT_EQ(Saved(a, again), Saved(a, issued));
  a.Replay(second, &committed);
  EXPECT_EQ(Saved(a, committed), Saved(a, issued));
}

TEST(NStepAssemblerTest, FlushEmitsShorterHorizonNonTerminalItems) {
  Assembler a(Spec(), 3, 0.5f, 16);
  TransitionColumns out = EmptyColumns(Spec());
  ASSERT_FALSE(a.Add(Batch({{0, 0, 1}, {0, 1, 2}, {1, 0, 8}}), &out).has_value());
  ASSERT_EQ(out.n, 0);
  TransitionColumns flushed = EmptyColumns(Spec());
  a.assembler().Flush(a.windows(), &flushed);
  ASSERT_EQ(flushed.n, 3);
  const auto items = Items(flushed);
  // env 0: R over the steps that exist, discount 0.5^K, bootstrap from s_2.
  ExpectItem(items[0], 0, 1 + 0.5f * 2, 0.25f, 2);
  ExpectItem(items[1], 1, 2, 0.5f, 2);
  ExpectItem(items[2], 100, 8, 0.5f, 101);
  EXPECT_EQ(a.pending(), 3);  // Flush leaves the windows to the caller
}

TEST(NStepAssemblerTest, SaveLoadRoundTripContinuesTheWindows) {
  Assembler a(Spec(), 3, 0.5f, 16);
  TransitionColumns out = EmptyColumns(Spec());
  // A ring that wrapped: 4 steps through a window of 3.
  ASSERT_FALSE(a.Add(Batch({{2, 0, 1}, {2, 1, 2}, {2, 2, 3}, {2, 3, 4}}), &out).has_value());
  google::protobuf::RepeatedPtrField<v1::NStepWindowState> saved;
  a.assembler().Save(a.windows(), &saved);
  ASSERT_EQ(saved.size(), 1);
  EXPECT_EQ(saved[0].env_id(), 2u);
  EXPECT_EQ(std::vector<float>(saved[0].rewards().begin(), saved[0].rewards().end()),
            (std::vector<float>{3, 4}));
  Assembler b(Spec(), 3, 0.5f, 16);
  ASSERT_TRUE(b.Load(saved).ok());
  TransitionColumns left = EmptyColumns(Spec());
  TransitionColumns right = EmptyColumns(Spec());
  ASSERT_FALSE(a.Add(Batch({{2, 4, 5}}), &left).has_value());
  ASSERT_FALSE(b.Add(Batch({{2, 4, 5}}), &right).has_value());
  ASSERT_EQ(right.n, 1);
  ExpectItem(Items(right)[0], 202, 3 + 0.5f * 4 + 0.25f * 5, 0.125f, 205);
  EXPECT_EQ(left.rewards, right.rewards);
  // A window of n steps does not fit.
  saved[0].add_rewards(1);
  saved[0].add_rewards(1);
  EXPECT_FALSE(b.Load(saved).ok());
}

}  // namespace
}  // namespace qstream
