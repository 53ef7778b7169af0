#!/usr/bin/env bash
# clang-format and clang-tidy (warnings are errors) on the changed C++ code.
#
#   tools/lint-changed.sh [--full | --all] [BASE]
#
# The changed code is `git diff BASE` (the working tree against BASE, so local
# edits count) plus untracked, not ignored files. By default only the changed
# lines are checked: a finding on a line the change did not touch is not
# reported, so editing a file that is not yet clean does not fail on old code.
#   --full  check the changed files as a whole
#   --all   check every tracked C++ file as a whole (the state of the tree)
#
# BASE, in this order: the argument; $LINT_BASE; the merge-base of HEAD with
# origin/main when that remote branch exists and HEAD is not on it; else
# HEAD~1, i.e. the files of HEAD's own commit (CI on a checkout of main).
# With none of these (root commit, shallow clone of depth 1, no git) the lint
# is skipped with a message; LINT_STRICT=1 makes that an error.
#
# Files: *.cc *.h *.cu *.cuh. clang-format-14 --dry-run -Werror on all of
# them. clang-tidy-14 -p $BUILD_DIR on the changed .cc files that are in
# $BUILD_DIR/compile_commands.json, and for a changed header on the .cc of the
# same name (or else one that includes it), reporting only the changed lines of
# the changed files. CUDA (.cu, .cuh) gets clang-format only: clang-tidy does
# not understand nvcc's flags. A .cc file the build does not compile (the CUDA
# backend's host code without nvcc, fuzz/ without QSTREAM_FUZZ) gets
# clang-format only and is listed as such.
#
# Environment: BUILD_DIR (default build; must be configured and have its
# generated headers, i.e. run after the build), JOBS (clang-tidy processes,
# default 2), CLANG_FORMAT, CLANG_TIDY (default clang-format-14, clang-tidy-14).
# Exit status: 0 clean (or skipped), 1 findings, 2 usage or setup error.
set -euo pipefail

CLANG_FORMAT=${CLANG_FORMAT:-clang-format-14}
CLANG_TIDY=${CLANG_TIDY:-clang-tidy-14}
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}
mode=lines
base=""
while [ $# -gt 0 ]; do
  case "$1" in
    --full) mode=full ;;
    --all) mode=all ;;
    -h | --help) sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "lint: unknown option $1" >&2; exit 2 ;;
    *) base="$1" ;;
  esac
  shift
done

skip() {
  echo "lint: SKIPPED: $1" >&2
  if [ "${LINT_STRICT:-0}" = "1" ]; then exit 2; fi
  exit 0
}

if ! root=$(git rev-parse --show-toplevel 2>/dev/null); then skip "not a git checkout"; fi
cd "$root"
for tool in "$CLANG_FORMAT" "$CLANG_TIDY"; do
  command -v "$tool" >/dev/null || { echo "lint: $tool not found (deploy/install-deps.sh installs it)" >&2; exit 2; }
done
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$root/$BUILD_DIR" ;; esac

is_cxx() { case "$1" in *.cc | *.h | *.cu | *.cuh) return 0 ;; *) return 1 ;; esac; }

# ---- which files, which lines -----------------------------------------------
declare -A ranges=()  # file -> "a:b a:b ..." (empty: the whole file)
files=()
if [ "$mode" = all ]; then
  base="(none: every tracked file)"
  while IFS= read -r f; do [ -f "$f" ] && files+=("$f") && ranges[$f]=""; done \
    < <(git ls-files -- '*.cc' '*.h' '*.cu' '*.cuh')
else
  if [ -z "$base" ]; then base=${LINT_BASE:-}; fi
  if [ -z "$base" ] && git rev-parse -q --verify origin/main >/dev/null; then
    mb=$(git merge-base HEAD origin/main 2>/dev/null || true)
    if [ -n "$mb" ] && [ "$mb" != "$(git rev-parse HEAD)" ]; then base=$mb; fi
  fi
  if [ -z "$base" ] && git rev-parse -q --verify 'HEAD~1^{commit}' >/dev/null; then base=HEAD~1; fi
  [ -n "$base" ] || skip "no base to diff against (root commit or shallow clone); set LINT_BASE or pass BASE"
  git rev-parse -q --verify "$base^{commit}" >/dev/null || { echo "lint: base $base is not a commit" >&2; exit 2; }

  # Changed lines from the zero-context diff: "+++ b/path" then "@@ -a,b +c,d @@".
  cur=""
  while IFS= read -r line; do
    case "$line" in
      '+++ /dev/null') cur="" ;;
      '+++ b/'*) cur=${line#+++ b/}; is_cxx "$cur" && [ -f "$cur" ] || cur="" ;;
      '@@ '*)
        [ -n "$cur" ] || continue
        hunk=${line#*+}; hunk=${hunk%% *}
        start=${hunk%%,*}; count=1
        [ "$hunk" != "$start" ] && count=${hunk#*,}
        [ "$count" -eq 0 ] && continue  # only deletions
        [ -n "${ranges[$cur]+x}" ] || files+=("$cur")
        ranges[$cur]="${ranges[$cur]:-} $start:$((start + count - 1))"
        ;;
    esac
  done < <(git diff -U0 --no-color --no-ext-diff --diff-filter=d "$base" -- '*.cc' '*.h' '*.cu' '*.cuh')
  while IFS= read -r f; do  # new files nobody has added yet: all of it is changed
    if is_cxx "$f" && [ -z "${ranges[$f]+x}" ]; then files+=("$f"); ranges[$f]=""; fi
  done < <(git ls-files --others --exclude-standard)
  if [ "$mode" = full ]; then for f in "${files[@]}"; do ranges[$f]=""; done; fi
fi

what="changed lines"; [ "$mode" = lines ] || what="whole files"
echo "lint: base $base; ${#files[@]} C++ file(s), $what"
if [ ${#files[@]} -eq 0 ]; then echo "lint: nothing to check"; exit 0; fi

failed=0

# ---- clang-format -------------------------------------------------------------
fmt_bad=()
for f in "${files[@]}"; do
  args=()
  for r in ${ranges[$f]}; do args+=("--lines=$r"); done
  if ! "$CLANG_FORMAT" --dry-run -Werror "${args[@]}" "$f"; then fmt_bad+=("$f"); fi
done
echo "lint: clang-format: ${#files[@]} file(s) checked, ${#fmt_bad[@]} not formatted"
if [ ${#fmt_bad[@]} -gt 0 ]; then
  failed=1
  if [ "$mode" = lines ]; then
    echo "lint: fix the changed lines with: git clang-format-14 $base -- ${fmt_bad[*]}"
  else
    echo "lint: fix with: $CLANG_FORMAT -i ${fmt_bad[*]}"
  fi
fi

# ---- clang-tidy ---------------------------------------------------------------
db="$BUILD_DIR/compile_commands.json"
if [ ! -f "$db" ]; then
  echo "lint: $db not found: configure and build first (make build, then make lint)" >&2
  exit 2
fi
# Repository files the build compiles (path relative to the root).
mapfile -t db_files < <(python3 - "$db" "$root" <<'EOF'
import json, os, sys
root = os.path.realpath(sys.argv[2])
seen = set()
for e in json.load(open(sys.argv[1])):
    p = os.path.realpath(os.path.join(e.get("directory", ""), e["file"]))
    if p.startswith(root + os.sep) and p not in seen:
        seen.add(p)
        print(os.path.relpath(p, root))
EOF
)
declare -A in_db=()
for f in "${db_files[@]}"; do in_db[$f]=1; done

declare -A tus=()
no_tidy=()
for f in "${files[@]}"; do
  case "$f" in
    *.cu | *.cuh) no_tidy+=("$f (CUDA)") ;;
    *.cc) if [ -n "${in_db[$f]+x}" ]; then tus[$f]=1; else no_tidy+=("$f (not compiled by $BUILD_DIR)"); fi ;;
    *.h)
      tu="${f%.h}.cc"
      if [ -z "${in_db[$tu]+x}" ]; then
        tu=""
        for c in "${db_files[@]}"; do
          case "$c" in *.cu | *.cuh) continue ;; esac  # clang-tidy cannot take nvcc's flags
          if grep -q "^#include \"$f\"" "$c" 2>/dev/null; then tu=$c; break; fi
        done
      fi
      if [ -n "$tu" ]; then tus[$tu]=1; else no_tidy+=("$f (no compiled .cc includes it directly)"); fi
      ;;
  esac
done
for f in "${no_tidy[@]}"; do echo "lint: no clang-tidy TU for $f: clang-format only"; done

if [ ${#tus[@]} -gt 0 ]; then
  # Diagnostics only in the repository's own files (not build/'s generated
  # protobuf headers, not system headers) and, by default, only on changed lines.
  header_filter="^$root/(bench|clients|common|fuzz|kernels|server|tests|trainer)/"
  filter=$(for f in "${files[@]}"; do echo "$f ${ranges[$f]}"; done | python3 -c '
import json, sys
out = []
for line in sys.stdin:
    name, *rs = line.split()
    e = {"name": name}
    if rs:
        e["lines"] = [[int(a), int(b)] for a, b in (r.split(":") for r in rs)]
    out.append(e)
print(json.dumps(out, separators=(",", ":")))')
  tidy_log=$(mktemp -d)
  trap 'rm -rf "$tidy_log"' EXIT
  echo "lint: clang-tidy on ${#tus[@]} file(s), $JOBS at a time: ${!tus[*]}"
  printf '%s\n' "${!tus[@]}" | sort | xargs -P "$JOBS" -I{} sh -c '
    log="$1/$(echo "$2" | tr / _).log"
    if "$3" -p "$4" --quiet --header-filter="$5" --line-filter="$6" "$2" >"$log" 2>&1; then
      rm -f "$log"; else echo "$2" >"$log.failed"; fi' sh "$tidy_log" {} "$CLANG_TIDY" "$BUILD_DIR" \
    "$header_filter" "$filter"
  tidy_bad=0
  for failed_marker in "$tidy_log"/*.failed; do
    [ -e "$failed_marker" ] || continue
    tidy_bad=$((tidy_bad + 1))
    log=${failed_marker%.failed}
    echo "---- clang-tidy $(cat "$failed_marker")"
    # The findings, without the "N warnings generated / Suppressed ..." chatter.
    grep -v -E '^[0-9]+ warnings? (and [0-9]+ errors? )?generated\.$|^Suppressed [0-9]+ warnings|^Use -header-filter=' \
      "$log" || true
  done
  echo "lint: clang-tidy: ${#tus[@]} file(s) checked, $tidy_bad with findings"
  [ $tidy_bad -eq 0 ] || failed=1
fi

if [ $failed -ne 0 ]; then echo "lint: FAILED"; exit 1; fi
echo "lint: clean"
