// Helpers shared by the tests that drive a Learner over the real CPU backend
// with a small network (learner_checkpoint_test, learner_pause_test).
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <utility>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "trainer/cpu/cpu_backend.h"
#include "trainer/learner.h"

namespace qstream::testing {

// obs_dim 3, one hidden layer of 8, heads of 6, 5 atoms on [-4, 4], one
// branch of 2 actions: small enough that a step takes microseconds.
inline void SetSmallNetwork(v1::TrainerConfig* c) {
  auto* n = c->mutable_network();
  n->set_obs_dim(3);
  n->add_trunk_hidden(8);
  n->set_head_hidden(6);
  n->set_num_atoms(5);
  n->set_v_min(-4);
  n->set_v_max(4);
  n->add_branch_actions(2);
}

// n random transitions for SetSmallNetwork's shape. poison: every
// observation NaN (the online Q-values go non-finite, so every step that
// samples one trips the guard).
inline TransitionColumns RandomItems(int n, uint32_t seed, bool poison = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0, 1);
  TransitionColumns c;
  c.n = n;
  c.obs_dim = 3;
  c.num_branches = 1;
  for (int i = 0; i < n; ++i) {
    for (int d = 0; d < 3; ++d) {
      c.obs.push_back(poison ? std::nanf("") : g(rng));
      c.next_obs.push_back(g(rng));
    }
    c.actions.push_back(static_cast<int32_t>(rng() % 2));
    c.rewards.push_back(g(rng));
    c.discounts.push_back(0.9f);
  }
  return c;
}

inline std::unique_ptr<Learner> MakeCpuLearner(const v1::TrainerConfig& config) {
  auto backend = CreateCpuBackend(config);
  EXPECT_TRUE(backend.ok()) << backend.status();
  auto learner = Learner::Create(config, *std::move(backend));
  EXPECT_TRUE(learner.ok()) << learner.status();
  return *std::move(learner);
}

// Enqueues `items` and waits for the insert's callback.
inline void InsertAndWait(Learner* learner, TransitionColumns items) {
  absl::Notification inserted;
  learner->Enqueue(std::move(items), [&](const absl::Status& s, int64_t) {
    EXPECT_TRUE(s.ok()) << s;
    inserted.Notify();
  });
  inserted.WaitForNotification();
}

}  // namespace qstream::testing
