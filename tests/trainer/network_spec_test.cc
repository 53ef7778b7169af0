#include "trainer/network_spec.h"

#include <cmath>
#include <string>

#include "gtest/gtest.h"

namespace qstream {
namespace {

v1::NetworkConfig Config() {
  v1::NetworkConfig c;
  c.set_obs_dim(4);
  c.add_trunk_hidden(8);
  c.add_trunk_hidden(6);
  c.set_head_hidden(5);
  c.set_num_atoms(7);
  c.set_v_min(-3);
  c.set_v_max(3);
  c.add_branch_actions(2);
  c.add_branch_actions(3);
  return c;
}

TEST(NetworkSpecTest, LayoutIsContiguousInDocumentedOrder) {
  auto spec = NetworkSpec::Create(Config());
  ASSERT_TRUE(spec.ok()) << spec.status();
  const auto layers = spec->layers();
  ASSERT_EQ(layers.size(), 6u);
  int64_t offset = 0;
  for (const LinearView& l : layers) {
    EXPECT_EQ(l.w_offset, offset);
    EXPECT_EQ(l.b_offset, offset + int64_t{l.in} * l.out);
    offset = l.b_offset + l.out;
  }
  EXPECT_EQ(spec->num_params, offset);
  EXPECT_EQ(layers[0].in, 4);
  EXPECT_EQ(layers[1].out, 6);
  EXPECT_EQ(spec->value_hidden.in, 6);
  EXPECT_EQ(spec->value_out.out, 7);
  EXPECT_EQ(spec->adv_out.out, 5 * 7);
  EXPECT_EQ(spec->total_actions(), 5);
  EXPECT_EQ(spec->branch_offset(1), 2);
  EXPECT_EQ(spec->num_params, (4 * 8 + 8) + (8 * 6 + 6) + 2 * (6 * 5 + 5) + (5 * 7 + 7) + (5 * 35 + 35));
  EXPECT_FLOAT_EQ(spec->atom(0), -3.0f);
  EXPECT_FLOAT_EQ(spec->atom(6), 3.0f);
  EXPECT_FLOAT_EQ(spec->delta_z(), 1.0f);
}

TEST(NetworkSpecTest, EmptyRepeatedFieldsTakeTheirDefaults) {
  v1::NetworkConfig c;
  auto spec = NetworkSpec::Create(c);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->trunk_hidden, (std::vector<int>{64, 64}));
  EXPECT_EQ(spec->branch_actions, (std::vector<int>{2}));
  EXPECT_EQ(spec->num_atoms, 51);
}

TEST(NetworkSpecTest, ArchitectureRoundTrips) {
  auto spec = NetworkSpec::Create(Config());
  ASSERT_TRUE(spec.ok());
  auto back = NetworkSpec::FromArchitecture(spec->ToArchitecture());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->DebugString(), spec->DebugString());
  EXPECT_EQ(back->num_params, spec->num_params);
}

struct BadCase {
  std::string field;
  void (*mutate)(v1::NetworkConfig*);
};

TEST(NetworkSpecTest, ValidationErrorsNameTheField) {
  const BadCase cases[] = {
      {"network.obs_dim", [](v1::NetworkConfig* c) { c->set_obs_dim(0); }},
      {"network.trunk_hidden[1]", [](v1::NetworkConfig* c) { c->set_trunk_hidden(1, -2); }},
      {"network.head_hidden", [](v1::NetworkConfig* c) { c->set_head_hidden(0); }},
      {"network.num_atoms", [](v1::NetworkConfig* c) { c->set_num_atoms(1); }},
      {"network.v_min", [](v1::NetworkConfig* c) { c->set_v_min(5); }},
      {"network.v_min", [](v1::NetworkConfig* c) { c->set_v_max(NAN); }},
      {"network.branch_actions[1]", [](v1::NetworkConfig* c) { c->set_branch_actions(1, 0); }},
  };
  for (const BadCase& bad : cases) {
    auto c = Config();
    bad.mutate(&c);
    auto spec = NetworkSpec::Create(c);
    ASSERT_FALSE(spec.ok()) << bad.field;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(spec.status().message().rfind(bad.field + ":", 0), 0u) << spec.status();
  }
}

TEST(NetworkSpecTest, InitParamsIsSeededAndBoundedPerLayer) {
  auto spec = NetworkSpec::Create(Config());
  ASSERT_TRUE(spec.ok());
  const auto a = InitParams(*spec, 1);
  EXPECT_EQ(a, InitParams(*spec, 1));
  EXPECT_NE(a, InitParams(*spec, 2));
  ASSERT_EQ(static_cast<int64_t>(a.size()), spec->num_params);
  for (const LinearView& l : spec->layers()) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(l.in));
    float max_abs = 0;
    for (int64_t i = 0; i < l.num_params(); ++i) max_abs = std::max(max_abs, std::fabs(a[l.w_offset + i]));
    EXPECT_LE(max_abs, bound);
    EXPECT_GT(max_abs, 0.5f * bound);  // spread over the range, not all near 0
  }
}

}  // namespace
}  // namespace qstream
