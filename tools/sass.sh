#!/usr/bin/env bash
# Static SASS of the CUDA kernels in a build output, on a machine without a
# GPU: per kernel, the instruction count and the count of each kind that
# matters for the fused step (tensor-core MMAs, shared, global and generic loads
# and stores, asynchronous copies, barriers), with registers and stack from
# `cuobjdump -res-usage`. Optionally the SASS of the kernels that match a
# regex. A static count is not a timing: it says how many instructions a
# path carries per MMA, which is what the chain kernels' profiles pointed at.
#
# Usage: tools/sass.sh OBJECT_OR_BINARY [KERNEL_REGEX]
#   e.g. tools/sass.sh build/kernels/CMakeFiles/qstream_kernels.dir/fused_mlp.cu.o 'FusedChainKernelILi1ELi32'
# The Debian toolkit has no cuobjdump/nvdisasm: both come from NVIDIA's
# PyPI wheels, pinned here, downloaded once into $QSTREAM_TOOLS_CACHE
# (default ~/.cache/qstream-tools).
set -euo pipefail
[[ $# -ge 1 && -e "$1" ]] || { sed -n '2,15p' "$0" >&2; exit 2; }
input="$(realpath "$1")"
regex="${2:-}"
version=13.5.37
cache="${QSTREAM_TOOLS_CACHE:-$HOME/.cache/qstream-tools}/cuda-$version"
bin="$cache/nvidia/cu13/bin"
if [[ ! -x "$bin/nvdisasm" || ! -x "$bin/cuobjdump" ]]; then
  echo "sass.sh: fetching nvidia-cuda-nvdisasm and nvidia-cuda-cuobjdump $version into $cache" >&2
  mkdir -p "$cache/wheels"
  python3 -m pip download --quiet --no-deps -d "$cache/wheels" \
    "nvidia-cuda-nvdisasm==$version" "nvidia-cuda-cuobjdump==$version"
  for w in "$cache"/wheels/*.whl; do python3 -m zipfile -e "$w" "$cache"; done
  chmod +x "$bin/nvdisasm" "$bin/cuobjdump"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && "$bin/cuobjdump" -xelf all "$input" > /dev/null)
shopt -s nullglob
cubins=("$work"/*.cubin)
[[ ${#cubins[@]} -gt 0 ]] || { echo "sass.sh: no cubin in $input" >&2; exit 1; }
"$bin/cuobjdump" -res-usage "$input" > "$work/res.txt" 2>&1 || true
for c in "${cubins[@]}"; do "$bin/nvdisasm" -c "$c"; done > "$work/all.sass"
# One row per kernel: its mangled name, counts, registers and stack bytes.
python3 - "$work/all.sass" "$work/res.txt" "$regex" <<'PY'
import re, sys
sass, res, regex = open(sys.argv[1]).read().splitlines(), open(sys.argv[2]).read(), sys.argv[3]
usage = {}
for name, body in re.findall(r"Function (\S+):\s*\n\s*(REG:.*)", res):
    usage[name] = body
# ld / st: generic-address loads and stores (LD.E, ST.E): the compiler could
# not tell their space, and cannot move such a load above a store it may alias.
kinds = [("mma", r"\b(HMMA|HGMMA|IMMA)\b"), ("lds", r"\bLDS(M)?\b"), ("ldg", r"\bLDG\b"),
         ("ld", r"\bLD\."), ("cp.async", r"\bLDGSTS\b"), ("sts", r"\bSTS\b"), ("stg", r"\bSTG\b"),
         ("st", r"\bST\."), ("bar", r"\bBAR\b")]
funcs, cur = {}, None
for line in sass:
    m = re.match(r"^\s*\.text\.(\S+):", line)
    if m:
        cur = m.group(1)
        funcs[cur] = []
    elif cur and re.match(r"^\s*/\*[0-9a-f]{4,}\*/", line):
        funcs[cur].append(line)
rows = []
for name, lines in funcs.items():
    if regex and not re.search(regex, name):
        continue
    counts = [sum(1 for l in lines if re.search(p, l)) for _, p in kinds]
    u = usage.get(name, "")
    reg = re.search(r"REG:(\d+)", u)
    stack = re.search(r"STACK:(\d+)", u)
    rows.append((name, len(lines), counts, reg.group(1) if reg else "?", stack.group(1) if stack else "?"))
print("%-8s %6s " % ("instr", "regs") + " ".join("%8s" % k for k, _ in kinds) + "  stack  kernel")
for name, n, counts, reg, stack in rows:
    print("%-8d %6s " % (n, reg) + " ".join("%8d" % c for c in counts) + "  %5s  %s" % (stack, name))
if regex:
    for name, lines in funcs.items():
        if re.search(regex, name):
            print("\n== " + name)
            print("\n".join(lines))
PY
