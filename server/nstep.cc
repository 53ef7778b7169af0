#include "server/nstep.h"

#include <algorithm>
#include <unordered_set>

#include "absl/strings/str_cat.h"

namespace qstream {

NStepAssembler::NStepAssembler(const NetworkSpec& spec, int n_step, float gamma, int64_t max_envs)
    : obs_dim_(spec.obs_dim),
      branches_(spec.num_branches()),
      n_(n_step),
      gamma_(gamma),
      max_envs_(max_envs) {}

int64_t NStepAssembler::pending() const {
  int64_t total = 0;
  for (const auto& [id, w] : windows_) total += w.size;
  return total;
}

NStepAssembler::Window& NStepAssembler::WindowFor(uint32_t env_id) {
  auto [it, inserted] = windows_.try_emplace(env_id);
  Window& w = it->second;
  if (inserted) {
    w.obs.resize(static_cast<size_t>(n_) * obs_dim_);
    w.actions.resize(static_cast<size_t>(n_) * branches_);
    w.rewards.resize(n_);
    w.last_next_obs.resize(obs_dim_);
  }
  return w;
}

void NStepAssembler::Push(Window& w, const float* obs, const int32_t* actions, float reward,
                          const float* next_obs) {
  const int slot = (w.head + w.size) % n_;
  std::copy(obs, obs + obs_dim_, w.obs.begin() + static_cast<size_t>(slot) * obs_dim_);
  std::copy(actions, actions + branches_, w.actions.begin() + static_cast<size_t>(slot) * branches_);
  w.rewards[slot] = reward;
  std::copy(next_obs, next_obs + obs_dim_, w.last_next_obs.begin());
  ++w.size;
}

void NStepAssembler::EmitHead(Window& w, bool terminal, TransitionColumns* out) {
  double ret = 0;
  double discount = 1;
  for (int k = 0; k < w.size; ++k) {
    ret += discount * w.rewards[(w.head + k) % n_];
    discount *= gamma_;
  }
  const size_t slot = static_cast<size_t>(w.head);
  out->obs.insert(out->obs.end(), w.obs.begin() + slot * obs_dim_, w.obs.begin() + (slot + 1) * obs_dim_);
  out->actions.insert(out->actions.end(), w.actions.begin() + slot * branches_,
                      w.actions.begin() + (slot + 1) * branches_);
  out->rewards.push_back(static_cast<float>(ret));
  out->discounts.push_back(terminal ? 0.0f : static_cast<float>(discount));
  out->next_obs.insert(out->next_obs.end(), w.last_next_obs.begin(), w.last_next_obs.end());
  ++out->n;
  w.head = (w.head + 1) % n_;
  --w.size;
}

void NStepAssembler::Flush(Window& w, bool terminal, TransitionColumns* out) {
  while (w.size > 0) EmitHead(w, terminal, out);
  w.head = 0;
}

std::optional<BatchError> NStepAssembler::Add(const v1::TransitionBatch& batch, TransitionColumns* out) {
  const int64_t count = batch.count();
  const bool has_env_ids = batch.env_ids_size() > 0;
  const bool has_truncated = batch.truncated_size() > 0;
  if (has_env_ids) {
    // Admission first, so a rejected batch leaves every window untouched.
    int64_t envs = num_envs();
    std::unordered_set<uint32_t> fresh;
    for (int64_t i = 0; i < count; ++i) {
      const uint32_t id = batch.env_ids(i);
      if (windows_.count(id) || !fresh.insert(id).second) continue;
      if (++envs > max_envs_) {
        return BatchError{v1::Error::INVALID_FIELD, "env_ids",
                          absl::StrCat("env_ids[", i, "]: ", id, " opens more than ", max_envs_,
                                       " environments on this stream")};
      }
    }
  }
  out->Reserve(out->n + count);
  for (int64_t i = 0; i < count; ++i) {
    Window& w = WindowFor(has_env_ids ? batch.env_ids(i) : 0);
    Push(w, batch.obs().data() + i * obs_dim_, batch.actions().data() + i * branches_, batch.rewards(i),
         batch.next_obs().data() + i * obs_dim_);
    if (batch.done(i)) {
      Flush(w, /*terminal=*/true, out);
    } else if (has_truncated && batch.truncated(i)) {
      Flush(w, /*terminal=*/false, out);
    } else if (w.size == n_) {
      EmitHead(w, /*terminal=*/false, out);
    }
  }
  return std::nullopt;
}

}  // namespace qstream
