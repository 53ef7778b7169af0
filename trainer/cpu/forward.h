// Online-network forward pass on the CPU: Q-values and greedy actions. The
// same code the CPU backend trains with; used by the actor and Evaluate.
#pragma once

#include <cstdint>
#include <vector>

#include "trainer/network_spec.h"

namespace qstream {

// q: n x total_actions (branches concatenated), Q[a] = sum_z softmax(l[a])[z] * atom(z).
void ComputeQValues(const NetworkSpec& spec, const float* params, const float* obs, int64_t n, float* q);

// actions: n x num_branches, argmax per branch (ties: lowest index).
void GreedyActions(const NetworkSpec& spec, const float* q, int64_t n, int32_t* actions);

}  // namespace qstream
