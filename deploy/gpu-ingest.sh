#!/bin/bash
# Ingest on the GPU host (issue 13's H200 targets), one device call:
#   bash deploy/gpu-ingest.sh STAGE     (STAGE from deploy/gpu-stage.sh; logs under $OUT)
# 1. the CUDA tests of the replay upload (InsertMany) and compute-sanitizer memcheck on them;
# 2. the learner's graph-only step rate (h200, B = 1024), the idle reference;
# 3. `qstream-bench ingest` (in-process daemon, CUDA backend, h200, B = 1024): 16 streams x 1024
#    transitions with samples_per_insert 1 and 0, 64 streams x 1 transition with 0 at
#    SMALL_IN_FLIGHT (default 1 8 32) batches in flight per stream and with 1 at 32, 64 x 64;
# 4. `qstream-bench e2e` (qstreamd child process, 8 streams x 1024, 20 s: learner steps/s against
#    the graph-only rate while ingesting);
# 5. bench/ingest_compare.py: qstreamd as its own process, `qstream-bench load` client processes,
#    daemon CPU per message and per transition from /proc (INGEST_COMPARE=0 skips it).
set -uo pipefail
stage="$(cd "${1:-stage}" && pwd)"
out="${OUT:-/tmp/qstream-out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # staged binaries find lib/ by RUNPATH
bin="$stage/bin"
summary="$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$summary" 2>&1
nproc >> "$summary"

timeout 300 "$bin/cuda_backend_gpu_test" --gtest_color=no > "$out/tests.log" 2>&1
echo "== cuda_backend_gpu_test rc=$?" >> "$summary"
grep -E "^\[  (PASSED|FAILED) " "$out/tests.log" >> "$summary"
if [[ "${MEMCHECK:-1}" == 1 ]] && command -v compute-sanitizer > /dev/null; then
  timeout 200 compute-sanitizer --tool memcheck --leak-check full "$bin/cuda_backend_gpu_test" \
    --gtest_filter='*InsertMany*:*SaveLoad*' > "$out/memcheck.log" 2>&1
  echo "== memcheck rc=$? $(grep -c 'ERROR SUMMARY: 0 errors' "$out/memcheck.log") clean summaries" >> "$summary"
fi

timeout 120 "$bin/qstream-bench" learner --backend=cuda --config=h200 --batch=1024 >> "$out/bench.jsonl" 2>> "$out/bench.log"
echo "== learner rc=$?" >> "$summary"
run_ingest() {
  timeout 120 "$bin/qstream-bench" ingest --backend=cuda --config=h200 --learner_batch=1024 --seconds=4 \
    --repeats=3 --warmup_seconds=2 --idle_seconds=4 "$@" >> "$out/bench.jsonl" 2>> "$out/bench.log"
  echo "== ingest $* rc=$?" >> "$summary"
}
run_ingest --streams=16 --batch=1024 --samples_per_insert=1
run_ingest --streams=16 --batch=1024 --samples_per_insert=0
# 1-transition messages: one batch in flight per stream (the old contract) and pipelined.
for window in ${SMALL_IN_FLIGHT:-1 8 32}; do
  run_ingest --streams=64 --batch=1 --samples_per_insert=0 --in_flight="$window"
done
run_ingest --streams=64 --batch=1 --samples_per_insert=1 --in_flight=32
run_ingest --streams=64 --batch=64 --samples_per_insert=0
timeout 120 "$bin/qstream-bench" e2e --backend=cuda --config=h200 --batch=1024 --streams=8 \
  --items_per_message=1024 --seconds=20 >> "$out/bench.jsonl" 2>> "$out/bench.log"
echo "== e2e rc=$?" >> "$summary"

if [[ "${INGEST_COMPARE:-1}" == 1 ]]; then
  # Learner running only: with samples_per_insert 1 a paused learner holds inserts at the
  # limiter's error buffer (README --start_paused), so a paused case never finishes.
  timeout 400 python3 bench/ingest_compare.py --build="$bin" --backend=cuda --learner_batch=1024 \
    --samples_per_insert=1 --peers=cpp --learner=running --cpp_streams=16 --items=1,1024 \
    --clients=1,4 --table="$out/ingest_table.md" > "$out/ingest_compare.jsonl" 2>> "$out/bench.log"
  echo "== ingest_compare rc=$?" >> "$summary"
fi
tail -n 40 "$out/bench.log" > "$out/bench_tail.log"
