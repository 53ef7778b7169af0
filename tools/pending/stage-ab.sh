#!/usr/bin/env bash
# Builds and stages an A/B of every pending patch for one device call:
# main's qstream-bench and qstreamd as the base, then each patch in
# tools/pending (in name order, so in the order they were written) applied
# with `git am` on a new branch and its qstream-bench built and kept, then
# the full build of them all staged by deploy/gpu-stage.sh with the earlier
# benches beside it. Prints the gpu-run.sh settings that run them in turn.
#
# Usage: tools/pending/stage-ab.sh [BUILD_DIR=build] [STAGE_DIR=stage]
#   (a clean work tree on main; leaves the branch pending-ab checked out;
#   `git checkout main` returns, `git branch -D pending-ab` forgets it)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="$(realpath -m "${1:-$root/build}")"
stage="$(realpath -m "${2:-$root/stage}")"
cd "$root"
if [[ -n "$(git status --porcelain --untracked-files=no)" ]]; then
  echo "stage-ab.sh: the work tree has uncommitted changes; commit or stash them first" >&2
  exit 1
fi
[[ -d "$build" ]] || { echo "stage-ab.sh: no build folder $build (configure it first, README)" >&2; exit 1; }
shopt -s nullglob
patches=(tools/pending/*.mbox)
[[ ${#patches[@]} -gt 0 ]] || { echo "stage-ab.sh: no pending patches" >&2; exit 1; }
keep="$(mktemp -d /tmp/stage-ab.XXXXXX)"
for p in "${patches[@]}"; do cp "$p" "$keep/"; done

echo "stage-ab.sh: base ($(git rev-parse --short HEAD))" >&2
ninja -C "$build" qstream-bench qstreamd
mkdir -p "$keep/base"
cp "$build/qstream-bench" "$keep/base/"
for d in "$build/qstreamd" "$build/server/qstreamd"; do
  if [[ -x "$d" ]]; then cp "$d" "$keep/base/qstreamd"; break; fi
done
[[ -x "$keep/base/qstreamd" ]] || { echo "stage-ab.sh: no qstreamd in $build" >&2; exit 1; }
extra="qstream-bench-base=$keep/base/qstream-bench qstreamd-base=$keep/base/qstreamd"
bins=""

git checkout -q -b pending-ab
last=$((${#patches[@]} - 1))
for i in "${!patches[@]}"; do
  name="$(basename "${patches[$i]}" .mbox)"
  echo "stage-ab.sh: applying $name" >&2
  git am -q "$keep/$name.mbox"
  if [[ $i -lt $last ]]; then
    ninja -C "$build" qstream-bench
    short="${name%%-*}"  # e.g. stop36
    mkdir -p "$keep/$short"
    cp "$build/qstream-bench" "$keep/$short/"
    extra="$extra qstream-bench-$short=$keep/$short/qstream-bench"
    bins="$bins qstream-bench-$short"
  fi
done
echo "stage-ab.sh: the full build with every patch" >&2
ninja -C "$build"
QSTREAM_STAGE_EXTRA="$extra" "$root/deploy/gpu-stage.sh" "$build" "$stage"
echo "stage-ab.sh: staged in $stage; on the device, for the A/B in one call:"
echo "  SKIP_TESTS=1 SKIP_SANITIZER=1 SKIP_PEER=1 BASE=1 BASE_BINS=\"${bins# }\" PATHS=fused PRECISIONS=tf32,bf16 stage/gpu-run.sh stage"
echo "  (first the GPU tests and the sanitizers: stage/gpu-run.sh stage with SKIP_BENCH=1 SKIP_PEER=1)"
