// Built-in environments by name.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "clients/cpp/env.h"

namespace qstream::actor {

// "CartPole" (also "CartPole-v1") or "MountainCar" ("MountainCar-v0").
// NotFound names the known environments.
absl::StatusOr<std::unique_ptr<Env>> MakeEnv(const std::string& name, uint64_t seed);

std::vector<std::string> EnvNames();

}  // namespace qstream::actor
