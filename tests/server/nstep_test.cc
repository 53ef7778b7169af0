#include "server/nstep.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
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

// ---- The step-stream form (next_obs unset, final_obs at episode ends) ----

// A step of a random trajectory: obs_dim 3 of random values (distinct per
// step), one branch of 4 actions.
struct Step {
  uint32_t env = 0;
  std::vector<float> obs;
  int action = 0;
  float reward = 0;
  bool done = false;
  bool truncated = false;
  std::vector<float> next_obs;  // the state it led to (the final obs at an end)
};

NetworkSpec Spec3() {
  v1::NetworkConfig net = DefaultConfig().network();
  net.set_obs_dim(3);
  net.clear_branch_actions();
  net.add_branch_actions(4);
  return *NetworkSpec::Create(net);
}

// Rows [begin, end) of `rows` as one KIND_STEP batch, in the full form or the
// step-stream form.
IncomingBatch Rows(const std::vector<Step>& rows, size_t begin, size_t end, bool stream_form) {
  IncomingBatch b;
  b.kind = v1::TransitionBatch::KIND_STEP;
  b.columns.n = static_cast<int64_t>(end - begin);
  b.columns.obs_dim = 3;
  b.columns.num_branches = 1;
  for (size_t i = begin; i < end; ++i) {
    const Step& s = rows[i];
    b.columns.obs.insert(b.columns.obs.end(), s.obs.begin(), s.obs.end());
    if (!stream_form) {
      b.columns.next_obs.insert(b.columns.next_obs.end(), s.next_obs.begin(), s.next_obs.end());
    } else if (s.done || s.truncated) {
      b.final_obs.insert(b.final_obs.end(), s.next_obs.begin(), s.next_obs.end());
    }
    b.columns.actions.push_back(s.action);
    b.columns.rewards.push_back(s.reward);
    b.done.push_back(s.done ? 1 : 0);
    b.truncated.push_back(s.truncated ? 1 : 0);
    b.env_ids.push_back(s.env);
  }
  return b;
}

using FullItem = std::tuple<std::vector<float>, int, double, double, std::vector<float>>;

std::vector<FullItem> FullItems(const TransitionColumns& c) {
  std::vector<FullItem> items;
  for (int64_t i = 0; i < c.n; ++i) {
    items.emplace_back(std::vector<float>(c.obs.begin() + 3 * i, c.obs.begin() + 3 * i + 3), c.actions[i],
                       c.rewards[i], c.discounts[i],
                       std::vector<float>(c.next_obs.begin() + 3 * i, c.next_obs.begin() + 3 * i + 3));
  }
  std::sort(items.begin(), items.end());
  return items;
}

// The n-step items of every step of `rows` (each env's steps in order), in
// double precision from the definition: K = min(n, steps left in the episode
// or in the data), bootstrapping from the next_obs of the K-th step.
std::vector<FullItem> Reference(const std::vector<Step>& rows, int n, double gamma) {
  std::vector<FullItem> items;
  std::vector<std::vector<const Step*>> by_env;
  for (const Step& s : rows) {
    if (by_env.size() <= s.env) by_env.resize(s.env + 1);
    by_env[s.env].push_back(&s);
  }
  for (const auto& steps : by_env) {
    for (size_t t = 0; t < steps.size(); ++t) {
      double ret = 0;
      double discount = 1;
      size_t last = t;
      for (size_t k = t; k < steps.size() && k < t + static_cast<size_t>(n); ++k) {
        ret += discount * steps[k]->reward;
        discount *= gamma;
        last = k;
        if (steps[k]->done || steps[k]->truncated) break;
      }
      items.emplace_back(steps[t]->obs, steps[t]->action, ret, steps[last]->done ? 0.0 : discount,
                         steps[last]->next_obs);
    }
  }
  std::sort(items.begin(), items.end());
  return items;
}

void ExpectSameItems(const std::vector<FullItem>& got, const std::vector<FullItem>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const auto& [obs, action, ret, discount, next] = got[i];
    const auto& [wobs, waction, wret, wdiscount, wnext] = want[i];
    EXPECT_EQ(obs, wobs) << "item " << i;
    EXPECT_EQ(action, waction) << "item " << i;
    EXPECT_NEAR(ret, wret, 1e-5 * (1 + std::abs(wret))) << "item " << i;
    EXPECT_NEAR(discount, wdiscount, 1e-6) << "item " << i;
    EXPECT_EQ(next, wnext) << "item " << i;
  }
}

// Random envs, each a run of episodes (the next state of a step that does
// not end its episode is the next step's obs); rows of all envs interleaved
// in a random order that keeps each env's steps in order. Every env's last
// step ends its episode when `all_end`.
std::vector<Step> RandomRows(std::mt19937& rng, int envs, bool all_end) {
  std::uniform_real_distribution<float> value(-10.0f, 10.0f);
  std::uniform_int_distribution<int> length(1, 30);
  std::bernoulli_distribution ends(0.12);
  std::bernoulli_distribution coin(0.5);
  std::vector<std::vector<Step>> per_env(envs);
  auto random_obs = [&] { return std::vector<float>{value(rng), value(rng), value(rng)}; };
  for (int e = 0; e < envs; ++e) {
    const int steps = length(rng);
    std::vector<float> obs = random_obs();
    for (int t = 0; t < steps; ++t) {
      Step s;
      s.env = static_cast<uint32_t>(e);
      s.obs = obs;
      s.action = static_cast<int>(rng() % 4);
      s.reward = value(rng);
      const bool end = ends(rng) || (all_end && t + 1 == steps);
      s.done = end && coin(rng);
      s.truncated = end && !s.done;
      s.next_obs = random_obs();
      // After an end the env resets: the next episode starts from a fresh obs.
      obs = end ? random_obs() : s.next_obs;
      per_env[e].push_back(std::move(s));
    }
  }
  std::vector<Step> rows;
  std::vector<size_t> next(envs, 0);
  while (true) {
    std::vector<int> open;
    for (int e = 0; e < envs; ++e) {
      if (next[e] < per_env[e].size()) open.push_back(e);
    }
    if (open.empty()) break;
    const int e = open[rng() % open.size()];
    rows.push_back(per_env[e][next[e]++]);
  }
  return rows;
}

TEST(NStepStepStreamTest, BothFormsInAnyMixGiveTheReferenceItems) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 40; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 5);
    const float gamma = std::uniform_real_distribution<float>(0.5f, 1.0f)(rng);
    const std::vector<Step> rows = RandomRows(rng, 1 + static_cast<int>(rng() % 6), /*all_end=*/true);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ", n " << n << ", gamma " << gamma << ", "
                                      << rows.size() << " rows");
    const std::vector<FullItem> want = Reference(rows, n, gamma);
    // 0: every batch full form; 1: every batch step-stream; 2: a coin per batch.
    for (int mix = 0; mix < 3; ++mix) {
      Assembler a(Spec3(), n, gamma, 16);
      TransitionColumns out = EmptyColumns(Spec3());
      for (size_t begin = 0; begin < rows.size();) {
        const size_t end = std::min(rows.size(), begin + 1 + rng() % 9);
        const bool stream_form = mix == 1 || (mix == 2 && rng() % 2 == 0);
        ASSERT_FALSE(a.Add(Rows(rows, begin, end, stream_form), &out).has_value());
        begin = end;
      }
      EXPECT_EQ(a.pending(), 0) << "mix " << mix;
      ExpectSameItems(FullItems(out), want);
    }
  }
}

TEST(NStepStepStreamTest, AFlushDropsOnlyTheNewestStepOfAnAwaitingWindow) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 5);
    const float gamma = std::uniform_real_distribution<float>(0.5f, 1.0f)(rng);
    std::vector<Step> rows = RandomRows(rng, 1 + static_cast<int>(rng() % 4), /*all_end=*/false);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ", n " << n);
    Assembler a(Spec3(), n, gamma, 16);
    TransitionColumns out = EmptyColumns(Spec3());
    ASSERT_FALSE(a.Add(Rows(rows, 0, rows.size(), /*stream_form=*/true), &out).has_value());
    a.assembler().Flush(a.windows(), &out);
    // The reference: each env's open episode ends (truncated) at its
    // second-newest step, bootstrapping from the newest step's obs, and the
    // newest step (whose next state never came) has no item.
    std::vector<bool> last_seen(8, false);
    std::vector<Step> expected;
    for (size_t i = rows.size(); i-- > 0;) {
      Step s = rows[i];
      if (!last_seen[s.env]) {
        last_seen[s.env] = true;
        if (!s.done && !s.truncated) continue;  // the dropped newest step
      }
      expected.push_back(std::move(s));
    }
    std::reverse(expected.begin(), expected.end());
    std::vector<bool> cut(8, false);
    for (size_t i = expected.size(); i-- > 0;) {
      Step& s = expected[i];
      if (cut[s.env]) continue;
      cut[s.env] = true;
      if (s.done || s.truncated) continue;  // its episode had ended: nothing was open
      s.truncated = true;                   // next_obs is already the dropped step's obs
    }
    ExpectSameItems(FullItems(out), Reference(expected, n, gamma));
  }
}

TEST(NStepStepStreamTest, AnAwaitingWindowSurvivesACheckpoint) {
  Assembler a(Spec(), 3, 0.5f, 16);
  TransitionColumns out = EmptyColumns(Spec());
  IncomingBatch stream = Batch({{0, 0, 1}, {0, 1, 2}, {0, 2, 3}});
  stream.columns.next_obs.clear();  // the step-stream form: no row ends, no final_obs
  ASSERT_FALSE(a.Add(stream, &out).has_value());
  EXPECT_EQ(out.n, 0);  // three steps wait: the third's next state is not known
  EXPECT_EQ(a.pending(), 3);
  google::protobuf::RepeatedPtrField<v1::NStepWindowState> saved;
  a.assembler().Save(a.windows(), &saved);
  ASSERT_EQ(saved.size(), 1);
  EXPECT_TRUE(saved[0].awaiting_next_obs());
  EXPECT_EQ(saved[0].last_next_obs_size(), 0);
  EXPECT_EQ(saved[0].rewards_size(), 3);
  Assembler b(Spec(), 3, 0.5f, 16);
  ASSERT_TRUE(b.Load(saved).ok());
  // The next row (full form, the obs 3 that follows s_2) completes item 0.
  TransitionColumns next = EmptyColumns(Spec());
  ASSERT_FALSE(b.Add(Batch({{0, 3, 4}}), &next).has_value());
  ASSERT_EQ(next.n, 2);
  const auto items = Items(next);
  ExpectItem(items[0], 0, 1 + 0.5f * 2 + 0.25f * 3, 0.125f, 3);
  ExpectItem(items[1], 1, 2 + 0.5f * 3 + 0.25f * 4, 0.125f, 4);
  // An awaiting window with a bootstrap state, or with more than n steps, does not load.
  auto with_next = saved;
  with_next[0].add_last_next_obs(7);
  const absl::Status st = b.Load(with_next);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("last_next_obs: 1 values, expected 0 (awaiting_next_obs)"), std::string::npos)
      << st;
  auto too_long = saved;
  too_long[0].add_rewards(1);
  too_long[0].add_obs(9);
  too_long[0].add_actions(1);
  EXPECT_NE(
      b.Load(too_long).message().find("4 steps; returns.n_step = 3 holds at most 3 (awaiting_next_obs)"),
      std::string::npos)
      << b.Load(too_long);
}

// ---- Fold: many committed batches at once ----

// Random trajectories cut into batches of random sizes, each in a random form
// (full or step-stream), without env_ids when they are all env 0 and without
// truncated when no row is cut.
std::vector<IncomingBatch> RandomBatches(std::mt19937& rng, const std::vector<Step>& rows) {
  std::vector<IncomingBatch> batches;
  for (size_t begin = 0; begin < rows.size();) {
    const size_t end = std::min(rows.size(), begin + 1 + rng() % 7);
    IncomingBatch b = Rows(rows, begin, end, /*stream_form=*/rng() % 2 == 0);
    if (std::all_of(b.env_ids.begin(), b.env_ids.end(), [](uint32_t e) { return e == 0; }) &&
        rng() % 2 == 0) {
      b.env_ids.clear();
    }
    if (std::all_of(b.truncated.begin(), b.truncated.end(), [](uint8_t t) { return t == 0; }) &&
        rng() % 2 == 0) {
      b.truncated.clear();
    }
    batches.push_back(std::move(b));
    begin = end;
  }
  return batches;
}

TEST(NStepFoldTest, FoldLeavesTheWindowsThatReplayingEachBatchLeaves) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 5);
    const NStepAssembler a(Spec3(), n, 0.9f, 64);
    const int envs = 1 + static_cast<int>(rng() % 6);
    const std::vector<Step> rows = RandomRows(rng, envs, /*all_end=*/rng() % 2 == 0);
    const std::vector<IncomingBatch> batches = RandomBatches(rng, rows);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ", n " << n << ", " << envs << " envs, "
                                      << batches.size() << " batches");
    // The eager set replays every batch, the folded one folds runs of them.
    NStepWindows eager, folded;
    for (size_t i = 0; i < batches.size();) {
      const size_t end = std::min(batches.size(), i + 1 + rng() % 8);
      std::vector<const IncomingBatch*> run;
      int64_t gained = 0;
      for (; i < end; ++i) {
        run.push_back(&batches[i]);
        gained += a.Replay(batches[i], &eager);
      }
      EXPECT_EQ(a.Fold(run, &folded), gained);
      ASSERT_EQ(Saved(a, folded), Saved(a, eager)) << "after batch " << i;
      if (i == batches.size()) break;
      // The next batch's items are the same from either set (a rollback
      // restarts the issued windows from the folded ones).
      NStepWindows from_eager = eager, from_folded = folded;
      TransitionColumns want = EmptyColumns(Spec3()), got = EmptyColumns(Spec3());
      ASSERT_FALSE(a.Add(batches[i], &from_eager, &want).has_value());
      ASSERT_FALSE(a.Add(batches[i], &from_folded, &got).has_value());
      ExpectSameItems(FullItems(got), FullItems(want));
      EXPECT_EQ(Saved(a, from_folded), Saved(a, from_eager));
    }
  }
}

// Add finds each row's window with one lookup and opens the missing ones
// after reserving room for them (a reserve that rehashes moves the windows
// found before it). Hundreds of envs per batch make the map grow, and episode
// ends leave erased slots behind, while batches are assembled: the items must
// be the reference's, the windows after each batch those that Fold (its own
// lookups) leaves, `opened` the batch's env ids the windows lacked, and a
// batch past max_envs must name its first row past the limit and change
// nothing.
TEST(NStepFoldTest, AddWithManyEnvsPerBatchMatchesTheReferenceAndTheFold) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 30; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 5);
    const float gamma = std::uniform_real_distribution<float>(0.5f, 1.0f)(rng);
    const int envs = 50 + static_cast<int>(rng() % 400);
    // Tight limits in some trials: batches that open too many envs are rejected.
    const int64_t max_envs = rng() % 3 == 0 ? envs / 2 + static_cast<int64_t>(rng() % envs) : envs;
    const std::vector<Step> rows = RandomRows(rng, envs, /*all_end=*/true);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ", n " << n << ", " << envs
                                      << " envs, max_envs " << max_envs << ", " << rows.size() << " rows");
    const NStepAssembler a(Spec3(), n, gamma, max_envs);
    NStepWindows windows, folded;
    std::vector<IncomingBatch> committed;
    size_t accepted = 0;  // rows of the batches Add took
    TransitionColumns out = EmptyColumns(Spec3());
    // Small batches in every other trial: the map then grows (rehashes)
    // while batches also find windows opened before them.
    const size_t most_rows = trial % 2 == 0 ? 40 : 300;
    for (size_t begin = 0; begin < rows.size();) {
      const size_t end = std::min(rows.size(), begin + 1 + rng() % most_rows);
      IncomingBatch batch = Rows(rows, begin, end, /*stream_form=*/rng() % 2 == 0);
      // What the batch opens, and the first row past max_envs.
      std::vector<uint32_t> fresh;
      std::optional<size_t> past;
      for (size_t i = 0; i < batch.env_ids.size(); ++i) {
        const uint32_t id = batch.env_ids[i];
        if (windows.contains(id) || std::find(fresh.begin(), fresh.end(), id) != fresh.end()) continue;
        fresh.push_back(id);
        if (!past && static_cast<int64_t>(windows.size() + fresh.size()) > max_envs) past = i;
      }
      const std::string before = Saved(a, windows);
      const int64_t items_before = out.n;
      int64_t opened = -1;
      const auto error = a.Add(batch, &windows, &out, &opened);
      if (past) {
        ASSERT_TRUE(error.has_value()) << "rows " << begin << ".." << end;
        EXPECT_EQ(error->message, absl::StrCat("env_ids[", *past, "]: ", batch.env_ids[*past],
                                               " opens more than server.max_envs_per_stream = ", max_envs,
                                               " environments on this stream"));
        EXPECT_EQ(Saved(a, windows), before);
        EXPECT_EQ(out.n, items_before);
        begin = end;
        continue;
      }
      ASSERT_FALSE(error.has_value()) << error->message;
      EXPECT_EQ(opened, static_cast<int64_t>(fresh.size()));
      committed.push_back(std::move(batch));
      accepted += end - begin;
      a.Fold({&committed.back()}, &folded);
      ASSERT_EQ(Saved(a, windows), Saved(a, folded)) << "after rows " << begin << ".." << end;
      begin = end;
    }
    if (accepted == rows.size()) {
      // Every batch went in and every env's last step ended its episode
      // (with a batch rejected, the windows above are what is checked).
      EXPECT_EQ(NStepAssembler::Pending(windows), 0);
      ExpectSameItems(FullItems(out), Reference(rows, n, gamma));
    }
  }
}

TEST(NStepFoldTest, AnEpisodeEndInTheRunRestartsTheWindowAndAnEndAtTheNewestRowDropsIt) {
  const NStepAssembler a(Spec(), 3, 0.5f, 16);
  NStepWindows eager, folded;
  const IncomingBatch base = Batch({{0, 0, 1}, {0, 1, 2}, {1, 10, 1}, {2, 20, 1}});
  a.Replay(base, &eager);
  a.Replay(base, &folded);
  // env 0: an end, then one step of a new episode; env 1: ends at its newest
  // row; env 2: continues past n steps; env 3: opens.
  const IncomingBatch b1 = Batch({{0, 2, 3, true}, {2, 21, 1}, {1, 11, 1}, {0, 3, 1}});
  const IncomingBatch b2 = Batch({{2, 22, 1}, {1, 12, 1, false, true}, {2, 23, 1}, {3, 30, 1}, {2, 24, 1}});
  EXPECT_EQ(a.Replay(b1, &eager) + a.Replay(b2, &eager), a.Fold({&b1, &b2}, &folded));
  EXPECT_EQ(Saved(a, folded), Saved(a, eager));
  EXPECT_EQ(folded.count(1), 0u);
  EXPECT_EQ(folded.at(0).size, 1);
  EXPECT_EQ(folded.at(2).size, 2);
  EXPECT_EQ(folded.at(3).size, 1);
}

}  // namespace
}  // namespace qstream
