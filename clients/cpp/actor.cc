#include "clients/cpp/actor.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "clients/cpp/env_registry.h"
#include "clients/cpp/return_tracker.h"
#include "trainer/cpu/forward.h"

namespace qstream::actor {
namespace {

// The policy must act in the env's space: one branch of num_actions actions.
absl::Status CheckPolicyFits(const PolicySnapshot& snap, const Env& env) {
  if (snap.spec.obs_dim != env.obs_dim()) {
    return absl::FailedPreconditionError(absl::StrCat("policy obs_dim ", snap.spec.obs_dim, " but ",
                                                      env.name(), " observations have ", env.obs_dim()));
  }
  if (snap.spec.num_branches() != 1 || snap.spec.branch_actions[0] != env.num_actions()) {
    return absl::FailedPreconditionError(
        absl::StrCat("policy branch_actions must be [", env.num_actions(), "] for ", env.name()));
  }
  return absl::OkStatus();
}

// Columns of the batch being filled.
class BatchBuilder {
 public:
  BatchBuilder() { Clear(); }

  void Add(std::span<const float> obs, std::span<const float> next_obs, int action, float reward,
           bool terminated, bool truncated, int env_id, int64_t policy_version) {
    for (float v : obs) {
      batch_.add_obs(v);
    }
    for (float v : next_obs) {
      batch_.add_next_obs(v);
    }
    batch_.add_actions(action);
    batch_.add_rewards(reward);
    batch_.add_done(terminated);
    // A terminal state is never bootstrapped, even when the time limit hit on the same step.
    batch_.add_truncated(truncated && !terminated);
    batch_.add_env_ids(static_cast<uint32_t>(env_id));
    // The oldest policy in the batch: lag is reported conservatively.
    oldest_version_ = std::min(oldest_version_, policy_version);
    batch_.set_count(batch_.count() + 1);
  }

  int count() const { return static_cast<int>(batch_.count()); }

  v1::TransitionBatch Take() {
    batch_.set_policy_version(oldest_version_);
    v1::TransitionBatch out = std::move(batch_);
    Clear();
    return out;
  }

 private:
  void Clear() {
    batch_ = v1::TransitionBatch();
    batch_.set_kind(v1::TransitionBatch::KIND_STEP);
    oldest_version_ = std::numeric_limits<int64_t>::max();
  }

  v1::TransitionBatch batch_;
  int64_t oldest_version_ = 0;
};

}  // namespace

absl::StatusOr<ActorResult> RunActor(const ActorOptions& options, ExperienceStream& stream,
                                     PolicyWatcher& policy, const std::atomic<bool>& stop,
                                     std::ostream& log) {
  if (options.num_envs < 1) {
    return absl::InvalidArgumentError("num_envs must be >= 1");
  }
  if (options.batch_transitions < 1) {
    return absl::InvalidArgumentError("batch_transitions must be >= 1");
  }
  if (options.return_window < 1) {
    return absl::InvalidArgumentError("return_window must be >= 1");
  }

  std::vector<std::unique_ptr<Env>> envs;
  for (int i = 0; i < options.num_envs; ++i) {
    // Distinct, reproducible episode starts per env.
    auto env = MakeEnv(options.env, options.seed * 1000003u + static_cast<uint64_t>(i));
    if (!env.ok()) {
      return env.status();
    }
    envs.push_back(*std::move(env));
  }
  const int n = options.num_envs;
  const int obs_dim = envs[0]->obs_dim();
  const int num_actions = envs[0]->num_actions();

  std::vector<float> obs(static_cast<size_t>(n) * obs_dim);
  std::vector<float> next_obs(obs_dim);
  for (int i = 0; i < n; ++i) {
    envs[i]->Reset(std::span<float>(obs).subspan(static_cast<size_t>(i) * obs_dim, obs_dim));
  }

  std::mt19937_64 rng(options.seed);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::uniform_int_distribution<int> random_action(0, num_actions - 1);
  ReturnTracker returns(n, options.return_window);
  BatchBuilder batch;
  std::vector<float> q;
  std::vector<int32_t> greedy(n);

  ActorResult result;
  const absl::Time start = absl::Now();
  absl::Time next_report = start + options.report_every;
  std::shared_ptr<const PolicySnapshot> snap;
  auto report = [&](const char* tag) {
    const double secs = absl::ToDoubleSeconds(absl::Now() - start);
    log << absl::StrFormat(
               "%s env_steps=%d episodes=%d mean_return_%d=%.1f epsilon=%.3f policy_version=%d "
               "steps_per_s=%.0f replay_size=%d",
               tag, result.env_steps, returns.episodes(), options.return_window, returns.mean(),
               options.epsilon.At(result.env_steps), snap ? snap->version : 0,
               secs > 0 ? static_cast<double>(result.env_steps) / secs : 0.0, stream.totals().replay_size)
        << std::endl;
  };

  while (!stop.load(std::memory_order_relaxed)) {
    if (options.max_steps > 0 && result.env_steps >= options.max_steps) {
      break;
    }
    std::shared_ptr<const PolicySnapshot> latest = policy.Latest();
    if (latest != snap) {
      if (absl::Status fits = CheckPolicyFits(*latest, *envs[0]); !fits.ok()) {
        return fits;
      }
      snap = std::move(latest);
      q.resize(static_cast<size_t>(n) * snap->spec.total_actions());
    }
    ComputeQValues(snap->spec, snap->weights.data(), obs.data(), n, q.data());
    GreedyActions(snap->spec, q.data(), n, greedy.data());

    const double epsilon = options.epsilon.At(result.env_steps);
    for (int i = 0; i < n; ++i) {
      const int action = coin(rng) < epsilon ? random_action(rng) : greedy[i];
      std::span<float> env_obs = std::span<float>(obs).subspan(static_cast<size_t>(i) * obs_dim, obs_dim);
      const StepResult step = envs[i]->Step(action, next_obs);
      batch.Add(env_obs, next_obs, action, step.reward, step.terminated, step.truncated, i, snap->version);
      returns.AddReward(i, step.reward);
      ++result.env_steps;
      if (step.terminated || step.truncated) {
        returns.EndEpisode(i);
        envs[i]->Reset(env_obs);
      } else {
        std::copy(next_obs.begin(), next_obs.end(), env_obs.begin());
      }
    }
    if (batch.count() >= options.batch_transitions) {
      if (absl::Status s = stream.Send(batch.Take()); !s.ok()) {
        return s;
      }
    }
    if (absl::Now() >= next_report) {
      report("progress");
      next_report += options.report_every;
    }
    if (!std::isnan(options.stop_at_return) && returns.full() && returns.mean() >= options.stop_at_return) {
      result.reached_target = true;
      break;
    }
  }
  if (batch.count() > 0) {
    if (absl::Status s = stream.Send(batch.Take()); !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = stream.Flush(); !s.ok()) {
    return s;
  }
  report(result.reached_target ? "reached" : "done");
  result.episodes = returns.episodes();
  result.mean_return = returns.mean();
  result.stream = stream.totals();
  return result;
}

}  // namespace qstream::actor
