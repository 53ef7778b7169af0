#include "clients/cpp/env_registry.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "clients/cpp/cartpole.h"
#include "clients/cpp/mountain_car.h"

namespace qstream::actor {

std::vector<std::string> EnvNames() { return {"CartPole", "MountainCar"}; }

absl::StatusOr<std::unique_ptr<Env>> MakeEnv(const std::string& name, uint64_t seed) {
  if (name == "CartPole" || name == "CartPole-v1") {
    return std::make_unique<CartPole>(seed);
  }
  if (name == "MountainCar" || name == "MountainCar-v0") {
    return std::make_unique<MountainCar>(seed);
  }
  return absl::NotFoundError(
      absl::StrCat("unknown env '", name, "'; built-in: ", absl::StrJoin(EnvNames(), ", ")));
}

}  // namespace qstream::actor
