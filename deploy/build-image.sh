#!/usr/bin/env bash
# Builds the image's files: configures and builds qstreamd, qstream-actor,
# qstream-bench and qstream-healthcheck (Release, Ninja), then stages them
# into OUT/bin and the non-system shared libraries they need into OUT/lib,
# and checks the staged qstreamd runs with OUT/lib as its only library path.
# The Dockerfile's builder stage runs it; CI runs it through ctest
# (tests/deploy/k8s, label deploy-image) on its own build with --build-dir.
#
# Usage: deploy/build-image.sh --out DIR [--build-dir DIR] [--work DIR]
#   --out DIR        the output root (emptied first): DIR/bin, DIR/lib
#   --build-dir DIR  stage from this existing build; no configure, no build.
#                    Binaries it lacks are skipped, except qstreamd
#   --work DIR       where to configure and build otherwise (default build-image)
# Environment: QSTREAM_CUDA (ON), CMAKE_CUDA_ARCHITECTURES (90-real;90a-real;90-virtual:
#   SASS for sm_90 and sm_90a, PTX for compute_90), JOBS (nproc).
#
# Not copied (the runtime image or the GPU node provides them): glibc, libstdc++,
# libgcc_s, and the CUDA driver, runtime and cuBLAS libraries.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="" build="" work="$root/build-image"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --build-dir) build="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "build-image: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$out" ]] || { echo "build-image: --out DIR is required" >&2; exit 2; }
targets=(qstreamd qstream-actor qstream-bench qstream-healthcheck)

if [[ -z "$build" ]]; then
  build="$work"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DQSTREAM_CUDA="${QSTREAM_CUDA:-ON}" \
    "-DCMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES:-90-real;90a-real;90-virtual}"
  cmake --build "$build" -j "${JOBS:-$(nproc)}" --target "${targets[@]}"
  required=("${targets[@]}")
else
  required=(qstreamd)
fi

# Where a target's binary lies in the build tree (top level or its folder).
find_binary() {
  local name="$1" p
  for p in "$build/$name" "$build/server/$name" "$build/clients/cpp/$name" "$build/bench/$name"; do
    [[ -x "$p" && -f "$p" ]] && { echo "$p"; return 0; }
  done
  return 1
}

# System libraries: from the base image (glibc, GCC runtime) or the GPU node
# and the CUDA runtime image (driver, cudart, cuBLAS).
is_system_lib() {
  case "$(basename "$1")" in
    linux-vdso.so*|ld-linux*|libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*) return 0 ;;
    libgcc_s.so*|libstdc++.so*) return 0 ;;
    libcuda.so*|libcudart.so*|libcublas.so*|libcublasLt.so*|libnvidia-*) return 0 ;;
  esac
  return 1
}

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
out="$(cd "$out" && pwd)"
for t in "${targets[@]}"; do
  if src="$(find_binary "$t")"; then
    # Host debug info is most of the size; device line info stays in the fatbin.
    strip --strip-debug -o "$out/bin/$t" "$src"
  elif printf '%s\n' "${required[@]}" | grep -qx "$t"; then
    echo "build-image: $t not found in $build" >&2; exit 1
  else
    echo "build-image: $t not in $build, not staged"
  fi
done
for bin in "$out"/bin/*; do
  ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  is_system_lib "$lib" || cp -Ln "$lib" "$out/lib/"
done

# Check: every library a staged binary needs resolves either to OUT/lib or
# to a system library, with OUT/lib as the only extra path; qstreamd runs.
status=0
for bin in "$out"/bin/*; do
  while read -r name arrow path _; do
    [[ "$arrow" == "=>" ]] || continue
    if [[ "$path" == "not" ]] && is_system_lib "$name"; then
      echo "build-image: $(basename "$bin") needs $name, which the GPU node or the runtime image provides"
    elif [[ "$path" == "not" ]]; then
      echo "build-image: $(basename "$bin") needs $name, found nowhere" >&2; status=1
    elif ! is_system_lib "$path" && [[ "$path" != "$out/lib/"* ]]; then
      echo "build-image: $(basename "$bin") takes $name from $path, not from the staged libraries" >&2; status=1
    fi
  done < <(env -i LD_LIBRARY_PATH="$out/lib" ldd "$bin")
done
version_line="$(env -i LD_LIBRARY_PATH="$out/lib" "$out/bin/qstreamd" --version 2>&1)" || {
  echo "build-image: staged qstreamd --version failed: $version_line" >&2; exit 1; }
help_text="$(env -i LD_LIBRARY_PATH="$out/lib" "$out/bin/qstreamd" --help 2>&1 || true)"
grep -q -- "--checkpoint_dir" <<<"$help_text" || {
  echo "build-image: staged qstreamd --help does not list its flags:" >&2; echo "$help_text" | head -5 >&2; exit 1; }
# A CUDA build's fatbin: SASS for sm_90 and sm_90a and PTX for compute_90.
if command -v cuobjdump >/dev/null && cuobjdump --list-elf "$out/bin/qstreamd" >/dev/null 2>&1; then
  elf="$(cuobjdump --list-elf "$out/bin/qstreamd")" ptx="$(cuobjdump --list-ptx "$out/bin/qstreamd")"
  for want in "sm_90\." "sm_90a\."; do
    grep -q "$want" <<<"$elf" || { echo "build-image: qstreamd has no ${want%\\.} SASS" >&2; status=1; }
  done
  grep -q "sm_90\." <<<"$ptx" || { echo "build-image: qstreamd has no compute_90 PTX" >&2; status=1; }
fi
[[ $status -eq 0 ]] || exit 1
echo "build-image: staged $(ls "$out/bin" | tr '\n' ' ')and $(ls "$out/lib" | wc -l) libraries into $out" \
     "($(du -sh "$out" | cut -f1)); ${version_line%%$'\n'*} runs with LD_LIBRARY_PATH=$out/lib"
