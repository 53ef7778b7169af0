#!/usr/bin/env bash
# `make demo`: qstreamd plus a few local C++ actors learning CartPole.
#
#   ./deploy/demo.sh [BUILD_DIR]
#
# Starts the daemon with deploy/demo.pbtxt on free loopback ports, starts the
# actors, prints progress every few seconds (learner steps/s, replay size,
# transitions, mean return of the last 20 episodes per actor) and stops when an
# actor's mean return reaches the target (exit 0), or on the time/step cap
# (exit 1). Everything it started is stopped on exit, whatever the cause.
#
# Knobs (environment): QSTREAM_DEMO_TARGET (475), QSTREAM_DEMO_ACTORS (2),
# QSTREAM_DEMO_ENVS (envs per actor, 4), QSTREAM_DEMO_TIME_CAP_S (900),
# QSTREAM_DEMO_STEP_CAP (env steps per actor, 1000000), QSTREAM_BACKEND
# (auto|cpu|cuda), QSTREAM_DEMO_CONFIG (TrainerConfig file),
# QSTREAM_DEMO_REPORT_S (seconds between lines, 2), QSTREAM_DEMO_KEEP_LOGS
# (1: keep the log folder).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$(realpath -m "${1:-$ROOT/build}")"
CONFIG="${QSTREAM_DEMO_CONFIG:-$ROOT/deploy/demo.pbtxt}"
TARGET="${QSTREAM_DEMO_TARGET:-475}"
NUM_ACTORS="${QSTREAM_DEMO_ACTORS:-2}"
ENVS_PER_ACTOR="${QSTREAM_DEMO_ENVS:-4}"
TIME_CAP_S="${QSTREAM_DEMO_TIME_CAP_S:-900}"
STEP_CAP="${QSTREAM_DEMO_STEP_CAP:-1000000}"
BACKEND="${QSTREAM_BACKEND:-auto}"
EPS_DECAY="${QSTREAM_DEMO_EPS_DECAY:-10000}"
REPORT_S="${QSTREAM_DEMO_REPORT_S:-2}"

if [ ! -x "$BUILD/qstreamd" ] || [ ! -x "$BUILD/qstream-actor" ]; then
  echo "demo: building qstreamd and qstream-actor in $BUILD"
  if [ ! -f "$BUILD/build.ninja" ]; then
    cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
  fi
  cmake --build "$BUILD" --target qstreamd qstream-actor
fi

WORK="$(mktemp -d -t qstream-demo.XXXXXX)"
DAEMON_PID=""
ACTOR_PIDS=()

# Stops a process we started: SIGTERM, then SIGKILL if it outlives the grace.
stop_pid() {
  local pid=$1 grace=$2
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq $((grace * 10))); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "demo: pid $pid ignored SIGTERM; killing it"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  local pid
  for pid in "${ACTOR_PIDS[@]}"; do stop_pid "$pid" 5; done
  if [ -n "$DAEMON_PID" ]; then stop_pid "$DAEMON_PID" 15; fi
  if [ "${QSTREAM_DEMO_KEEP_LOGS:-0}" = "1" ]; then
    echo "demo: logs kept in $WORK"
  else
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT
trap 'echo "demo: interrupted"; exit 130' INT TERM

"$BUILD/qstreamd" --config="$CONFIG" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
  --backend="$BACKEND" >"$WORK/qstreamd.log" 2>&1 &
DAEMON_PID=$!

GRPC="" METRICS=""
for _ in $(seq 600); do
  line="$(grep -m1 -o 'listening grpc=[^ ]* metrics=[^ ]*' "$WORK/qstreamd.log" || true)"
  if [ -n "$line" ]; then
    GRPC="$(sed 's/.*grpc=\([^ ]*\).*/\1/' <<<"$line")"
    METRICS="$(sed 's/.*metrics=\([^ ]*\).*/\1/' <<<"$line")"
    break
  fi
  if ! kill -0 "$DAEMON_PID" 2>/dev/null; then
    echo "demo: qstreamd exited early:"; cat "$WORK/qstreamd.log"; exit 1
  fi
  sleep 0.1
done
if [ -z "$GRPC" ]; then echo "demo: qstreamd did not start:"; cat "$WORK/qstreamd.log"; exit 1; fi
grep -m1 '^qstreamd' "$WORK/qstreamd.log" || true

for i in $(seq "$NUM_ACTORS"); do
  # Ape-X style: each actor settles at its own exploration rate.
  eps_end=$(awk -v i="$i" 'BEGIN { printf "%.3f", (i == 1) ? 0.01 : 0.01 * 2 ^ (i - 1) }')
  "$BUILD/qstream-actor" --server="$GRPC" --env=CartPole --num_envs="$ENVS_PER_ACTOR" --seed="$i" \
    --steps="$STEP_CAP" --stop_at_return="$TARGET" --epsilon_start=1 --epsilon_end="$eps_end" \
    --epsilon_decay_steps="$EPS_DECAY" --report_every_s="$REPORT_S" >"$WORK/actor$i.log" 2>&1 &
  ACTOR_PIDS+=($!)
done
echo "demo: qstreamd grpc=$GRPC metrics=http://$METRICS/metrics; $NUM_ACTORS actors x $ENVS_PER_ACTOR CartPole envs;" \
  "target: mean return of the last 20 episodes >= $TARGET (cap ${TIME_CAP_S}s)"

metric() {  # metric NAME: value of an unlabelled sample, or 0
  awk -v m="$1" '$1 == m { print $2; found = 1 } END { if (!found) print 0 }' "$WORK/metrics.txt"
}

# Checks every actor and the daemon; sets `result` when the run is over.
check_processes() {
  local idx pid rc i
  if ! kill -0 "$DAEMON_PID" 2>/dev/null; then
    echo "demo: qstreamd died:"; tail -n 20 "$WORK/qstreamd.log"; result=fail; return
  fi
  for idx in "${!ACTOR_PIDS[@]}"; do
    pid=${ACTOR_PIDS[$idx]}
    kill -0 "$pid" 2>/dev/null && continue
    rc=0
    wait "$pid" || rc=$?
    i=$((idx + 1))
    if [ "$rc" -eq 0 ] && grep -q '^reached ' "$WORK/actor$i.log"; then
      echo "demo: actor $i: $(grep '^reached ' "$WORK/actor$i.log" | tail -n1)"
      result=ok
    else
      echo "demo: actor $i exited with status $rc:"; tail -n 5 "$WORK/actor$i.log"
      result=fail
    fi
    return
  done
}

seconds_since() { awk -v a="$(date +%s.%N)" -v b="$1" 'BEGIN { printf "%.1f", a - b }'; }

START=$(date +%s.%N)
prev_steps=0
prev_t=$START
next_report=$REPORT_S
result=""
while [ -z "$result" ]; do
  sleep 0.5
  check_processes
  [ -n "$result" ] && break
  elapsed=$(seconds_since "$START")
  if awk -v e="$elapsed" -v c="$TIME_CAP_S" 'BEGIN { exit !(e >= c) }'; then
    echo "demo: time cap ${TIME_CAP_S}s reached before a mean return of $TARGET"
    result=fail
    break
  fi
  awk -v e="$elapsed" -v n="$next_report" 'BEGIN { exit !(e >= n) }' || continue
  next_report=$((next_report + REPORT_S))

  now=$(date +%s.%N)
  if ! curl -sf --max-time 2 "http://$METRICS/metrics" >"$WORK/metrics.txt"; then : >"$WORK/metrics.txt"; fi
  steps=$(metric qstream_train_steps_total)
  replay=$(metric qstream_replay_size)
  ingested=$(metric qstream_transitions_ingested_total)
  version=$(metric qstream_policy_version)
  rate=$(awk -v s="$steps" -v p="$prev_steps" -v a="$now" -v b="$prev_t" 'BEGIN { printf "%.0f", (s - p) / (a - b) }')
  prev_steps=$steps
  prev_t=$now
  returns=""
  for i in $(seq "$NUM_ACTORS"); do
    last="$(grep -E '^(progress|reached|done) ' "$WORK/actor$i.log" | tail -n1 || true)"
    r="$(grep -o 'mean_return_20=[^ ]*' <<<"$last" | cut -d= -f2 || true)"
    returns+="${r:--} "
  done
  printf '[%5.0fs] learner %7.0f steps (%5s/s)  transitions %8.0f  replay %6.0f  policy v%-5.0f mean return (last 20) per actor: %s\n' \
    "$elapsed" "$steps" "$rate" "$ingested" "$replay" "$version" "$returns"
done

if [ "$result" = ok ]; then
  if ! curl -sf --max-time 2 "http://$METRICS/metrics" >"$WORK/metrics.txt"; then : >"$WORK/metrics.txt"; fi
  echo "demo: mean return over the last 20 episodes reached $TARGET after $(seconds_since "$START")s" \
    "($(metric qstream_train_steps_total) learner steps, $(metric qstream_transitions_ingested_total) transitions)"
fi
[ "$result" = ok ]
