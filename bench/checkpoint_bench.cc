// `qstream-bench checkpoint`: what one full checkpoint costs on a filled
// replay: the learner-thread snapshot (Backend::SaveState, device -> host),
// the background write (WriteCheckpoint: safetensors + manifest, fsync,
// rename), the verified read (ReadCheckpoint: sizes, CRC32C, shapes) and the
// load into a fresh backend (LoadState). One JSON line, medians of repeats.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bench/bench.h"
#include "nlohmann/json.hpp"
#include "qstream/version.h"
#include "trainer/backends/backend_factory.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"

namespace qstream::bench {
namespace {

struct Flags {
  std::string config = "h200";
  std::string backend = "auto";
  int64_t rows = 1000000;
  int repeats = 3;
  std::string dir;  // default: a fresh directory under /tmp
};

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = absl::StrCat("--", name, "=");
      return absl::StartsWith(a, prefix) ? argv[i] + prefix.size() : nullptr;
    };
    if (const char* v = value("config")) {
      f->config = v;
    } else if (const char* v = value("backend")) {
      f->backend = v;
    } else if (const char* v = value("rows")) {
      if (!absl::SimpleAtoi(v, &f->rows) || f->rows < 0) return false;
    } else if (const char* v = value("repeats")) {
      if (!absl::SimpleAtoi(v, &f->repeats) || f->repeats < 1) return false;
    } else if (const char* v = value("dir")) {
      f->dir = v;
    } else {
      return false;
    }
  }
  return true;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

double Since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int RunCheckpointBench(int argc, char** argv) {
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) {
    std::fprintf(stderr, "usage: qstream-bench checkpoint [--config=h200|small] [--backend=auto|cpu|cuda] "
                         "[--rows=N] [--repeats=R] [--dir=D]\n");
    return 2;
  }
  auto config = BenchConfig(flags.config);
  auto kind = ParseBackendKind(flags.backend);
  if (!config.ok() || !kind.ok()) {
    std::fprintf(stderr, "qstream-bench checkpoint: %s\n",
                 (!config.ok() ? config.status() : kind.status()).ToString().c_str());
    return 2;
  }
  config->mutable_replay()->set_capacity(std::max<int64_t>(flags.rows, config->replay().batch_size()));
  config->mutable_rate_limiter()->set_min_size_to_sample(1);
  auto backend = CreateBackend(*config, *kind);
  auto fresh = CreateBackend(*config, *kind);
  if (!backend.ok() || !fresh.ok()) {
    std::fprintf(stderr, "qstream-bench checkpoint: %s\n",
                 (!backend.ok() ? backend.status() : fresh.status()).ToString().c_str());
    return 1;
  }
  Backend* b = backend->get();
  if (absl::Status s = FillReplay(b, flags.rows, 0.97f, 1); !s.ok()) {
    std::fprintf(stderr, "qstream-bench checkpoint: fill: %s\n", s.ToString().c_str());
    return 1;
  }
  for (int i = 0; i < 10 && flags.rows > 0; ++i) (void)b->Step();  // Adam moments and priorities in use
  const std::string root =
      flags.dir.empty() ? absl::StrCat(std::filesystem::temp_directory_path().string(), "/qstream-ckpt-bench-", getpid())
                        : flags.dir;
  std::vector<double> snapshot_s, write_s, read_s, load_s;
  uint64_t bytes = 0;
  for (int r = 0; r < flags.repeats; ++r) {
    CheckpointData data;
    auto t0 = std::chrono::steady_clock::now();
    if (absl::Status s = b->SaveState(true, &data.state); !s.ok()) {
      std::fprintf(stderr, "qstream-bench checkpoint: snapshot: %s\n", s.ToString().c_str());
      return 1;
    }
    snapshot_s.push_back(Since(t0));
    v1::CheckpointManifest& m = data.manifest;
    m.set_learner_step(data.state.steps);
    m.set_optimizer_step(data.state.applied_updates);
    *m.mutable_config() = *config;
    auto* replay = m.mutable_replay();
    replay->set_included(true);
    replay->set_capacity(data.state.replay.capacity);
    replay->set_size(data.state.replay.size);
    replay->set_cursor(data.state.replay.cursor);
    replay->set_max_priority(data.state.replay.max_priority);
    for (int64_t t : data.state.guard_trips) m.mutable_guard()->add_trips(t);
    m.mutable_guard()->set_consecutive_trips(data.state.consecutive_trips);
    t0 = std::chrono::steady_clock::now();
    auto written = WriteCheckpoint(root, AutoCheckpointName(data.state.steps), data);
    if (!written.ok()) {
      std::fprintf(stderr, "qstream-bench checkpoint: write: %s\n", written.status().ToString().c_str());
      return 1;
    }
    write_s.push_back(Since(t0));
    bytes = written->bytes;
    t0 = std::chrono::steady_clock::now();
    auto read = ReadCheckpoint(written->dir);
    if (!read.ok()) {
      std::fprintf(stderr, "qstream-bench checkpoint: read: %s\n", read.status().ToString().c_str());
      return 1;
    }
    read_s.push_back(Since(t0));
    t0 = std::chrono::steady_clock::now();
    if (absl::Status s = (*fresh)->LoadState(read->state, StateParts::kAll); !s.ok()) {
      std::fprintf(stderr, "qstream-bench checkpoint: load: %s\n", s.ToString().c_str());
      return 1;
    }
    load_s.push_back(Since(t0));
    std::fprintf(stderr, "  repeat %d: snapshot %.3f s, write %.3f s, read %.3f s, load %.3f s, %.1f MB\n", r,
                 snapshot_s.back(), write_s.back(), read_s.back(), load_s.back(), bytes / 1e6);
  }
  if (flags.dir.empty()) std::filesystem::remove_all(root);
  nlohmann::ordered_json j;
  j["bench"] = "checkpoint";
  j["config"] = flags.config;
  j["backend"] = b->name();
  j["device"] = b->device();
  j["replay_rows"] = flags.rows;
  j["bytes"] = bytes;
  j["snapshot_s"] = Median(snapshot_s);
  j["write_s"] = Median(write_s);
  j["read_s"] = Median(read_s);
  j["load_s"] = Median(load_s);
  j["restore_s"] = Median(read_s) + Median(load_s);
  j["repeats"] = flags.repeats;
  j["commit"] = QSTREAM_GIT_COMMIT;
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace qstream::bench
