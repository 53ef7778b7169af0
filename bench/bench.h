// qstream-bench subcommands. Each prints one JSON line per case.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "trainer/backend.h"

namespace qstream::bench {

// What a subcommand's flag setter made of one --name=value.
enum class FlagValue { kOk, kBad, kUnknown };
// Hands each --name=value of argv[1..] to `set`; --help or -h: Cancelled,
// anything else: InvalidArgument naming the flag.
inline absl::Status ParseFlagArgs(
    int argc, char** argv,
    absl::FunctionRef<FlagValue(const std::string& name, const std::string& value)> set) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return absl::CancelledError("help");
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("expected --name=value, got '", arg, "'"));
    }
    const std::string name = arg.substr(2, eq - 2);
    const std::string value = arg.substr(eq + 1);
    switch (set(name, value)) {
      case FlagValue::kOk: break;
      case FlagValue::kBad:
        return absl::InvalidArgumentError(absl::StrCat("--", name, ": bad value '", value, "'"));
      case FlagValue::kUnknown: return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
  }
  return absl::OkStatus();
}

// A subcommand's main: `parse` the flags (on an error or --help: `usage`,
// exit 2 or 0), then `run`; errors go to stderr as "qstream-bench NAME: ...".
template <typename Flags>
int RunSubcommand(const char* name, int argc, char** argv, absl::Status (*parse)(int, char**, Flags*),
                  void (*usage)(), absl::Status (*run)(const Flags&)) {
  Flags flags;
  if (absl::Status s = parse(argc, argv, &flags); !s.ok()) {
    if (!absl::IsCancelled(s))
      std::fprintf(stderr, "qstream-bench %s: %s\n", name, std::string(s.message()).c_str());
    usage();
    return absl::IsCancelled(s) ? 0 : 2;
  }
  if (absl::Status s = run(flags); !s.ok()) {
    std::fprintf(stderr, "qstream-bench %s: %s\n", name, std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}

// Inserts `count` random transitions (normal obs and rewards, 5 % terminal,
// else `discount`), reporting progress on stderr.
absl::Status FillReplay(Backend* backend, int64_t count, float discount, uint64_t seed);
// `qstream-bench checkpoint --config=h200 --backend=cpu|cuda --rows=N --dir=D`:
// snapshot, write, read and load times of one full checkpoint.
int RunCheckpointBench(int argc, char** argv);

// `qstream-bench learner --config=small|h200 --batch=64,256 --backend=cpu|cuda ...`
int RunLearnerBench(int argc, char** argv);
// `qstream-bench ingest --streams=N --seconds=S ...` against an in-process daemon.
int RunIngestBench(int argc, char** argv);
// `qstream-bench load --address=A --items_per_message=N ...`: one client process of
// bench/ingest_compare.py (load streams, acks counted over wall-clock windows).
int RunLoadClient(int argc, char** argv);
// `qstream-bench daemon_config --config=h200`: the bench config as text for qstreamd --config.
int RunDaemonConfig(int argc, char** argv);
// `qstream-bench e2e --backend=cuda --config=h200 ...`: qstreamd as a child
// process, load streams from this process, learner and ingest rates from /metrics.
int RunE2eBench(int argc, char** argv);
// `qstream-bench nstep`: server-side n-step assembly per transition (KIND_STEP).
int RunNStepBench(int argc, char** argv);

}  // namespace qstream::bench
