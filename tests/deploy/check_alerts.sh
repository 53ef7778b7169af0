#!/usr/bin/env bash
# The deploy-alerts checks that run a tool on the files (ctest label
# deploy-alerts; tests/deploy/CMakeLists.txt). A missing tool is a failure
# naming its Debian package, never a skip.
#   check_alerts.sh SOURCE_DIR rules|config|unit|alertmanager|yamllint
set -euo pipefail
src=${1:?source dir}
what=${2:?what to check}
prom=$src/deploy/prometheus

need() {  # need TOOL PACKAGE
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "$1 not found: install the Debian package '$2' (deploy/install-deps.sh installs it)" >&2
    exit 1
  fi
}

case $what in
  rules)
    need promtool prometheus
    # Every rule file, test fixtures included.
    mapfile -t files < <(find "$prom" -name '*.yml' ! -name '*.test.yml' ! -name prometheus.yml | sort)
    promtool check rules "${files[@]}"
    ;;
  config)
    need promtool prometheus
    promtool check config "$prom/prometheus.yml"
    ;;
  unit)
    need promtool prometheus
    cd "$prom/tests"
    promtool test rules ./*.test.yml
    ;;
  alertmanager)
    need amtool prometheus-alertmanager
    amtool check-config "$src/deploy/alertmanager/alertmanager.yml"
    ;;
  yamllint)
    need yamllint yamllint
    files=("$prom" "$src/deploy/alertmanager")
    if [[ -f $src/.yamllint ]]; then
      yamllint --strict -c "$src/.yamllint" "${files[@]}"
    else
      yamllint --strict -d relaxed "${files[@]}"
    fi
    ;;
  *)
    echo "check_alerts.sh: unknown check '$what'" >&2
    exit 2
    ;;
esac
