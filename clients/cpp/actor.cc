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
#include "clients/cpp/writer.h"

namespace qstream::actor {
namespace {

// The policy must act in the env's space: one branch of num_actions actions.
absl::Status CheckPolicyFits(const PolicySnapshot& snap, const Env& env) {
  if (snap.network.obs_dim() != env.obs_dim()) {
    return absl::FailedPreconditionError(absl::StrCat("policy obs_dim ", snap.network.obs_dim(), " but ",
                                                      env.name(), " observations have ", env.obs_dim()));
  }
  if (snap.network.num_branches() != 1 || snap.network.branch_actions()[0] != env.num_actions()) {
    return absl::FailedPreconditionError(
        absl::StrCat("policy branch_actions must be [", env.num_actions(), "] for ", env.name()));
  }
  return absl::OkStatus();
}

StreamTotals Totals(const std::vector<ExperienceStream*>& streams) {
  StreamTotals sum;
  for (const ExperienceStream* stream : streams) {
    sum.Add(stream->totals());
  }
  return sum;
}

}  // namespace

absl::StatusOr<ActorResult> RunActor(const ActorOptions& options,
                                     const std::vector<ExperienceStream*>& streams, PolicyWatcher& policy,
                                     const std::atomic<bool>& stop, std::ostream& log) {
  if (options.num_envs < 1) {
    return absl::InvalidArgumentError("num_envs must be >= 1");
  }
  if (streams.empty()) {
    return absl::InvalidArgumentError("no experience stream");
  }
  if (static_cast<int>(streams.size()) > options.num_envs) {
    return absl::InvalidArgumentError(absl::StrCat("num_envs (", options.num_envs,
                                                   ") must be at least the number of servers (",
                                                   streams.size(), "): each env streams to one"));
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

  // Stream k takes envs [first_env[k], first_env[k + 1]) through writers[k].
  const int num_streams = static_cast<int>(streams.size());
  std::vector<int> first_env(num_streams + 1);
  std::vector<std::unique_ptr<Writer>> writers;
  std::vector<Writer*> writer_of_env(n);
  for (int k = 0; k <= num_streams; ++k) {
    first_env[k] = k * n / num_streams;
  }
  for (int k = 0; k < num_streams; ++k) {
    WriterOptions writer_options;
    writer_options.obs_dim = obs_dim;
    writer_options.num_envs = first_env[k + 1] - first_env[k];
    writer_options.flush_transitions = std::max(options.batch_transitions, writer_options.num_envs);
    writer_options.flush_after = options.flush_after;
    writer_options.env = options.env;
    auto writer = Writer::Create(*streams[k], writer_options);
    if (!writer.ok()) {
      return writer.status();
    }
    std::fill(writer_of_env.begin() + first_env[k], writer_of_env.begin() + first_env[k + 1], writer->get());
    writers.push_back(*std::move(writer));
  }

  // One vector step of all envs: row i is env i.
  std::vector<float> obs(static_cast<size_t>(n) * obs_dim);
  std::vector<float> next_obs(obs.size());
  std::vector<int32_t> actions(n);
  std::vector<float> rewards(n);
  std::vector<uint8_t> terminated(n);
  std::vector<uint8_t> truncated(n);
  auto row = [obs_dim](std::vector<float>& v, int i) {
    return std::span<float>(v).subspan(static_cast<size_t>(i) * obs_dim, obs_dim);
  };
  for (int i = 0; i < n; ++i) {
    envs[i]->Reset(row(obs, i));
  }

  std::mt19937_64 rng(options.seed);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::uniform_int_distribution<int> random_action(0, num_actions - 1);
  ReturnTracker returns(n, options.return_window);
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
               secs > 0 ? static_cast<double>(result.env_steps) / secs : 0.0, Totals(streams).replay_size)
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
      q.resize(static_cast<size_t>(n) * snap->network.total_actions());
      for (const std::unique_ptr<Writer>& writer : writers) {
        writer->set_policy_version(snap->version);
      }
    }
    if (absl::Status s = snap->network.QValues(snap->weights, obs, q); !s.ok()) {
      return s;
    }
    if (absl::Status s = snap->network.GreedyActions(q, greedy); !s.ok()) {
      return s;
    }

    const double epsilon = options.epsilon.At(result.env_steps);
    for (int i = 0; i < n; ++i) {
      actions[i] = coin(rng) < epsilon ? random_action(rng) : greedy[i];
      const StepResult step = envs[i]->Step(actions[i], row(next_obs, i));
      rewards[i] = step.reward;
      terminated[i] = step.terminated ? 1 : 0;
      truncated[i] = step.truncated ? 1 : 0;
    }
    for (int k = 0; k < num_streams; ++k) {
      const size_t first = first_env[k];
      const size_t count = first_env[k + 1] - first_env[k];
      auto rows = [first, count](auto& column, size_t width) {
        return std::span(column).subspan(first * width, count * width);
      };
      const VectorStep block{rows(obs, obs_dim),  rows(actions, 1),   rows(rewards, 1),
                             rows(terminated, 1), rows(truncated, 1), rows(next_obs, obs_dim)};
      if (absl::Status s = writers[k]->AppendStep(block); !s.ok()) {
        return s;
      }
    }
    for (int i = 0; i < n; ++i) {
      returns.AddReward(i, rewards[i]);
      ++result.env_steps;
      if (terminated[i] != 0 || truncated[i] != 0) {
        const int64_t length = returns.steps(i);
        if (absl::Status s = writer_of_env[i]->ReportEpisode(returns.EndEpisode(i), length, snap->version);
            !s.ok()) {
          return s;
        }
        envs[i]->Reset(row(obs, i));
      } else {
        std::ranges::copy(row(next_obs, i), row(obs, i).begin());
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
  // Every writer closes, so one rank's failure does not hold back the others' data.
  absl::Status closed;
  for (const std::unique_ptr<Writer>& writer : writers) {
    closed.Update(writer->Close().status());
  }
  if (!closed.ok()) {
    return closed;
  }
  report(result.reached_target ? "reached" : "done");
  result.episodes = returns.episodes();
  result.mean_return = returns.mean();
  result.stream = Totals(streams);
  return result;
}

}  // namespace qstream::actor
