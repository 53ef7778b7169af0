// qstream-bench subcommands. Each prints one JSON line per case.
#pragma once

namespace qstream::bench {

// `qstream-bench learner --config=small|h200 --batch=64,256 --backend=cpu|cuda ...`
int RunLearnerBench(int argc, char** argv);
// `qstream-bench ingest --streams=N --seconds=S ...` against an in-process daemon.
int RunIngestBench(int argc, char** argv);

}  // namespace qstream::bench
