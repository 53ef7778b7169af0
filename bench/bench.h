// qstream-bench subcommands. Each prints one JSON line per case.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "trainer/backend.h"

namespace qstream::bench {

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

}  // namespace qstream::bench
