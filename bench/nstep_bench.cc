// `qstream-bench nstep`: what the daemon's server-side n-step assembly costs
// per transition for KIND_STEP batches (a vector env of --envs envs sending
// one step each per message), as an ingest session runs it: Add advances the
// issued windows, and the committed windows take the batch at delivery:
// CommittedWindows (a log folded every few batches; --commit=lazy, the
// session's way) or NStepAssembler::Replay of every batch (--commit=eager).
// One JSON line, the median of --repeats timings of --batches batches.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "bench/bench.h"
#include "nlohmann/json.hpp"
#include "qstream/version.h"
#include "server/committed_windows.h"
#include "server/nstep.h"
#include "trainer/network_spec.h"

namespace qstream::bench {
namespace {

struct Flags {
  int envs = 1024;
  int obs_dim = 48;
  int branches = 4;
  int n_step = 3;
  int episode_length = 200;
  int batches = 2000;
  int repeats = 5;
  bool step_stream = false;  // --form=stream: next_obs only at episode ends (final_obs)
  bool eager = false;        // --commit=eager: Replay every batch into the committed windows
};

absl::Status Parse(int argc, char** argv, Flags* f) {
  return ParseFlagArgs(argc, argv, [f](const std::string& name, const std::string& value) {
    if (name == "form") {
      f->step_stream = value == "stream";
      return value == "stream" || value == "full" ? FlagValue::kOk : FlagValue::kBad;
    }
    if (name == "commit") {
      f->eager = value == "eager";
      return value == "eager" || value == "lazy" ? FlagValue::kOk : FlagValue::kBad;
    }
    int* target = name == "envs"             ? &f->envs
                  : name == "obs_dim"        ? &f->obs_dim
                  : name == "branches"       ? &f->branches
                  : name == "n_step"         ? &f->n_step
                  : name == "episode_length" ? &f->episode_length
                  : name == "batches"        ? &f->batches
                  : name == "repeats"        ? &f->repeats
                                             : nullptr;
    if (target == nullptr) return FlagValue::kUnknown;
    return absl::SimpleAtoi(value, target) && *target > 0 ? FlagValue::kOk : FlagValue::kBad;
  });
}

void Usage() {
  std::fprintf(stderr,
               "usage: qstream-bench nstep [--envs=1024] [--obs_dim=48] [--branches=4] [--n_step=3]\n"
               "                           [--episode_length=200] [--batches=2000] [--repeats=5]\n"
               "                           [--form=full|stream (next_obs only at episode ends)]\n"
               "                           [--commit=lazy|eager (Replay every batch at delivery)]\n");
}

absl::Status Run(const Flags& f) {
  v1::NetworkConfig net;
  net.set_obs_dim(f.obs_dim);
  net.add_trunk_hidden(8);
  net.set_head_hidden(8);
  for (int b = 0; b < f.branches; ++b) net.add_branch_actions(4);
  auto spec = NetworkSpec::Create(net);
  if (!spec.ok()) return spec.status();
  const NStepAssembler assembler(*spec, f.n_step, 0.99f, f.envs);

  // One message: every env one step; episodes end every episode_length steps,
  // staggered over the envs.
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  auto make_batch = [&](int64_t t) {
    IncomingBatch b;
    b.kind = v1::TransitionBatch::KIND_STEP;
    TransitionColumns& c = b.columns;
    c.n = f.envs;
    c.obs_dim = f.obs_dim;
    c.num_branches = f.branches;
    for (int e = 0; e < f.envs; ++e) {
      const bool done = (t + e) % f.episode_length == f.episode_length - 1;
      for (int d = 0; d < f.obs_dim; ++d) {
        c.obs.push_back(normal(rng));
        if (!f.step_stream) {
          c.next_obs.push_back(normal(rng));
        } else if (done) {
          b.final_obs.push_back(normal(rng));
        }
      }
      for (int br = 0; br < f.branches; ++br) c.actions.push_back(static_cast<int32_t>(rng() % 4));
      c.rewards.push_back(normal(rng));
      b.env_ids.push_back(static_cast<uint32_t>(e));
      b.done.push_back(done ? 1 : 0);
    }
    return b;
  };
  constexpr int kDistinctBatches = 16;
  std::vector<IncomingBatch> batches;
  batches.reserve(kDistinctBatches);
  for (int i = 0; i < kDistinctBatches; ++i) batches.push_back(make_batch(i));

  std::vector<double> ns_per_transition;
  int64_t emitted = 0;
  for (int r = 0; r < f.repeats; ++r) {
    NStepWindows committed, issued;
    CommittedWindows lazy(&assembler);
    // The session hands its own batch over (a move): copied here, untimed.
    std::vector<IncomingBatch> handed;
    if (!f.eager) {
      handed.reserve(f.batches);
      for (int i = 0; i < f.batches; ++i) handed.push_back(batches[i % batches.size()]);
    }
    TransitionColumns out;
    out.obs_dim = f.obs_dim;
    out.num_branches = f.branches;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < f.batches; ++i) {
      out.n = 0;
      out.obs.clear();
      out.next_obs.clear();
      out.actions.clear();
      out.rewards.clear();
      out.discounts.clear();
      const IncomingBatch& batch = batches[i % batches.size()];
      if (auto error = assembler.Add(batch, &issued, &out)) return absl::InternalError(error->message);
      if (f.eager) {
        assembler.Replay(batch, &committed);
      } else {
        lazy.Commit(std::move(handed[i]), 0);
      }
      emitted += out.n;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ns_per_transition.push_back(seconds * 1e9 / (static_cast<double>(f.batches) * f.envs));
  }
  std::sort(ns_per_transition.begin(), ns_per_transition.end());
  const double median = ns_per_transition[ns_per_transition.size() / 2];
  nlohmann::json j = {{"bench", "nstep"},
                      {"commit", QSTREAM_GIT_COMMIT},
                      {"envs", f.envs},
                      {"obs_dim", f.obs_dim},
                      {"branches", f.branches},
                      {"n_step", f.n_step},
                      {"form", f.step_stream ? "stream" : "full"},
                      {"committed_windows", f.eager ? "eager" : "lazy"},
                      {"batches", f.batches},
                      {"repeats", f.repeats},
                      {"ns_per_transition_median", median},
                      {"ns_per_transition_min", ns_per_transition.front()},
                      {"transitions_per_second", 1e9 / median},
                      {"emitted", emitted}};
  std::printf("%s\n", j.dump().c_str());
  return absl::OkStatus();
}

}  // namespace

int RunNStepBench(int argc, char** argv) { return RunSubcommand("nstep", argc, argv, &Parse, &Usage, &Run); }

}  // namespace qstream::bench
