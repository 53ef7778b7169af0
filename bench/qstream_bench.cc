// qstream-bench: `qstream-bench <learner|ingest|e2e|checkpoint|load|daemon_config> [--flags]`; each
// subcommand prints one JSON line per case on stdout (progress goes to stderr).
#include <cstdio>
#include <cstring>

#include "bench/bench.h"
#include "common/log.h"

namespace {

void Usage(const char* argv0) {
  std::fprintf(
      stderr,
      "usage: %s learner [--config=small,h200] [--batch=64,256] [--backend=auto|cpu|cuda]\n"
      "                  [--steps=N] [--repeats=R] [--warmup=W] [--fill=N]\n"
      "                  [--peak_tflops=T] [--peak_gbps=G]\n"
      "       %s ingest [flags]   (see `%s ingest --help`)\n"
      "       %s e2e [flags]      (qstreamd child process + load streams; see `%s e2e --help`)\n"
      "       %s checkpoint [--config=h200] [--backend=auto|cpu|cuda] [--rows=1000000] [--dir=D]\n"
      "                  [--repeats=3]\n"
      "       %s load [flags]     (one client process of bench/ingest_compare.py; `%s load --help`)\n"
      "       %s daemon_config [--config=h200] [--learner_batch=N]   (text TrainerConfig for qstreamd)\n"
      "       %s nstep [--envs=1024] [--obs_dim=48] ...   (server-side n-step assembly per transition)\n",
      argv0, argv0, argv0, argv0, argv0, argv0, argv0, argv0, argv0, argv0);
}

}  // namespace

#if QSTREAM_BENCH_NO_INGEST
// Built without bench/ingest_bench.cc or the server library.
int qstream::bench::RunIngestBench(int, char**) {
  std::fprintf(
      stderr,
      "qstream-bench ingest: not built (needs bench/ingest_bench.cc and the qstream_server library)\n");
  return 2;
}
int qstream::bench::RunE2eBench(int, char**) {
  std::fprintf(stderr, "qstream-bench e2e: not built (needs the qstream_server library)\n");
  return 2;
}
int qstream::bench::RunLoadClient(int, char**) {
  std::fprintf(stderr, "qstream-bench load: not built (needs the qstream_server library)\n");
  return 2;
}
int qstream::bench::RunNStepBench(int, char**) {
  std::fprintf(stderr, "qstream-bench nstep: not built (needs the qstream_server library)\n");
  return 2;
}
int qstream::bench::RunDaemonConfig(int, char**) {
  std::fprintf(stderr, "qstream-bench daemon_config: not built (needs the qstream_server library)\n");
  return 2;
}
#endif

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    Usage(argv[0]);
    return argc < 2 ? 2 : 0;
  }
  // Log lines of an in-process daemon go to stderr, away from the JSON lines.
  (void)qstream::InitLogging("text");
  // Subcommands see their own name as argv[0].
  if (std::strcmp(argv[1], "learner") == 0) return qstream::bench::RunLearnerBench(argc - 1, argv + 1);
  if (std::strcmp(argv[1], "ingest") == 0) return qstream::bench::RunIngestBench(argc - 1, argv + 1);
  if (std::strcmp(argv[1], "e2e") == 0) return qstream::bench::RunE2eBench(argc - 1, argv + 1);
  if (std::strcmp(argv[1], "load") == 0) return qstream::bench::RunLoadClient(argc - 1, argv + 1);
  if (std::strcmp(argv[1], "daemon_config") == 0) return qstream::bench::RunDaemonConfig(argc - 1, argv + 1);
  if (std::strcmp(argv[1], "nstep") == 0) return qstream::bench::RunNStepBench(argc - 1, argv + 1);
  if (std::strcmp(argv[1], "checkpoint") == 0) return qstream::bench::RunCheckpointBench(argc - 1, argv + 1);
  std::fprintf(stderr, "qstream-bench: unknown subcommand '%s'\n", argv[1]);
  Usage(argv[0]);
  return 2;
}
