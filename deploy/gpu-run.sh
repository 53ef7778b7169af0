#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, over a folder staged by
# deploy/gpu-stage.sh: GPU tests, compute-sanitizer (memcheck + racecheck) on
# a few steps, qstream-bench learner on the h200 and small configs and the
# PyTorch peer in the same invocation. Logs go to $OUT (at most 8 files: summary, tests, sanitizer, bench.jsonl, bench.log, peer.jsonl,
# metrics.txt, ncu.csv / demo.log; PROFILE with NCU_SOURCE adds ncu-source.ncu-rep and ncu-source.txt).
# Usage: stage/gpu-run.sh [STAGE_DIR]   (env SKIP_TESTS=1, SKIP_SANITIZER=1, SKIP_PEER=1, SKIP_BENCH=1,
#   (tests include the data-parallel ones: two ranks need a two-GPU kind, else they skip)
#   PATHS="fused cublas" PRECISIONS=fp32,tf32,bf16 CONFIGS=h200,small,
#   PROFILE=1 [NCU_TARGETS="h200/1024" NCU_PRECISION=tf32 NCU_SKIP=25 NCU_COUNT=60 NCU_STEPS=3]: ncu per kernel,
#     [NCU_SOURCE=<kernel regex> NCU_SOURCE_SKIP=20]: and one launch of that kernel with source counters,
#   DEMO=1 [DEMO_SECONDS=60]: qstreamd --backend=cuda + CartPole actors via deploy/demo.sh,
#   METRICS=1: qstreamd --backend=cuda under 5 s of load, its GPU, build and step-time series from /metrics,
#   E2E=1 [E2E_SECONDS=20 E2E_STREAMS=8 E2E_KIND=nstep|step|step_stream]: qstream-bench e2e, qstreamd --backend=cuda under load streams,
#   PDL_AB=1: the bench with programmatic dependent launch off and at its default, alternating (two rounds),
#   BASE=1: with a base build staged as qstream-bench-base / qstreamd-base (gpu-stage.sh QSTREAM_STAGE_EXTRA),
#     the bench runs base and this build alternating (two rounds) and E2E runs the base's daemon first,
#   INGEST=1 [INGEST_PEERS=cpp INGEST_STREAMS=16 INGEST_ITEMS=1,64,1024 INGEST_CLIENTS=1,4 INGEST_SPI=1
#     INGEST_DAEMON_CPUS="all 0-3" INGEST_TIMEOUT=580 (per CPU set)]: bench/ingest_compare.py,
#   qstreamd --backend=cuda, learner running, samples_per_insert 1, B = 1024, `qstream-bench load` client processes)
set -uo pipefail
stage="$(cd "${1:-$(dirname "$0")}" && pwd)"
out="${OUT:-/tmp/qstream-out}"
mkdir -p "$out"
cuda_libs="$(dirname "$(ldconfig -p | awk '/libcublasLt.so.13/ {print $NF; exit}')" 2>/dev/null)"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         "$(python3 -c 'import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__) + "/lib")' 2>/dev/null)"; do
  [[ -e "$d/libcublasLt.so.13" ]] && cuda_libs="$cuda_libs:$d"
done
# The staged binaries find stage/lib by their RUNPATH (deploy/gpu-stage.sh);
# only the machine's own CUDA libraries go on the path, so system tools
# (curl, python3) keep their own libcurl, libssl ...
export LD_LIBRARY_PATH="${cuda_libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NCCL for the data-parallel tests (loaded at run time): the toolkit's or torch's.
export NCCL_NVLS_ENABLE=0
if [[ -z "${NCCL_LIBRARY:-}" ]]; then
  for f in /usr/local/cuda/lib64/libnccl.so.2 \
           "$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) + "/lib/libnccl.so.2")' 2>/dev/null)"; do
    [[ -n "$f" && -e "$f" ]] && { export NCCL_LIBRARY="$f"; break; }
  done
fi
bin="$stage/bin"
summary="$out/summary.txt"
{
  echo "== device"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo "NCCL_LIBRARY=${NCCL_LIBRARY:-none found}"
} > "$summary" 2>&1

if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  for t in kernels_gpu_test fused_mlp_gpu_test cuda_backend_gpu_test; do
    timeout 300 "$bin/$t" --gtest_color=no >> "$out/tests.log" 2>&1
    echo "== $t rc=$?" >> "$summary"
  done
  # The cuBLASLt fallback with its simplest GEMM path stays correct too.
  QSTREAM_CUDA_PATH=cublas QSTREAM_CUDA_EPILOGUES=unfused timeout 120 "$bin/cuda_backend_gpu_test" --gtest_color=no >> "$out/tests.log" 2>&1
  echo "== cuda_backend_gpu_test (QSTREAM_CUDA_PATH=cublas QSTREAM_CUDA_EPILOGUES=unfused) rc=$?" >> "$summary"
  # Two qstreamd ranks on GPUs 0 and 1 (skips on a one-GPU machine).
  if [[ -x "$bin/distributed_gpu_e2e_test" ]]; then
    QSTREAM_BUILD_DIR="$bin" timeout 400 "$bin/distributed_gpu_e2e_test" --gtest_color=no >> "$out/tests.log" 2>&1
    echo "== distributed_gpu_e2e_test rc=$?" >> "$summary"
  fi
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^\[  SKIPPED \]|\[ info \]|tests? ran" "$out/tests.log" >> "$summary"
fi

if [[ "${SKIP_BENCH:-0}" != 1 ]]; then
  echo "== bench" >> "$summary"
  # Both network paths (QSTREAM_CUDA_PATH=auto picks one per network width).
  # With BASE=1 and a base build staged beside this one (QSTREAM_STAGE_EXTRA):
  # base and this build alternating for two rounds. Each line says its "bin".
  bins="qstream-bench"
  rounds=1
  if [[ "${BASE:-0}" == 1 && -x "$bin/qstream-bench-base" ]]; then
    bins="qstream-bench-base qstream-bench"
    rounds=2
  fi
  # PDL_AB=1: each run twice, programmatic dependent launch off
  # (QSTREAM_CUDA_PDL=0) then the default ("pdl" in each line), two rounds.
  pdls="default"
  if [[ "${PDL_AB:-0}" == 1 ]]; then
    pdls="0 default"
    rounds=2
  fi
  for round in $(seq "$rounds"); do
    for b in $bins; do
      for path in ${PATHS:-fused cublas}; do
        for pdl in $pdls; do
          pdl_env=()
          [[ "$pdl" == default ]] || pdl_env=("QSTREAM_CUDA_PDL=$pdl")
          env "${pdl_env[@]}" QSTREAM_CUDA_PATH="$path" timeout 300 "$bin/$b" learner --backend=cuda \
            --config="${CONFIGS:-h200,small}" --precision="${PRECISIONS:-fp32,tf32,bf16}" 2>> "$out/bench.log" |
            sed "s/^{/{\"bin\":\"$b\",\"round\":$round,\"pdl\":\"$pdl\",/" >> "$out/bench.jsonl"
          echo "$b $path pdl $pdl round $round rc=${PIPESTATUS[0]}" >> "$summary"
        done
      done
    done
  done
  cat "$out/bench.jsonl" >> "$summary"
fi

if [[ "${SKIP_PEER:-0}" != 1 ]]; then
  echo "== torch peer" >> "$summary"
  ( cd "$stage/peers" && export PYTHONUNBUFFERED=1 &&
    timeout 240 python3 torch_c51.py eager,graph,compile 256,1024 &&
    QS_PEER_CONFIG=small timeout 180 python3 torch_c51.py eager,graph,compile 64,256 ) \
    > "$out/peer.jsonl" 2>> "$out/bench.log"
  echo "peer rc=$?" >> "$summary"
  cat "$out/peer.jsonl" >> "$summary"
fi

if [[ "${E2E:-0}" == 1 && -x "$bin/qstreamd" ]]; then
  # The learner inside qstreamd while load streams from this host's cores push
  # B=1024 batches; graph-only reference (qstream-bench learner) in the same call.
  # Its JSON line joins bench.jsonl, its progress bench.log (the 8-file limit).
  echo "== e2e" >> "$summary"
  # With BASE=1 and a staged base build: the base's qstreamd (and bench) first.
  variants=""
  [[ "${BASE:-0}" == 1 && -x "$bin/qstreamd-base" && -x "$bin/qstream-bench-base" ]] && variants="-base"
  for v in $variants ""; do
    timeout $(( ${E2E_SECONDS:-20} + 400 )) "$bin/qstream-bench$v" e2e --qstreamd="$bin/qstreamd$v" --backend=cuda \
      --config=h200 --batch=1024 --items_per_message=1024 --streams="${E2E_STREAMS:-8}" \
      --seconds="${E2E_SECONDS:-20}" --kind="${E2E_KIND:-nstep}" > "$out/e2e.tmp" 2>> "$out/bench.log"
    echo "e2e qstreamd$v rc=$?" >> "$summary"
    sed "s/^{/{\"bin\":\"qstreamd$v\",/" "$out/e2e.tmp" | tee -a "$out/bench.jsonl" >> "$summary"
  done
  rm -f "$out/e2e.tmp"
fi

if [[ "${INGEST:-0}" == 1 && -x "$bin/qstreamd" ]]; then
  # Ingest as clients see it (BENCH.md "Ingest", H200-host target): client processes of
  # INGEST_STREAMS streams each; learner paused too when the Python SDK can reach Admin.
  echo "== ingest" >> "$summary"
  # Learner running only: with samples_per_insert 1 a paused learner holds
  # inserts at the limiter's error buffer, so a paused case never finishes.
  # INGEST_DAEMON_CPUS="all 0-3 0-7": one run per CPU set qstreamd is pinned to
  # (the clients get the other cores); INGEST_SPI: samples_per_insert.
  for cpus in ${INGEST_DAEMON_CPUS:-all}; do
    timeout "${INGEST_TIMEOUT:-580}" python3 "$stage/../bench/ingest_compare.py" --build="$bin" --backend=cuda \
      --learner_batch=1024 --samples_per_insert="${INGEST_SPI:-1}" --peers="${INGEST_PEERS:-cpp}" --learner=running \
      --cpp_streams="${INGEST_STREAMS:-16}" --items="${INGEST_ITEMS:-1,64,1024}" --clients="${INGEST_CLIENTS:-1,4}" \
      --daemon_cpus="$cpus" >> "$out/ingest.tmp" 2>> "$out/bench.log"
    echo "ingest daemon_cpus=$cpus rc=$?" >> "$summary"
  done
  grep '^{' "$out/ingest.tmp" >> "$out/bench.jsonl"
  grep -v '^{' "$out/ingest.tmp" >> "$summary"
  rm -f "$out/ingest.tmp"
fi

if [[ "${DEMO:-0}" == 1 && -x "$bin/qstreamd" && -x "$bin/qstream-actor" ]]; then
  # qstreamd --backend=cuda with local CartPole actors, capped in time.
  QSTREAM_BACKEND=cuda QSTREAM_DEMO_TIME_CAP_S="${DEMO_SECONDS:-60}" \
    timeout $(( ${DEMO_SECONDS:-60} + 60 )) bash "$stage/../deploy/demo.sh" "$bin" > "$out/demo.log" 2>&1
  echo "== demo rc=$? (1 = time cap reached before the return target)" >> "$summary"
  grep -E "^qstreamd|^demo:" "$out/demo.log" | tail -n 8 >> "$summary"
fi

if [[ "${METRICS:-0}" == 1 && -x "$bin/qstreamd" ]]; then
  # What /metrics says on the GPU: build info, GPU memory, one step-time
  # observation per step (count == steps), health.
  m="$(mktemp -d)"
  "$bin/qstream-bench" daemon_config --config=h200 --learner_batch=1024 > "$m/h200.pbtxt" 2>/dev/null
  "$bin/qstreamd" --backend=cuda --config="$m/h200.pbtxt" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
    --samples_per_insert=0 > "$m/qstreamd.log" 2>&1 &
  qpid=$!
  for _ in $(seq 60); do grep -q "listening grpc=" "$m/qstreamd.log" && break; sleep 1; done
  addr=$(grep -o "grpc=[0-9.:]*" "$m/qstreamd.log" | head -1 | cut -d= -f2)
  mport=$(grep -o "metrics=127.0.0.1:[0-9]*" "$m/qstreamd.log" | head -1 | cut -d: -f2)
  timeout 60 "$bin/qstream-bench" load --address="$addr" --config=h200 --streams=8 --items_per_message=1024 \
    --window_seconds=5 --repeats=1 > "$m/load.jsonl" 2>> "$m/load.log"
  sleep 2
  curl -s --noproxy "*" "127.0.0.1:$mport/metrics" > "$m/metrics.txt" || echo "curl rc=$?" >> "$summary"
  kill -TERM "$qpid"; wait "$qpid"
  cp "$m/metrics.txt" "$out/metrics.txt"
  tail -n 30 "$m/qstreamd.log" >> "$out/metrics.txt"
  {
    echo "== metrics (qstreamd --backend=cuda, 5 s of 8 x 1024 load)"
    grep -E "^qstream_gpu_memory|^qstream_build_info|^qstream_train_step_seconds_(count|sum)|^qstream_train_steps_total|^qstream_serving|^qstream_train_step_seconds_bucket" "$m/metrics.txt"
    grep -E "health|stopped after| E qstreamd| C qstreamd" "$m/qstreamd.log" | head
    head -c 600 "$m/load.jsonl"; echo
  } >> "$summary"
  rm -rf "$m"
fi

if [[ "${PROFILE:-0}" == 1 ]]; then
  # Per-kernel device time of a few steps (graph nodes profiled one by one),
  # for each NCU_TARGETS entry config/batch (e.g. "small/64 h200/1024"), all
  # into ncu.csv (the 8-file limit), each block headed by its target.
  for target in ${NCU_TARGETS:-h200/1024}; do
    echo "== ncu ${target} ${NCU_PRECISION:-tf32}" >> "$out/ncu.csv"
    timeout 240 ncu --clock-control none --graph-profiling node --metrics gpu__time_duration.sum --csv \
      --launch-skip "${NCU_SKIP:-25}" --launch-count "${NCU_COUNT:-60}" \
      "$bin/qstream-bench" learner --backend=cuda --config="${target%/*}" --batch="${target#*/}" \
      --precision="${NCU_PRECISION:-tf32}" --fill=100000 --steps="${NCU_STEPS:-3}" --warmup=0 --repeats=1 >> "$out/ncu.csv" 2>&1
    echo "== ncu ${target} rc=$?" >> "$summary"
  done
  # NCU_SOURCE=<kernel name regex>: one launch of the first matching kernel
  # (after NCU_SOURCE_SKIP matching ones) at the first NCU_TARGETS entry, with
  # the full section set and the source counters: the report
  # (ncu-source.ncu-rep, for ncu-ui) and its source page as text (SASS with
  # the stall samples per instruction; the CUDA lines come from -lineinfo).
  if [[ -n "${NCU_SOURCE:-}" ]]; then
    targets=(${NCU_TARGETS:-h200/1024})
    target="${targets[0]}"
    src="$out/ncu-source.txt"
    echo "== ncu source ${NCU_SOURCE} ${target} ${NCU_PRECISION:-tf32}" >> "$src"
    timeout 300 ncu --clock-control none --graph-profiling node --set full --import-source yes \
      --kernel-name "regex:${NCU_SOURCE}" --launch-skip "${NCU_SOURCE_SKIP:-20}" --launch-count 1 \
      --export "$out/ncu-source" --force-overwrite \
      "$bin/qstream-bench" learner --backend=cuda --config="${target%/*}" --batch="${target#*/}" \
      --precision="${NCU_PRECISION:-tf32}" --fill=100000 --steps=40 --warmup=0 --repeats=1 >> "$src" 2>&1
    echo "== ncu source ${NCU_SOURCE} ${target} rc=$?" >> "$summary"
    if ! ncu --import "$out/ncu-source.ncu-rep" --page source --csv --print-source sass >> "$src" 2>&1; then
      ncu --import "$out/ncu-source.ncu-rep" --page details >> "$src" 2>&1
    fi
  fi
fi

if [[ "${SKIP_SANITIZER:-0}" != 1 ]]; then
  san="$out/sanitizer.log"
  for tool in memcheck racecheck; do
    # The group test runs NCCL, whose communicator set-up probes kernel images of
    # other architectures (cudaFuncGetAttributes -> cudaErrorNoKernelImageForDevice,
    # handled inside NCCL): API errors are not reported for it, memory errors are.
    for spec in "kernels_gpu_test:*" "fused_mlp_gpu_test:*Odd*:*Deep*" "cuda_backend_gpu_test:CudaBackend.StatsAndStepTimesArriveWithoutBlocking:CudaBackend.GuardSkipsPoisonedStepInGraph:*TwentyStepsWithLossOptions*FP32*" "cuda_backend_gpu_test:DistributedCuda.GroupOfOneEqualsPlainStep"; do
      t="${spec%%:*}"; filter="${spec#*:}"
      api=all
      [[ "$filter" == DistributedCuda.* ]] && api=no
      echo "=== $tool $t $filter (api errors: $api)" >> "$san"
      timeout 200 compute-sanitizer --tool "$tool" --report-api-errors "$api" --error-exitcode 99 "$bin/$t" \
        --gtest_color=no --gtest_filter="$filter" >> "$san" 2>&1
      echo "=== $tool $t rc=$?" >> "$san"
    done
  done
  echo "== sanitizer" >> "$summary"
  grep -E "^=== |ERROR SUMMARY|RACECHECK SUMMARY" "$san" >> "$summary"
fi
cat "$summary"
