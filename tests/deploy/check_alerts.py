#!/usr/bin/env python3
"""Checks of deploy/prometheus and deploy/alertmanager that promtool and
amtool do not make (run by ctest, label deploy-alerts):

  check_alerts.py coverage SOURCE_DIR
      every alert of alerts.yml has labels.severity (critical, warning or
      info); annotations summary, description and runbook_url, the URL
      pointing at docs/runbook.md#<alertname in lower case>, a section the
      runbook has; every metric selector names job="qstream" (the pulled
      daemons, so a pushed copy never alerts twice); and the unit tests
      (deploy/prometheus/tests/*.test.yml) hold, for every alert, a case
      where it fires and one where it must stay silent.

  check_alerts.py routes SOURCE_DIR
      each severity reaches its receiver in alertmanager.yml (critical: the
      pager, warning and info: the chat), through `amtool config routes test`.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

try:
    import yaml
except ImportError:
    sys.exit("check_alerts.py: the Python module yaml is missing: install the Debian package python3-yaml "
             "(deploy/install-deps.sh installs it with yamllint)")

RUNBOOK_URL = "https://github.com/qstream/qstream/blob/main/docs/runbook.md#"
SEVERITIES = ("critical", "warning", "info")
RECEIVERS = {"critical": "pager,chat", "warning": "chat", "info": "chat"}
# Metric names whose selectors must carry job="qstream".
METRIC = re.compile(r"\b(qstream_[a-z0-9_]+|process_[a-z0-9_]+|up)\b(\s*\{[^}]*\})?")


def load(path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def alerts_of(rules_path):
    out = []
    for group in load(rules_path)["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                out.append(rule)
    return out


def selectors_without_job(expr):
    bad = []
    for m in METRIC.finditer(expr):
        name, matchers = m.group(1), m.group(2)
        # label names inside braces or by/on lists are not selectors
        before = expr[:m.start()]
        if before.count("{") > before.count("}"):
            continue
        if re.search(r"(by|on|without|ignoring|group_left|group_right)\s*\([^)]*$", before):
            continue
        if not matchers or 'job="qstream"' not in matchers:
            bad.append(name + (matchers or ""))
    return bad


def coverage(src):
    errors = []
    rules_path = os.path.join(src, "deploy/prometheus/alerts.yml")
    runbook_path = os.path.join(src, "docs/runbook.md")
    alerts = alerts_of(rules_path)
    with open(runbook_path, encoding="utf-8") as f:
        headings = {m.group(1) for m in re.finditer(r"^## (\S+)\s*$", f.read(), re.M)}
    names = []
    for rule in alerts:
        name = rule["alert"]
        names.append(name)
        severity = rule.get("labels", {}).get("severity")
        if severity not in SEVERITIES:
            errors.append(f"{name}: labels.severity is {severity!r}, not one of {SEVERITIES}")
        ann = rule.get("annotations", {})
        for key in ("summary", "description", "runbook_url"):
            if not ann.get(key):
                errors.append(f"{name}: no annotations.{key}")
        url = ann.get("runbook_url", "")
        if url != RUNBOOK_URL + name.lower():
            errors.append(f"{name}: runbook_url {url!r} is not {RUNBOOK_URL + name.lower()!r}")
        if name not in headings:
            errors.append(f"{name}: docs/runbook.md has no section '## {name}'")
        for sel in selectors_without_job(rule["expr"]):
            errors.append(f"{name}: selector {sel} does not name job=\"qstream\"")
    if len(set(names)) != len(names):
        errors.append(f"duplicate alert names in alerts.yml: {sorted(names)}")
    for group in load(rules_path)["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                for sel in selectors_without_job(rule["expr"]):
                    errors.append(f"record {rule['record']}: selector {sel} does not name job=\"qstream\"")

    fires, silent = {}, {}
    test_files = sorted(glob.glob(os.path.join(src, "deploy/prometheus/tests/*.test.yml")))
    if not test_files:
        errors.append("no deploy/prometheus/tests/*.test.yml")
    for path in test_files:
        for test in load(path).get("tests", []):
            for case in test.get("alert_rule_test", []) or []:
                where = f"{os.path.basename(path)}: {test.get('name')} @ {case.get('eval_time')}"
                alertname = case["alertname"]
                if alertname not in names:
                    errors.append(f"{where}: tests unknown alert {alertname}")
                if case.get("exp_alerts"):
                    fires.setdefault(alertname, []).append(where)
                    for exp in case["exp_alerts"]:
                        if set(exp.get("exp_annotations", {})) != {"summary", "description", "runbook_url"}:
                            errors.append(f"{where}: {alertname} fires without its three annotations checked")
                        if "severity" not in exp.get("exp_labels", {}):
                            errors.append(f"{where}: {alertname} fires without its severity checked")
                else:
                    silent.setdefault(alertname, []).append(where)
    for name in names:
        if name not in fires:
            errors.append(f"{name}: no unit test where it fires")
        if name not in silent:
            errors.append(f"{name}: no unit test where it must stay silent (exp_alerts: [])")
    for e in errors:
        print("FAIL:", e)
    print(f"{len(names)} alerts, {len(test_files)} test files, "
          f"{sum(len(v) for v in fires.values())} firing and {sum(len(v) for v in silent.values())} silent cases")
    return 1 if errors else 0


def routes(src):
    amtool = shutil.which("amtool")
    if not amtool:
        sys.exit("amtool not found: install the Debian package prometheus-alertmanager (deploy/install-deps.sh)")
    config = os.path.join(src, "deploy/alertmanager/alertmanager.yml")
    failed = 0
    for rule in alerts_of(os.path.join(src, "deploy/prometheus/alerts.yml")):
        severity = rule["labels"]["severity"]
        want = RECEIVERS[severity]
        r = subprocess.run([amtool, "config", "routes", "test", f"--config.file={config}",
                            f"--verify.receivers={want}", f"alertname={rule['alert']}", f"severity={severity}",
                            "job=qstream", "instance=trainer-0:9464"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        got = (r.stdout.strip() or r.stderr.strip()).splitlines()
        status = "ok" if r.returncode == 0 else "FAIL"
        print(f"{status}: {rule['alert']} ({severity}) -> {got[0] if got else '?'} (want {want})")
        failed |= r.returncode != 0
    return 1 if failed else 0


def main(argv):
    if len(argv) != 3 or argv[1] not in ("coverage", "routes"):
        sys.exit(__doc__)
    return {"coverage": coverage, "routes": routes}[argv[1]](argv[2])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
