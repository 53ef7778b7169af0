// A Backend that forwards every call to another one: test doubles derive from
// it and override only what they observe or change (a recorded insert, a
// step that hangs).
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "trainer/backend.h"

namespace qstream::testing {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  std::string name() const override { return inner_->name(); }
  std::string device() const override { return inner_->device(); }
  const NetworkSpec& spec() const override { return inner_->spec(); }
  DeviceMemory device_memory() const override { return inner_->device_memory(); }
  absl::Status Insert(const TransitionColumns& batch) override { return inner_->Insert(batch); }
  int64_t replay_size() const override { return inner_->replay_size(); }
  int64_t replay_capacity() const override { return inner_->replay_capacity(); }
  absl::Status Step() override { return inner_->Step(); }
  int64_t steps() const override { return inner_->steps(); }
  StepStats last_stats() override { return inner_->last_stats(); }
  std::vector<int64_t> guard_trips() override { return inner_->guard_trips(); }
  void DrainStepTimes(std::vector<std::pair<double, int64_t>>* out) override { inner_->DrainStepTimes(out); }
  std::vector<float> GetParams() override { return inner_->GetParams(); }
  absl::Status SetParams(const std::vector<float>& params) override { return inner_->SetParams(params); }
  absl::Status SaveState(bool include_replay, BackendState* out) override {
    return inner_->SaveState(include_replay, out);
  }
  absl::Status LoadState(const BackendState& state, StateParts parts) override {
    return inner_->LoadState(state, parts);
  }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace qstream::testing
