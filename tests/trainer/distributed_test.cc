// Config distributed: the validation of its fields (ValidateConfig) and the
// learner config every rank of a group must share (CheckGroupConfig).
#include "trainer/distributed.h"

#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/config.h"

namespace qstream {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

v1::TrainerConfig TwoRanks(int rank) {
  v1::TrainerConfig c = DefaultConfig();
  auto* d = c.mutable_distributed();
  d->set_world_size(2);
  d->set_rank(rank);
  d->set_rendezvous_address("10.0.0.1:50052");
  return c;
}

TEST(DistributedConfigTest, ValidGroupsAndTheDefaultPass) {
  EXPECT_TRUE(ValidateConfig(DefaultConfig()).ok());
  EXPECT_EQ(DefaultConfig().distributed().world_size(), 1);
  EXPECT_EQ(DefaultConfig().distributed().rank(), 0);
  EXPECT_DOUBLE_EQ(DefaultConfig().distributed().rendezvous_timeout_seconds(), 300);
  for (int rank : {0, 1}) EXPECT_TRUE(ValidateConfig(TwoRanks(rank)).ok()) << rank;
  v1::TrainerConfig largest = TwoRanks(1023);
  largest.mutable_distributed()->set_world_size(1024);
  largest.mutable_distributed()->set_rendezvous_timeout_seconds(0.5);
  EXPECT_TRUE(ValidateConfig(largest).ok());
  // One daemon needs no rendezvous.
  v1::TrainerConfig single = DefaultConfig();
  single.mutable_distributed()->set_world_size(1);
  EXPECT_TRUE(ValidateConfig(single).ok());
}

TEST(DistributedConfigTest, ValidationErrorsNameTheField) {
  struct Case {
    std::string name;
    std::function<void(v1::DistributedConfig*)> edit;
    std::string message;  // the whole message starts with this
  };
  const Case cases[] = {
      {"world_size 0", [](auto* d) { d->set_world_size(0); }, "distributed.world_size: must be in [1, 1024]"},
      {"world_size -3", [](auto* d) { d->set_world_size(-3); },
       "distributed.world_size: must be in [1, 1024]"},
      {"world_size 1025", [](auto* d) { d->set_world_size(1025); },
       "distributed.world_size: must be in [1, 1024]"},
      {"rank == world_size", [](auto* d) { d->set_rank(2); },
       "distributed.rank: must be in [0, world_size = 2)"},
      {"rank -1", [](auto* d) { d->set_rank(-1); }, "distributed.rank: must be in [0, world_size = 2)"},
      {"no rendezvous_address", [](auto* d) { d->clear_rendezvous_address(); },
       "distributed.rendezvous_address: is required when world_size > 1"},
      {"empty rendezvous_address", [](auto* d) { d->set_rendezvous_address(""); },
       "distributed.rendezvous_address: is required when world_size > 1"},
      {"timeout 0", [](auto* d) { d->set_rendezvous_timeout_seconds(0); },
       "distributed.rendezvous_timeout_seconds: must be > 0"},
      {"timeout -1", [](auto* d) { d->set_rendezvous_timeout_seconds(-1); },
       "distributed.rendezvous_timeout_seconds: must be > 0"},
      {"timeout nan",
       [](auto* d) { d->set_rendezvous_timeout_seconds(std::numeric_limits<double>::quiet_NaN()); },
       "distributed.rendezvous_timeout_seconds: must be > 0"},
      {"timeout inf",
       [](auto* d) { d->set_rendezvous_timeout_seconds(std::numeric_limits<double>::infinity()); },
       "distributed.rendezvous_timeout_seconds: must be > 0"},
  };
  for (const Case& c : cases) {
    v1::TrainerConfig config = TwoRanks(1);
    c.edit(config.mutable_distributed());
    const absl::Status st = ValidateConfig(config);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << st;
    EXPECT_THAT(std::string(st.message()), StartsWith(c.message)) << c.name;
  }
  // A rank of a one-daemon "group" is out of range too.
  v1::TrainerConfig single = DefaultConfig();
  single.mutable_distributed()->set_rank(1);
  EXPECT_THAT(std::string(ValidateConfig(single).message()),
              StartsWith("distributed.rank: must be in [0, world_size = 1)"));
}

TEST(DistributedConfigTest, TextConfigIsValidatedToo) {
  auto ok = ParseConfig(
      "distributed { world_size: 4 rank: 3 rendezvous_address: \"rank0:50052\" "
      "rendezvous_timeout_seconds: 30 }");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->distributed().world_size(), 4);
  EXPECT_EQ(ok->distributed().rank(), 3);
  auto bad = ParseConfig("distributed { world_size: 2 }");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), StartsWith("distributed.rendezvous_address:"));
}

TEST(CheckGroupConfigTest, EqualConfigsPass) {
  EXPECT_TRUE(CheckGroupConfig(TwoRanks(0), TwoRanks(1), 1).ok());
  EXPECT_TRUE(CheckGroupConfig(DefaultConfig(), DefaultConfig(), 1).ok());
}

// Each rank has its own replay shard, ports, checkpoints and seed: those may differ.
TEST(CheckGroupConfigTest, PerRankFieldsMayDiffer) {
  const std::vector<std::pair<std::string, std::function<void(v1::TrainerConfig*)>>> edits = {
      {"replay.capacity", [](auto* c) { c->mutable_replay()->set_capacity(12345); }},
      {"server.publish_every", [](auto* c) { c->mutable_server()->set_publish_every(7); }},
      {"server.max_streams", [](auto* c) { c->mutable_server()->set_max_streams(3); }},
      {"checkpoint.every_steps", [](auto* c) { c->mutable_checkpoint()->set_every_steps(99); }},
      {"checkpoint.keep", [](auto* c) { c->mutable_checkpoint()->set_keep(9); }},
      {"distributed.rank", [](auto* c) { c->mutable_distributed()->set_rank(5); }},
      {"distributed.rendezvous_address",
       [](auto* c) { c->mutable_distributed()->set_rendezvous_address("x:1"); }},
      {"rate_limiter", [](auto* c) { c->mutable_rate_limiter()->set_samples_per_insert(2); }},
      {"seed", [](auto* c) { c->set_seed(4242); }},
  };
  for (const auto& [name, edit] : edits) {
    v1::TrainerConfig joining = TwoRanks(1);
    edit(&joining);
    const absl::Status st = CheckGroupConfig(TwoRanks(0), joining, 1);
    EXPECT_TRUE(st.ok()) << name << ": " << st;
  }
}

TEST(CheckGroupConfigTest, SharedFieldsMustBeEqualAndTheErrorNamesThem) {
  struct Case {
    std::string field;  // as the report names it
    std::function<void(v1::TrainerConfig*)> edit;
  };
  const Case cases[] = {
      {"network.trunk_hidden", [](auto* c) { c->mutable_network()->set_trunk_hidden(1, 128); }},
      {"network.trunk_hidden", [](auto* c) { c->mutable_network()->add_trunk_hidden(64); }},
      {"network.num_atoms", [](auto* c) { c->mutable_network()->set_num_atoms(21); }},
      {"optimizer.lr", [](auto* c) { c->mutable_optimizer()->set_lr(0.0005f); }},
      {"replay.batch_size", [](auto* c) { c->mutable_replay()->set_batch_size(512); }},
      {"replay.alpha", [](auto* c) { c->mutable_replay()->set_alpha(0.3f); }},
      {"matmul_precision", [](auto* c) { c->set_matmul_precision(v1::TrainerConfig::BF16); }},
      {"guard.max_grad_norm", [](auto* c) { c->mutable_guard()->set_max_grad_norm(5); }},
      {"returns.gamma", [](auto* c) { c->mutable_returns()->set_gamma(0.9f); }},
      {"loss.label_smoothing", [](auto* c) { c->mutable_loss()->set_label_smoothing(0.1f); }},
  };
  for (const Case& c : cases) {
    v1::TrainerConfig joining = TwoRanks(1);
    c.edit(&joining);
    const absl::Status st = CheckGroupConfig(TwoRanks(0), joining, 1);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << c.field << ": " << st;
    const std::string message(st.message());
    EXPECT_THAT(message, StartsWith("distributed: rank 1's config differs from rank 0's")) << c.field;
    EXPECT_THAT(message, HasSubstr(c.field)) << c.field;
  }
}

TEST(CheckGroupConfigTest, TheErrorNamesTheJoiningRankAndBothValues) {
  v1::TrainerConfig joining = TwoRanks(1);
  joining.mutable_replay()->set_batch_size(512);
  const absl::Status st = CheckGroupConfig(TwoRanks(0), joining, 3);
  const std::string message(st.message());
  EXPECT_THAT(message, HasSubstr("rank 3's config"));
  // Rank 0's value, then the joining rank's.
  EXPECT_THAT(message, HasSubstr(absl::StrCat("replay.batch_size: ", DefaultConfig().replay().batch_size(),
                                              " -> 512")));
  EXPECT_THAT(message, Not(HasSubstr("\n\n")));
}

TEST(CheckGroupConfigTest, UnsetAndExplicitDefaultsAreEqual) {
  v1::TrainerConfig bare;  // nothing set, not even the repeated defaults
  bare.mutable_distributed()->set_world_size(2);
  bare.mutable_distributed()->set_rendezvous_address("a:1");

  v1::TrainerConfig spelled_out = bare;
  spelled_out.mutable_distributed()->set_rank(1);
  auto* n = spelled_out.mutable_network();
  n->add_trunk_hidden(64);
  n->add_trunk_hidden(64);
  n->add_branch_actions(2);
  n->set_num_atoms(51);
  n->set_v_min(-10);
  spelled_out.mutable_optimizer()->set_lr(0.001f);
  spelled_out.mutable_replay()->set_batch_size(DefaultConfig().replay().batch_size());
  spelled_out.mutable_replay()->set_alpha(DefaultConfig().replay().alpha());
  spelled_out.set_matmul_precision(v1::TrainerConfig::TF32);
  spelled_out.mutable_loss();  // present but empty
  spelled_out.mutable_guard()->set_max_abs_q(0);
  EXPECT_TRUE(CheckGroupConfig(bare, spelled_out, 1).ok()) << CheckGroupConfig(bare, spelled_out, 1);
  EXPECT_TRUE(CheckGroupConfig(spelled_out, bare, 1).ok());

  // The deprecated allow_tf32: false means FP32: the same precision as FP32 spelled out.
  v1::TrainerConfig old_style = bare;
  old_style.set_allow_tf32(false);
  v1::TrainerConfig new_style = bare;
  new_style.set_matmul_precision(v1::TrainerConfig::FP32);
  EXPECT_TRUE(CheckGroupConfig(old_style, new_style, 1).ok()) << CheckGroupConfig(old_style, new_style, 1);
  EXPECT_EQ(CheckGroupConfig(old_style, bare, 1).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(GroupLearnerConfigTest, KeepsOnlyTheSharedFields) {
  v1::TrainerConfig c = TwoRanks(1);
  c.mutable_replay()->set_capacity(777);
  c.mutable_server()->set_publish_every(3);
  c.mutable_checkpoint()->set_keep(4);
  c.set_seed(5);
  const v1::TrainerConfig shared = GroupLearnerConfig(c);
  EXPECT_FALSE(shared.has_distributed());
  EXPECT_FALSE(shared.has_server());
  EXPECT_FALSE(shared.has_checkpoint());
  EXPECT_FALSE(shared.has_rate_limiter());
  EXPECT_FALSE(shared.has_seed());
  EXPECT_FALSE(shared.replay().has_capacity());
  EXPECT_EQ(shared.replay().batch_size(), c.replay().batch_size());
  EXPECT_EQ(shared.network().trunk_hidden_size(), 2);  // defaults filled
  EXPECT_EQ(shared.matmul_precision(), v1::TrainerConfig::TF32);
}

}  // namespace
}  // namespace qstream
