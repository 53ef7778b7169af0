#!/usr/bin/env bash
# Device-side: the full bench (both paths, three precisions) with the torch peer via
# gpu-run.sh, then per-kernel ncu times and warp-stall reasons of the fused kernels.
# Run from the repository root over a folder staged by deploy/gpu-stage.sh (stage/).
cd stage && SKIP_TESTS=1 SKIP_SANITIZER=1 OUT=$OUT timeout 520 bash gpu-run.sh . > /dev/null 2>&1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64  # staged binaries find lib/ by RUNPATH
for cfg in "h200 1024 tf32" "h200 1024 bf16" "small 256 tf32"; do set -- $cfg
 QSTREAM_CUDA_PATH=fused timeout 60 ncu --clock-control none --graph-profiling node --kernel-name regex:"Chain|Grad|Pack|Loss|Sample|Gather|Finalize|Adam|Scan|Normalize" --launch-skip 12 --launch-count 12 --metrics gpu__time_duration.sum --csv bin/qstream-bench learner --backend=cuda --config=$1 --batch=$2 --precision=$3 --fill=50000 --steps=3 --warmup=0 --repeats=1 2>&1 | grep gpu__time | awk -F'","' -v c="$cfg" '{print c " | " $5 " | " $NF}' >> $OUT/ncu.txt
done
grep -E "rc=" $OUT/summary.txt; python3 -c "
import json
for f in ['$OUT/bench.jsonl','$OUT/peer.jsonl']:
  for l in open(f):
    try: d=json.loads(l)
    except: continue
    print(json.dumps({k:d.get(k) for k in ('config','batch','precision','device','us_per_step','mode','variant','median_us','us')})[:230])"; cut -c1-140 $OUT/ncu.txt
m=""; for r in barrier long_scoreboard short_scoreboard wait mio_throttle lg_throttle math_pipe_throttle not_selected selected dispatch_stall no_instruction branch_resolving; do m="$m,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
QSTREAM_CUDA_PATH=fused timeout 80 ncu --clock-control none --graph-profiling node --kernel-name regex:"FusedChain|WeightGrad|C51Loss" --launch-skip 0 --launch-count 4 --metrics "gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active${m}" bin/qstream-bench learner --backend=cuda --config=h200 --batch=1024 --precision=tf32 --fill=50000 --steps=3 --warmup=0 --repeats=1 > $OUT/ncu_stalls.txt 2>&1
grep -E "FusedChain|WeightGrad|C51Loss|stalled|inst_executed|duration" $OUT/ncu_stalls.txt | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | awk '{$1=$1; print}' | cut -c1-110
