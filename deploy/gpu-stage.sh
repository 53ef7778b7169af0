#!/usr/bin/env bash
# Stages the CUDA build for a run on a GPU machine that has the CUDA runtime
# and cuBLAS but none of the project's other libraries: binaries into
# stage/bin, the non-system shared libraries they need into stage/lib (cuBLAS
# and the CUDA runtime come from the GPU machine), the benchmark peers into
# stage/peers, and deploy/gpu-run.sh beside them. Needs patchelf (deploy/install-deps.sh).
# Usage: deploy/gpu-stage.sh [BUILD_DIR] [STAGE_DIR]   (defaults build-cuda, stage)
# QSTREAM_STAGE_EXTRA="NAME=PATH ...": more binaries staged as stage/bin/NAME
# the same way, e.g. a base commit's build for a same-call comparison
# (qstream-bench-base=/tmp/base/qstream-bench qstreamd-base=/tmp/base/qstreamd,
# which deploy/gpu-run.sh's BASE=1 runs against the staged build).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build-cuda}"
stage="${2:-$root/stage}"
peers="${QSTREAM_PEERS:-$root/../shared/peers}"

extras=()
for extra in ${QSTREAM_STAGE_EXTRA:-}; do
  name="${extra%%=*}"
  if [[ "$name" == "$extra" || -z "$name" || "$name" == */* || ! -x "${extra#*=}" ]]; then
    echo "gpu-stage.sh: QSTREAM_STAGE_EXTRA: '$extra' is not NAME=PATH of an executable" >&2
    exit 2
  fi
  extras+=("$extra")
done

rm -rf "$stage"
mkdir -p "$stage/bin" "$stage/lib" "$stage/peers"
bins=()
for b in tests/cuda/kernels_gpu_test tests/cuda/cuda_backend_gpu_test tests/cuda/fused_mlp_gpu_test \
         tests/server/distributed_gpu_e2e_test qstream-bench qstreamd server/qstreamd \
         qstream-actor clients/cpp/qstream-actor; do
  [[ -x "$build/$b" ]] || continue
  name="$(basename "$b")"
  [[ -e "$stage/bin/$name" ]] && continue
  # Host debug info is most of the size; device line info stays in the fatbin.
  strip --strip-debug -o "$stage/bin/$name" "$build/$b"
  bins+=("$stage/bin/$name")
done
for extra in "${extras[@]}"; do
  strip --strip-debug -o "$stage/bin/${extra%%=*}" "${extra#*=}"
  bins+=("$stage/bin/${extra%%=*}")
done
for bin in "${bins[@]}"; do
  ldd "$bin" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
      libcuda.so*|libcudart.so*|libcublas.so*|libcublasLt.so*) ;;  # from the GPU machine
      *) cp -Ln "$lib" "$stage/lib/" ;;
    esac
  done
done
# The staged binaries find stage/lib by their RUNPATH ($ORIGIN/../lib; each
# staged library finds its siblings by $ORIGIN), so nothing needs
# LD_LIBRARY_PATH: a global one would shadow the GPU machine's own libcurl,
# libssl ... for its system tools (curl, python3) too.
for bin in "${bins[@]}"; do patchelf --set-rpath '$ORIGIN/../lib' "$bin"; done
for lib in "$stage"/lib/*; do patchelf --set-rpath '$ORIGIN' "$lib"; done
if [[ -d "$peers" ]]; then cp -r "$peers/." "$stage/peers/"; fi
cp "$root/deploy/gpu-run.sh" "$stage/"
du -sh "$stage"
