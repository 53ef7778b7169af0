// Writes checkpoints for tests outside C++.
//
//   write_test_checkpoint DIR
//     <DIR>/ckpt-7: the network of kTestNetwork with params[i] = i * 0.001,
//     target = 2 * params, adam_m = -params, adam_v = params^2, and a replay of
//     kRows rows: obs[r][j] = r + j / 10, next_obs = -obs, actions[r][b] =
//     (r + b) % branch_actions[b], rewards[r] = r / 2, discounts[r] = 0.99,
//     priorities[r] = r + 1 (clients/python/tests/test_checkpoint_files.py).
//
//   write_test_checkpoint --bench_rows=N DIR
//     Writes and reads back a checkpoint of the h200 network (obs 48, trunk
//     256,256, head 128, 51 atoms, 4 branches x 5 actions) with an N-row
//     replay and prints {"bytes", "write_seconds", "read_seconds"}.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "google/protobuf/text_format.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"

namespace qstream {
namespace {

constexpr char kTestNetwork[] = R"pb(
  obs_dim: 3
  trunk_hidden: 4
  trunk_hidden: 6
  head_hidden: 5
  num_atoms: 3
  branch_actions: 2
  branch_actions: 3
)pb";
constexpr int64_t kRows = 5;
constexpr int64_t kCapacity = 8;

constexpr char kH200Network[] = R"pb(
  obs_dim: 48
  trunk_hidden: 256
  trunk_hidden: 256
  head_hidden: 128
  num_atoms: 51
  branch_actions: 5
  branch_actions: 5
  branch_actions: 5
  branch_actions: 5
)pb";

// A consistent manifest + state for `network` with a replay of `rows` rows in
// a ring of `capacity`.
int Build(const char* network, int64_t rows, int64_t capacity, CheckpointData* data) {
  v1::TrainerConfig config;
  if (!google::protobuf::TextFormat::ParseFromString(network, config.mutable_network())) return 1;
  FillDefaults(&config);
  absl::StatusOr<NetworkSpec> spec = NetworkSpec::Create(config.network());
  if (!spec.ok()) {
    std::fprintf(stderr, "write_test_checkpoint: %s\n", spec.status().ToString().c_str());
    return 1;
  }
  BackendState& s = data->state;
  s.steps = 7;
  s.applied_updates = 6;
  for (int64_t i = 0; i < spec->num_params; ++i) {
    const float p = static_cast<float>(i) * 0.001f;
    s.params.push_back(p);
    s.target.push_back(2 * p);
    s.adam_m.push_back(-p);
    s.adam_v.push_back(p * p);
  }
  s.guard_trips = {0, 1, 0, 0, 0};
  s.has_replay = true;
  ReplayState& r = s.replay;
  r.capacity = capacity;
  r.size = rows;
  r.cursor = rows % capacity;
  r.max_priority = static_cast<float>(rows);
  TransitionColumns& c = r.rows;
  c.n = rows;
  c.obs_dim = spec->obs_dim;
  c.num_branches = spec->num_branches();
  c.Reserve(rows);
  for (int64_t i = 0; i < rows; ++i) {
    for (int j = 0; j < c.obs_dim; ++j) {
      c.obs.push_back(static_cast<float>(i) + static_cast<float>(j) / 10);
      c.next_obs.push_back(-c.obs.back());
    }
    for (int b = 0; b < c.num_branches; ++b)
      c.actions.push_back(static_cast<int32_t>((i + b) % spec->branch_actions[b]));
    c.rewards.push_back(static_cast<float>(i) / 2);
    c.discounts.push_back(0.99f);
    r.priorities.push_back(static_cast<float>(i + 1));
  }

  v1::CheckpointManifest& m = data->manifest;
  m.set_format_version(kCheckpointFormatVersion);
  m.set_learner_step(s.steps);
  m.set_optimizer_step(s.applied_updates);
  *m.mutable_config() = config;
  m.mutable_replay()->set_included(true);
  m.mutable_replay()->set_capacity(r.capacity);
  m.mutable_replay()->set_size(r.size);
  m.mutable_replay()->set_cursor(r.cursor);
  m.mutable_replay()->set_max_priority(r.max_priority);
  for (int64_t t : s.guard_trips) m.mutable_guard()->add_trips(t);
  m.set_created_by("write_test_checkpoint");
  m.set_backend("none");
  return 0;
}

int Main(int argc, char** argv) {
  int64_t bench_rows = -1;
  std::string dir;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strncmp(a, "--bench_rows=", 13) == 0) {
      if (!absl::SimpleAtoi(a + 13, &bench_rows) || bench_rows < 0) {
        std::fprintf(stderr, "write_test_checkpoint: bad %s\n", a);
        return 2;
      }
    } else {
      dir = a;
    }
  }
  if (dir.empty()) {
    std::fprintf(stderr, "usage: write_test_checkpoint [--bench_rows=N] DIR\n");
    return 2;
  }
  CheckpointData data;
  const bool bench = bench_rows >= 0;
  if (int rc = bench ? Build(kH200Network, bench_rows, std::max<int64_t>(bench_rows, 1), &data)
                     : Build(kTestNetwork, kRows, kCapacity, &data);
      rc != 0) {
    return rc;
  }
  absl::StatusOr<CheckpointWriteResult> written =
      WriteCheckpoint(dir, AutoCheckpointName(data.state.steps), data);
  if (!written.ok()) {
    std::fprintf(stderr, "write_test_checkpoint: %s\n", written.status().ToString().c_str());
    return 1;
  }
  if (!bench) {
    std::printf("%s\n", written->dir.c_str());
    return 0;
  }
  data = CheckpointData{};  // measure the read with the memory a daemon would have free
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<CheckpointData> read = ReadCheckpoint(written->dir);
  const double read_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!read.ok()) {
    std::fprintf(stderr, "write_test_checkpoint: %s\n", read.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "{\"bytes\": %llu, \"write_seconds\": %.3f, \"read_seconds\": %.3f, \"rows\": %lld, \"dir\": \"%s\"}\n",
      static_cast<unsigned long long>(written->bytes), written->seconds, read_seconds,
      static_cast<long long>(read->state.replay.size), written->dir.c_str());
  return 0;
}

}  // namespace
}  // namespace qstream

int main(int argc, char** argv) { return qstream::Main(argc, argv); }
