#!/usr/bin/env bash
# Runs each fuzz target for SECONDS on a copy of its committed seed corpus
# (BUILD/fuzz-corpus/<target>, which keeps what earlier runs found; the
# committed fuzz/corpus is never written) and prints, per target, the
# executions, the corpus size and whether it found anything. Exit status 1
# when any target found a crash, leak, UB, timeout or out-of-memory; the
# input that triggered it is BUILD/fuzz-artifacts/<target>-*.
#
#   fuzz/run.sh BUILD SECONDS TARGET...
set -uo pipefail
cd "$(dirname "$0")/.."
build=$1 seconds=$2
shift 2

found=0
summary=()
for t in "$@"; do
  corpus=$build/fuzz-corpus/$t
  artifacts=$build/fuzz-artifacts
  log=$build/fuzz-$t.log
  mkdir -p "$corpus" "$artifacts"
  cp -n fuzz/corpus/"$t"/* "$corpus"/
  dict=()
  if [ -f fuzz/"$t".dict ]; then dict=(-dict=fuzz/"$t".dict); fi
  echo "fuzz: $t for ${seconds}s (log: $log)"
  "$build"/fuzz/"$t"_fuzzer "$corpus" "${dict[@]}" -max_total_time="$seconds" -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$artifacts/$t-" >"$log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  files=$(find "$corpus" -type f | wc -l)
  kib=$(find "$corpus" -type f -printf '%s\n' | awk '{s += $1} END {printf "%d", s / 1024}')
  if [ $rc -eq 0 ]; then
    result="nothing found"
  else
    found=1
    result="FOUND (exit $rc): $(grep -m1 -E '^==[0-9]+==ERROR|^SUMMARY|FUZZ_CHECK|runtime error|ERROR: libFuzzer' "$log")"
    tail -40 "$log"
  fi
  summary+=("$(printf '%-17s %12s execs  corpus %5s files %6s KiB  %s' "$t" "${execs:-?}" "$files" "$kib" "$result")")
done
echo "fuzz summary (${seconds}s per target):"
printf '  %s\n' "${summary[@]}"
exit $found
