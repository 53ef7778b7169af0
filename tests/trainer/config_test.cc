#include "trainer/config.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace qstream {
namespace {

TEST(ConfigTest, DefaultAndBenchConfigsAreValid) {
  EXPECT_TRUE(ValidateConfig(DefaultConfig()).ok());
  auto small = BenchConfig("small");
  ASSERT_TRUE(small.ok());
  EXPECT_TRUE(ValidateConfig(*small).ok());
  EXPECT_EQ(small->network().obs_dim(), 4);
  EXPECT_EQ(small->replay().capacity(), 1 << 16);
  auto h200 = BenchConfig("h200");
  ASSERT_TRUE(h200.ok());
  EXPECT_TRUE(ValidateConfig(*h200).ok());
  EXPECT_EQ(h200->network().branch_actions_size(), 4);
  EXPECT_EQ(BenchConfig("large").status().code(), absl::StatusCode::kNotFound);
}

TEST(ConfigTest, ParsesTextFormatAndFillsDefaults) {
  auto c = ParseConfig("replay { batch_size: 32 } network { trunk_hidden: 128 } seed: 9");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->replay().batch_size(), 32);
  EXPECT_EQ(c->network().trunk_hidden_size(), 1);
  EXPECT_EQ(c->network().branch_actions_size(), 1);
  EXPECT_EQ(c->network().branch_actions(0), 2);
  EXPECT_EQ(c->seed(), 9u);
  EXPECT_FLOAT_EQ(c->optimizer().lr(), 0.001f);
}

TEST(ConfigTest, SyntaxErrorsGiveTheLine) {
  auto c = ParseConfig("replay {\n  batch_size: 32\n  bogus_field: 1\n}");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("line 3"), std::string::npos) << c.status();
}

TEST(ConfigTest, ValidationErrorsNameTheField) {
  const std::pair<std::string, std::string> cases[] = {
      {"network { obs_dim: 0 }", "network.obs_dim"},
      {"network { branch_actions: 3 branch_actions: 0 }", "network.branch_actions[1]"},
      {"optimizer { lr: 0 }", "optimizer.lr"},
      {"optimizer { beta2: 1 }", "optimizer.beta2"},
      {"optimizer { target_tau: 2 }", "optimizer.target_tau"},
      {"optimizer { target_update_period: -1 }", "optimizer.target_update_period"},
      {"replay { capacity: 0 }", "replay.capacity"},
      {"replay { batch_size: 0 }", "replay.batch_size"},
      {"replay { alpha: 1.5 }", "replay.alpha"},
      {"replay { beta_start: -0.1 }", "replay.beta_start"},
      {"replay { priority_epsilon: 0 }", "replay.priority_epsilon"},
      {"replay { capacity: 100 } rate_limiter { min_size_to_sample: 101 }",
       "rate_limiter.min_size_to_sample"},
      {"guard { max_abs_q: -1 }", "guard.max_abs_q"},
      {"returns { n_step: 0 }", "returns.n_step"},
      {"returns { gamma: 1.1 }", "returns.gamma"},
      {"server { publish_every: 0 }", "server.publish_every"},
      {"server { liveness_timeout_seconds: -1 }", "server.liveness_timeout_seconds"},
      {"optimizer { lr_end: -0.001 }", "optimizer.lr_end"},
      {"optimizer { lr_end: inf }", "optimizer.lr_end"},
      {"optimizer { lr_decay_steps: -1 }", "optimizer.lr_decay_steps"},
      {"loss { label_smoothing: 1 }", "loss.label_smoothing"},
      {"loss { label_smoothing: -0.01 }", "loss.label_smoothing"},
      {"loss { label_smoothing: nan }", "loss.label_smoothing"},
      {"loss { mse_blend { start: 1.5 } }", "loss.mse_blend.start"},
      {"loss { mse_blend { end: -0.5 } }", "loss.mse_blend.end"},
      {"loss { mse_blend { end: nan } }", "loss.mse_blend.end"},
      {"loss { mse_blend { steps: -1 } }", "loss.mse_blend.steps"},
  };
  for (const auto& [text, field] : cases) {
    auto c = ParseConfig(text);
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(c.status().message().rfind(field + ":", 0), 0u) << text << " -> " << c.status();
  }
}

TEST(ConfigTest, LossOptionsParseAndDefaultToPlainCrossEntropy) {
  const v1::TrainerConfig d = DefaultConfig();
  EXPECT_FALSE(d.has_loss()) << "left out of manifests that older daemons must read";
  EXPECT_EQ(d.loss().label_smoothing(), 0.0f);
  EXPECT_EQ(d.loss().mse_blend().start(), 0.0f);
  EXPECT_EQ(d.loss().mse_blend().end(), 0.0f);
  EXPECT_EQ(d.loss().mse_blend().steps(), 0);
  auto c = ParseConfig("loss { label_smoothing: 0.1 mse_blend { start: 1 end: 0 steps: 10 } }");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FLOAT_EQ(c->loss().label_smoothing(), 0.1f);
  EXPECT_EQ(c->loss().mse_blend().start(), 1.0f);
  EXPECT_EQ(c->loss().mse_blend().end(), 0.0f);
  EXPECT_EQ(c->loss().mse_blend().steps(), 10);
  // The closed ends of the ranges are valid.
  EXPECT_TRUE(ParseConfig("loss { label_smoothing: 0.999 mse_blend { start: 0 end: 1 steps: 0 } }").ok());
}

TEST(ConfigTest, LoadConfigFile) {
  EXPECT_EQ(LoadConfigFile("/nonexistent/qstream.pbtxt").status().code(), absl::StatusCode::kNotFound);
  const std::string path = ::testing::TempDir() + "/qstream_config_test.pbtxt";
  {
    std::ofstream out(path);
    out << "replay { batch_size: 16 }\n";
  }
  auto c = LoadConfigFile(path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->replay().batch_size(), 16);
  {
    std::ofstream out(path);
    out << "replay { alpha: 7 }\n";
  }
  c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find(path), std::string::npos);
  EXPECT_NE(c.status().message().find("replay.alpha"), std::string::npos);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace qstream
