#!/usr/bin/env bash
# The device call stop 34 prepared for tools/pending/stop34-step-nodes.mbox (never ran: no machine).
# Carry stage.tar.xz (deploy/gpu-stage.sh build stage, with the 32ca07c qstream-bench staged as
# qstream-bench-base via QSTREAM_STAGE_EXTRA) and run from the repository root: bash tools/pending/stop34-device-call.sh
tar -xJf stage.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib
B=stage/bin
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $S 2>&1
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
for t in kernels_gpu_test cuda_backend_gpu_test fused_mlp_gpu_test; do
  timeout 150 $B/$t --gtest_color=no > $OUT/$t.log 2>&1
  echo "== $t rc=$? ($(el) s)" >> $S
  grep -E "^\[  PASSED|^\[  FAILED|tests? ran|Failure" $OUT/$t.log | head -20 >> $S
done
bench() {
  for b in qstream-bench-base qstream-bench; do
    QSTREAM_CUDA_PATH=fused timeout 120 $B/$b learner --backend=cuda --config=h200,small --precision=tf32,bf16 --repeats=3 \
      2>>$OUT/bench.log | sed "s/^{/{\"bin\":\"$b\",\"round\":$1,/" >> $OUT/bench.jsonl
    echo "== bench $b round $1 rc=${PIPESTATUS[0]} ($(el) s)" >> $S
  done
}
bench 1
ncu_run() {
  timeout 60 ncu --clock-control none --graph-profiling node --metrics gpu__time_duration.sum --csv \
    --launch-skip 40 --launch-count 40 $B/qstream-bench learner --backend=cuda --config=$1 \
    --batch=$2 --precision=tf32 --fill=100000 --steps=8 --warmup=0 --repeats=1 > $OUT/ncu_$1.csv 2>&1
  echo "== ncu $1/$2 rc=$? ($(el) s)" >> $S
}
[ $(el) -lt 260 ] && ncu_run small 64
for tool in memcheck racecheck; do
  [ $(el) -gt 280 ] && { echo "== $tool skipped (time)" >> $S; continue; }
  timeout 80 compute-sanitizer --tool $tool --error-exitcode 99 $B/kernels_gpu_test --gtest_color=no \
    --gtest_filter='*AdamPack*:*ReplayCommit*:PrioritySums.*:*Finalize*:PriorityWriteBack.*' >> $OUT/san.log 2>&1
  echo "== $tool kernels rc=$? ($(el) s)" >> $S
  timeout 50 compute-sanitizer --tool $tool --error-exitcode 99 $B/cuda_backend_gpu_test --gtest_color=no \
    --gtest_filter='CudaBackend.InsertsBetweenStepsMatchCpu:CudaBackend.GuardSkipsPoisonedStepInGraph' >> $OUT/san.log 2>&1
  echo "== $tool backend rc=$? ($(el) s)" >> $S
done
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard" $OUT/san.log | sort | uniq -c >> $S
[ $(el) -lt 330 ] && ncu_run h200 1024
[ $(el) -lt 300 ] && bench 2
cat $S
