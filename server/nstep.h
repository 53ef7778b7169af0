// Server-side n-step assembly for KIND_STEP batches: one window of the last
// n one-step transitions per env_id of a stream. A transition leaves its
// window as the n-step item
//   (s_t, a_t, R = sum_{k<K} gamma^k r_{t+k}, discount = gamma^K (1 - terminal), s_{t+K})
// with K = n once n steps followed it; when the episode ends (done) every
// remaining item is flushed with discount 0; when it is cut by a time limit
// (truncated) every remaining item is flushed with its shorter K and
// bootstraps from the last next_obs.
#pragma once

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "qstream/v1/experience.pb.h"
#include "server/validate.h"
#include "trainer/network_spec.h"
#include "trainer/transitions.h"

namespace qstream {

class NStepAssembler {
 public:
  // `max_envs` bounds the windows of one stream (memory a client can pin).
  NStepAssembler(const NetworkSpec& spec, int n_step, float gamma, int64_t max_envs);

  // Appends the items a validated KIND_STEP batch completes to `out` (whose
  // obs_dim/num_branches must match the spec). On error (too many env ids)
  // nothing of the batch is taken and no window changes.
  std::optional<BatchError> Add(const v1::TransitionBatch& batch, TransitionColumns* out);

  // Transitions waiting in windows for later steps.
  int64_t pending() const;
  int64_t num_envs() const { return static_cast<int64_t>(windows_.size()); }

 private:
  // Ring of at most n steps: obs, actions and rewards per step, plus the
  // next_obs of the newest step (the bootstrap state of every item in it).
  struct Window {
    std::vector<float> obs;
    std::vector<int32_t> actions;
    std::vector<float> rewards;
    std::vector<float> last_next_obs;
    int head = 0;
    int size = 0;
  };

  Window& WindowFor(uint32_t env_id);
  void Push(Window& w, const float* obs, const int32_t* actions, float reward, const float* next_obs);
  // Emits the item at the window's head with a return over the whole window.
  void EmitHead(Window& w, bool terminal, TransitionColumns* out);
  void Flush(Window& w, bool terminal, TransitionColumns* out);

  const int obs_dim_;
  const int branches_;
  const int n_;
  const double gamma_;
  const int64_t max_envs_;
  std::unordered_map<uint32_t, Window> windows_;
};

}  // namespace qstream
