#!/usr/bin/env python3
"""Ingest as users see it: qstreamd (a separate process) against DeepMind
Reverb 0.14 in the same run (BENCH.md "Ingest", bench/NOTES.md).

For every peer, items per message (1, 64, 256, 1024 transitions of the h200
shape) and client process count (1, 2, 4), a fresh server process and N
client processes that send flat out; after a warm-up, R timed windows of S
seconds on wall-clock instants shared by the clients and this driver. Peers:

  cpp            `qstream-bench load` (pre-serialized bodies, callback streams)
  python         bench/ingest_sdk_client.py: the qstream Python SDK
                 (qstream.Writer when present, else ActorClient.send), one
                 message per append of K transitions
  python_buffered  the same appends into a Writer with its defaults
                 (max_batch 512, max_delay 20 ms): what a user gets; its
                 stream is the native one (gRPC C++) where --build holds
                 lib/libqstream_native.so (or $QSTREAM_NATIVE_LIB says so)
  python_buffered_aio  the same with transport='aio' (grpc.aio)
  reverb_trajectory, reverb_legacy
                 bench/reverb_ingest.py: Reverb's TrajectoryWriter and legacy
                 Writer into a prioritized table (optional; needs dm-reverb)

qstream runs with the learner paused (Admin Pause) and running (flat out,
--samples_per_insert, default 0); Reverb has no learner (its rows are the
paused case). One JSON line per case on stdout:

  transitions_per_s, messages_per_s   sum over clients of the acks in a
                                      window / S, median of the windows
  server_cpu_us_per_message, ..._per_transition
                                      utime+stime of the server process
                                      (/proc/<pid>/stat) over a window / the
                                      window's messages or transitions, median
  acked_total, ingested_total, acked_eq_ingested
                                      sum of the clients' acks over the whole
                                      run against the server's count
                                      (qstream_transitions_ingested_total;
                                      Reverb's table inserts x K); for the
                                      Writer (KIND_STEP) ingested may exceed
                                      acked by the n-step windows flushed at
                                      close, <= envs x (n_step - 1)
  rtt_p50_us, rtt_p99_us              C++ clients only (max over processes)
  learner_steps_per_s_ingest, _idle   qstream, learner running: /metrics over
                                      the windows, and over an idle window
                                      after the clients ended

then a markdown table per learner mode. Example (this repository's build in
/tmp/build-bench, Reverb in /tmp/reverb-venv):

  python3 bench/ingest_compare.py --build=/tmp/build-bench \\
      --reverb_python=/tmp/reverb-venv/bin/python > /tmp/ingest.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
QSTREAM_PEERS = ("cpp", "python", "python_buffered", "python_buffered_aio")
REVERB_PEERS = ("reverb_trajectory", "reverb_legacy")
PEER_NAMES = {
    "cpp": "qstream C++ (`qstream-bench load`)",
    "python": "qstream Python SDK",
    "python_buffered": "qstream Python SDK, Writer defaults (max(512, K) per message)",
    "python_buffered_aio": "qstream Python SDK, Writer defaults, transport='aio'",
    "reverb_trajectory": "Reverb TrajectoryWriter",
    "reverb_legacy": "Reverb legacy Writer",
}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def host_busy_seconds() -> float:
    """CPU seconds all cores spent not idle (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (stat(5) fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[14 - 3]) + int(fields[15 - 3])) / CLK_TCK


class Server:
    """A child process whose output is drained into memory by a thread."""

    def __init__(self, argv: list, env=None, cpus: set | None = None):
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     preexec_fn=pinned_to(cpus))
        self.lines: list = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.time() + timeout
        with self._cv:
            while True:
                for line in self.lines:
                    if m := rx.search(line):
                        return m
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{self.argv[0]} did not print /{pattern}/; output:\n" + "\n".join(self.lines))
                self._cv.wait(0.1)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def scrape(metrics_address: str) -> dict:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def scrape_after_poll(metrics_address: str, timeout: float = 1.5) -> tuple:
    """(time, metrics) of the first scrape after the daemon's next metrics
    poll (its counters moved), so rates over two such scrapes have the
    poll's instants at both ends."""
    keys = ("qstream_train_steps_total", "qstream_transitions_ingested_total")
    first = scrape(metrics_address)
    deadline = time.time() + timeout
    while True:
        time.sleep(0.005)
        now, m = time.time(), scrape(metrics_address)
        if any(m.get(k) != first.get(k) for k in keys) or now > deadline:
            return now, m


def sleep_until(t: float) -> None:
    while (d := t - time.time()) > 0:
        time.sleep(min(d, 0.5))


def parse_cpus(text: str) -> set | None:
    """A CPU list as taskset takes it ("0-3,8"), None for "" or "all"."""
    if text in ("", "all"):
        return None
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pinned_to(cpus: set | None):
    """A preexec_fn that pins the child to `cpus` (None: no pinning)."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_clients(argvs: list, env, start_at: float, args, server_pid: int, on_boundary=None) -> tuple:
    """Spawns the clients, samples the server's CPU at every window boundary
    and returns (client results, CPU seconds per window, boundary extras)."""
    # With the daemon pinned (--daemon_cpus), the clients take the other cores.
    others = None
    if args.daemon_cpus is not None:
        others = os.sched_getaffinity(0) - args.daemon_cpus or None
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              preexec_fn=pinned_to(others)) for a in argvs]
    cpu, client_cpu, host, extras = [], [], [], []
    for k in range(args.repeats + 1):
        sleep_until(start_at + k * args.window_seconds)
        cpu.append(cpu_seconds(server_pid))
        client_cpu.append(sum(cpu_seconds(p.pid) for p in procs if p.poll() is None))
        host.append(host_busy_seconds())
        if on_boundary:
            extras.append(on_boundary())
    results = []
    for p in procs:
        out, err = p.communicate(timeout=args.window_seconds * args.repeats + 120)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"client {' '.join(p.args)} exited {p.returncode}:\n{err[-3000:]}")
        results.append(json.loads(lines[-1]))
        if results[-1]["status"] != "ok":
            raise RuntimeError(f"client {' '.join(p.args)}: {results[-1]['status']}")
    w = args.window_seconds
    server_cores = [(b - a) / w for a, b in zip(cpu, cpu[1:])]
    client_cores = [(b - a) / w for a, b in zip(client_cpu, client_cpu[1:])]
    host_cores = [(b - a) / w for a, b in zip(host, host[1:])]
    extras.append({
        "clients_cpu_cores": median(client_cores),
        "host_busy_cores": median(host_cores),
        # CPU taken by processes other than this case's server and clients (builds, tests of others).
        "other_busy_cores": median([h - s - c for h, s, c in zip(host_cores, server_cores, client_cores)]),
    })
    return results, [b - a for a, b in zip(cpu, cpu[1:])], extras


def window_rates(results: list, cpu: list, k: int, args) -> dict:
    per_s, msgs_per_s, us_msg, us_tr = [], [], [], []
    for w in range(args.repeats):
        transitions = sum(r["windows"][w]["acked"] for r in results)
        acks = [r["windows"][w]["acks"] for r in results]
        # Clients that do not count acked messages: one message per k transitions.
        messages = sum(a if a is not None else r["windows"][w]["acked"] / k for a, r in zip(acks, results))
        per_s.append(transitions / args.window_seconds)
        msgs_per_s.append(messages / args.window_seconds)
        us_msg.append(1e6 * cpu[w] / messages if messages else None)
        us_tr.append(1e6 * cpu[w] / transitions if transitions else None)
    return {
        "transitions_per_s": median(per_s),
        "transitions_per_s_windows": per_s,
        "messages_per_s": median(msgs_per_s),
        "server_cpu_cores": median([c / args.window_seconds for c in cpu]),
        "server_cpu_us_per_message": median(us_msg),
        "server_cpu_us_per_transition": median(us_tr),
    }


def run_qstream(peer: str, k: int, clients: int, learner: str, args, config_path: str) -> dict:
    daemon = Server([
        str(args.qstreamd), f"--backend={args.backend}", f"--config={config_path}", "--listen=127.0.0.1:0",
        "--metrics_listen=127.0.0.1:0", f"--samples_per_insert={args.samples_per_insert}",
        f"--min_size_to_sample={args.learner_batch}",
    ], cpus=args.daemon_cpus)
    try:
        m = daemon.wait_for(r"listening grpc=(\S+) metrics=(\S+)", 120)
        grpc_address, metrics_address = m.group(1), m.group(2)
        if learner == "paused":
            try:
                import qstream

                with qstream.AdminClient(grpc_address) as admin:
                    admin.pause()
            except ImportError:
                # No SDK here (a GPU host without grpcio-tools): the same paused
                # learner from the start.
                daemon.stop()
                daemon = Server([
                    str(args.qstreamd), f"--backend={args.backend}", f"--config={config_path}",
                    "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0", "--start_paused",
                    f"--samples_per_insert={args.samples_per_insert}", f"--min_size_to_sample={args.learner_batch}",
                ], cpus=args.daemon_cpus)
                m = daemon.wait_for(r"listening grpc=(\S+) metrics=(\S+)", 120)
                grpc_address, metrics_address = m.group(1), m.group(2)
        startup = args.python_startup_seconds if peer.startswith("python") else 0.5
        start_at = time.time() + startup + args.warmup_seconds
        common = [f"--items_per_message={k}", f"--start_at={start_at:.3f}",
                  f"--window_seconds={args.window_seconds}", f"--repeats={args.repeats}"]
        if peer == "cpp":
            argvs = [[str(args.bench), "load", f"--address={grpc_address}", "--config=h200", f"--seed={i + 1}",
                      f"--streams={args.cpp_streams}", f"--in_flight={args.in_flight}"] + common for i in range(clients)]
        else:
            buffered = ["--buffered"] if peer.startswith("python_buffered") else []
            transport = ["--transport=aio"] if peer.endswith("_aio") else []
            argvs = [[sys.executable, str(HERE / "ingest_sdk_client.py"), f"--address={grpc_address}",
                      f"--seed={i + 1}", f"--api={args.python_api}", f"--max_in_flight={args.in_flight}"]
                     + buffered + transport + common for i in range(clients)]
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'clients' / 'python'}:{os.environ.get('PYTHONPATH', '')}")
        # The SDK's native transport from the build measured (unless the caller chose one).
        native_lib = args.build / "lib" / "libqstream_native.so"
        if "QSTREAM_NATIVE_LIB" not in env and native_lib.is_file():
            env["QSTREAM_NATIVE_LIB"] = str(native_lib)
        # The CPUs the daemon may run on, as the kernel reports them (--daemon_cpus's effect).
        daemon_affinity = sorted(os.sched_getaffinity(daemon.proc.pid))
        results, cpu, marks = run_clients(argvs, env, start_at, args, daemon.proc.pid,
                                          on_boundary=lambda: scrape_after_poll(metrics_address))
        row = window_rates(results, cpu, k, args)
        row["daemon_affinity"] = daemon_affinity
        row.update(marks.pop())
        (t0, m0), (t1, m1) = marks[0], marks[-1]
        steps = "qstream_train_steps_total"
        row["learner_steps_per_s_ingest"] = (m1.get(steps, 0) - m0.get(steps, 0)) / (t1 - t0)
        # Every client closed its stream: the daemon's counters settle at its next polls.
        time.sleep(1.2)
        ta, ma = scrape_after_poll(metrics_address)
        if learner == "running":
            sleep_until(ta + args.idle_seconds)
            tb, mb = scrape_after_poll(metrics_address)
            row["learner_steps_per_s_idle"] = (mb.get(steps, 0) - ma.get(steps, 0)) / (tb - ta)
        else:
            row["learner_steps_per_s_idle"] = None
        acked = sum(r["acked_total"] for r in results)
        ingested = int(ma.get("qstream_transitions_ingested_total", -1))
        # KIND_STEP (the Writer): at each stream's half-close the daemon flushes its per-env n-step windows
        # into the replay, unacknowledged: at most envs x (n_step - 1) transitions per client beyond the acks.
        step_kind = results[0]["client"].startswith("python_writer")
        flush_bound = clients * k * (args.n_step - 1) if step_kind else 0
        rejected = sum(v for n, v in ma.items() if n.startswith("qstream_ingest_rejected_total"))
        row.update({
            "acked_total": acked, "ingested_total": ingested, "ingested_minus_acked_bound": flush_bound,
            "acked_eq_ingested": 0 <= ingested - acked <= flush_bound,
            "error_acks": sum(r.get("error_acks", 0) for r in results), "rejected_batches": rejected,
            "rtt_p50_us": median([r.get("rtt_p50_us") for r in results]),
            "rtt_p99_us": max([r["rtt_p99_us"] for r in results if r.get("rtt_p99_us") is not None], default=None),
            "client_api": results[0]["client"],
            "client_status": sorted({r["status"] for r in results}),
        })
        return row
    finally:
        rc = daemon.stop()
        if rc != 0:
            log(f"  qstreamd exited {rc}; last output:\n" + "\n".join(daemon.lines[-20:]))


def run_reverb(peer: str, k: int, clients: int, args) -> dict:
    py = str(args.reverb_python)
    script = str(HERE / "reverb_ingest.py")
    server = Server([py, script, "server", f"--items_per_insert={k}",
                     f"--replay_transitions={args.replay_transitions}"])
    try:
        port = server.wait_for(r"reverb_server port=(\d+)", 180).group(1)
        address = f"localhost:{port}"
        start_at = time.time() + args.reverb_startup_seconds + args.warmup_seconds
        writer = peer.removeprefix("reverb_")
        argvs = [[py, script, "client", f"--address={address}", f"--writer={writer}", f"--items_per_insert={k}",
                  f"--start_at={start_at:.3f}", f"--window_seconds={args.window_seconds}",
                  f"--repeats={args.repeats}", f"--seed={i + 1}"] for i in range(clients)]
        results, cpu, extras = run_clients(argvs, None, start_at, args, server.proc.pid)
        row = window_rates(results, cpu, k, args)
        row.update(extras[-1])
        out = subprocess.run([py, script, "inserts", f"--address={address}"], capture_output=True, text=True,
                             timeout=120)
        inserted = int(out.stdout.strip().splitlines()[-1]) * k if out.returncode == 0 else -1
        acked = sum(r["acked_total"] for r in results)
        row.update({
            "acked_total": acked, "ingested_total": inserted, "acked_eq_ingested": acked == inserted,
            "error_acks": 0, "rtt_p50_us": None, "rtt_p99_us": None,
            "learner_steps_per_s_ingest": None, "learner_steps_per_s_idle": None,
            "client_api": results[0]["client"], "client_status": sorted({r["status"] for r in results}),
        })
        return row
    finally:
        server.stop()


def fmt_rate(x) -> str:
    if x is None:
        return "—"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def fmt_us(x) -> str:
    return "—" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def cell(r: dict, learner: str) -> str:
    if "error" in r:
        return "failed"
    c = (f"{fmt_rate(r['transitions_per_s'])} ({fmt_us(r['server_cpu_us_per_message'])} / "
         f"{fmt_us(r['server_cpu_us_per_transition'])})")
    if learner == "running":
        c += f", {r['learner_steps_per_s_ingest']:.0f} steps/s"
    return c + ("" if r["acked_eq_ingested"] else " ≠")


def tables(rows: list, args) -> str:
    """Markdown: rows (peer, transitions per message), columns client processes."""
    out = []
    for learner in ("paused", "running"):
        sel = [r for r in rows if r["learner"] == learner]
        if not sel:
            continue
        title = "learner paused (Admin Pause; Reverb has no learner)" if learner == "paused" else (
            f"learner running (samples_per_insert {args.samples_per_insert}, learner steps/s during ingest; "
            "idle: after the clients ended)")
        head = "| peer | transitions per message | " + " | ".join(f"{n} client proc." for n in args.clients)
        sep = "| --- | ---: | " + " | ".join("---" for _ in args.clients)
        if learner == "running":
            head += " | learner idle steps/s"
            sep += " | ---"
        out += ["", f"Transitions/s (server CPU µs per message / per transition), {title}:", "",
                head + " |", sep + " |"]
        for peer in args.peers:
            for k in sorted({r["items_per_message"] for r in sel if r["peer"] == peer}):
                found = {r["clients"]: r for r in sel if r["peer"] == peer and r["items_per_message"] == k}
                line = f"| {PEER_NAMES[peer]} | {k} | " + " | ".join(
                    cell(found[n], learner) if n in found else "" for n in args.clients)
                if learner == "running":
                    line += " | " + fmt_rate(median([r.get("learner_steps_per_s_idle") for r in found.values()]))
                out.append(line + " |")
    out += ["", "≠: the clients' acked transitions differ from the server's ingested count (see the JSON)."]
    return "\n".join(out)


def run_case(peer: str, k: int, n: int, learner: str, args, config_path: str, commit: str) -> dict:
    case = {"bench": "ingest_compare", "peer": peer, "learner": learner, "items_per_message": k,
            "clients": n, "config": "h200", "window_seconds": args.window_seconds,
            "repeats": args.repeats, "host_cores": os.cpu_count(), "commit": commit}
    if peer in QSTREAM_PEERS:
        case["samples_per_insert"] = args.samples_per_insert if learner == "running" else None
        case["learner_batch"] = args.learner_batch
        case["backend"] = args.backend
        case["streams_per_client"] = args.cpp_streams if peer == "cpp" else 1
        case["in_flight"] = args.in_flight
        case["daemon_cpus"] = sorted(args.daemon_cpus) if args.daemon_cpus is not None else "all"
    log(f"{peer} learner={learner} items={k} clients={n} ...")
    try:
        if peer in QSTREAM_PEERS:
            case.update(run_qstream(peer, k, n, learner, args, config_path))
        else:
            case.update(run_reverb(peer, k, n, args))
    except Exception as e:  # one failed case does not end the run
        case["error"] = str(e)[-2000:]
    log("  " + ", ".join(f"{key}={case.get(key)}" for key in (
        "transitions_per_s", "server_cpu_us_per_message", "server_cpu_us_per_transition", "acked_eq_ingested",
        "learner_steps_per_s_ingest", "learner_steps_per_s_idle", "other_busy_cores", "error")))
    print(json.dumps(case), flush=True)
    return case


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--build", type=Path, default=ROOT / "build", help="folder with qstream-bench and qstreamd")
    p.add_argument("--peers", default="cpp,python,reverb_trajectory,reverb_legacy",
                   help="comma list of cpp, python, python_buffered, python_buffered_aio, reverb_trajectory, "
                        "reverb_legacy")
    p.add_argument("--items", type=ints, default=[1, 64, 256, 1024], help="transitions per message / item")
    p.add_argument("--reverb_items", type=ints, default=[1, 64, 1024], help="items per insert for Reverb")
    p.add_argument("--clients", type=ints, default=[1, 2, 4], help="client process counts")
    p.add_argument("--learner", default="paused,running", help="qstream learner modes: paused, running")
    p.add_argument("--samples_per_insert", type=float, default=0, help="qstreamd rate limit, learner running")
    p.add_argument("--learner_batch", type=int, default=256)
    p.add_argument("--backend", default="cpu", help="qstreamd --backend (cpu|cuda|auto)")
    p.add_argument("--cpp_streams", type=int, default=1, help="streams per `qstream-bench load` process")
    p.add_argument("--in_flight", type=int, default=32,
                   help="unacknowledged batches per stream (C++ load and the Python SDK's max_in_flight)")
    p.add_argument("--window_seconds", type=float, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup_seconds", type=float, default=2)
    p.add_argument("--idle_seconds", type=float, default=3)
    p.add_argument("--python_api", default="auto", choices=["auto", "writer", "actor_client"])
    p.add_argument("--python_startup_seconds", type=float, default=2.0)
    p.add_argument("--reverb_python", type=Path, default=Path("/tmp/reverb-venv/bin/python"))
    p.add_argument("--reverb_startup_seconds", type=float, default=12.0, help="TensorFlow import in the clients")
    p.add_argument("--replay_transitions", type=int, default=1 << 20)
    p.add_argument("--table", type=Path, help="also write the markdown table here")
    p.add_argument("--n_step", type=int, default=3, help="the h200 config's returns.n_step")
    p.add_argument("--daemon_cpus", default="", help="pin qstreamd to these CPUs (taskset's list form, e.g. 0-3; "
                   "gRPC sizes its thread pools by the CPUs it may use) and the clients to the rest; default: "
                   "no pinning")
    args = p.parse_args()
    try:
        args.daemon_cpus = parse_cpus(args.daemon_cpus)
    except ValueError:
        p.error(f"--daemon_cpus={args.daemon_cpus}: not a CPU list such as 0-3,8")
    missing = sorted((args.daemon_cpus or set()) - os.sched_getaffinity(0))
    if missing:
        p.error(f"--daemon_cpus: CPUs {missing} are not available here")
    if "paused" in args.learner.split(",") and args.samples_per_insert > 0:
        p.error(f"--learner=paused with --samples_per_insert={args.samples_per_insert}: a paused learner samples "
                "nothing, so the rate limiter holds inserts once its error buffer is used and the case never "
                "ends; use --learner=running (or samples_per_insert 0)")
    args.peers = [x for x in args.peers.split(",") if x]
    args.bench = args.build / "qstream-bench"
    args.qstreamd = next((q for q in (args.build / "qstreamd", args.build / "server" / "qstreamd") if q.exists()),
                         args.build / "qstreamd")
    sys.path.insert(0, str(ROOT / "clients" / "python"))
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "server", "clients", "proto"],
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        commit += "+uncommitted"
    if any(x in REVERB_PEERS for x in args.peers) and not args.reverb_python.exists():
        log(f"no {args.reverb_python}: the Reverb peers are left out")
        args.peers = [x for x in args.peers if x not in REVERB_PEERS]

    config = subprocess.run([str(args.bench), "daemon_config", "--config=h200",
                             f"--learner_batch={args.learner_batch}"], capture_output=True, text=True, check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".pbtxt", delete=False) as f:
        f.write(config.stdout)
        config_path = f.name
    rows = []
    try:
        # Cell by cell (size, client count), every peer and learner mode back to back, so that load from
        # other processes on the host falls on the peers of a cell alike.
        sizes = sorted(set(args.items) | set(args.reverb_items))
        for k in sizes:
            for n in args.clients:
                for peer in args.peers:
                    if k not in (args.items if peer in QSTREAM_PEERS else args.reverb_items):
                        continue
                    for learner in (args.learner.split(",") if peer in QSTREAM_PEERS else ["paused"]):
                        rows.append(run_case(peer, k, n, learner, args, config_path, commit))
    finally:
        os.unlink(config_path)
    table = tables(rows, args)
    print(table, flush=True)
    if args.table:
        args.table.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
