#!/usr/bin/env python3
"""DeepMind Reverb as the ingest peer of bench/ingest_compare.py (optional
dependency, not in CI): `pip install dm-reverb==0.14.0 tensorflow-cpu==2.15.0`
(Python 3.11), e.g. in a venv made with --system-site-packages.

Two roles, each its own process so the driver can read the server's CPU time
from /proc/<pid>/stat:

  reverb_ingest.py server --items_per_insert=K [--replay_transitions=1048576]
      One prioritized table ("replay": Prioritized(0.6) sampler, Fifo
      remover, MinSize(1) limiter, capacity replay_transitions / K items,
      signature of the payload below). Prints "reverb_server port=P" and
      serves until SIGTERM.

  reverb_ingest.py client --address=localhost:P --writer=trajectory|legacy
          --items_per_insert=K --start_at=UNIX_SECONDS --window_seconds=S
          --repeats=R [--max_in_flight=8]
      Inserts items flat out; counts inserts at the instants
      start_at + k * S (k = 0..R) and prints one JSON line.

The payload is the qstream `h200` transition (obs 48 f32, next_obs 48 f32,
4 int32 action branches, reward f32, discount f32). One insert carries K
transitions as one item of one step whose columns have a leading K axis,
exactly as one qstream message of K transitions: the rows of a column are
one contiguous numpy array in both. TrajectoryWriter: append(step),
create_item(trajectory = the last step of every column), then
flush(block_until_num_items=max_in_flight) as Acme's adders do (the only
bound on items in flight it has); legacy Writer: client.writer(
max_sequence_length=1, max_in_flight_items=max_in_flight), append(step),
create_item(num_timesteps=1).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

OBS_DIM = 48
BRANCHES = 4
ACTIONS_PER_BRANCH = 5
TABLE = "replay"
# Distinct payloads a client cycles through (the content does not matter).
PAYLOADS = 4


def payload(k: int, rng: np.random.Generator) -> dict:
    return {
        "obs": rng.uniform(-1, 1, (k, OBS_DIM)).astype(np.float32),
        "next_obs": rng.uniform(-1, 1, (k, OBS_DIM)).astype(np.float32),
        "actions": rng.integers(0, ACTIONS_PER_BRANCH, (k, BRANCHES), dtype=np.int32),
        "reward": rng.uniform(-1, 1, (k,)).astype(np.float32),
        "discount": np.where(rng.random(k) < 0.02, 0.0, 0.97).astype(np.float32),
    }


def run_server(args) -> int:
    import reverb
    import tensorflow as tf

    k = args.items_per_insert
    signature = {
        "obs": tf.TensorSpec([k, OBS_DIM], tf.float32),
        "next_obs": tf.TensorSpec([k, OBS_DIM], tf.float32),
        "actions": tf.TensorSpec([k, BRANCHES], tf.int32),
        "reward": tf.TensorSpec([k], tf.float32),
        "discount": tf.TensorSpec([k], tf.float32),
    }
    table = reverb.Table(
        name=TABLE,
        sampler=reverb.selectors.Prioritized(0.6),
        remover=reverb.selectors.Fifo(),
        max_size=max(1, args.replay_transitions // k),
        rate_limiter=reverb.rate_limiters.MinSize(1),
        signature=signature,
    )
    server = reverb.Server(tables=[table], port=args.port or None)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"reverb_server port={server.port}", flush=True)
    stop.wait()
    server.stop()
    return 0


def run_client(args) -> int:
    import reverb

    k = args.items_per_insert
    rng = np.random.default_rng(args.seed)
    steps = [payload(k, rng) for _ in range(PAYLOADS)]
    client = reverb.Client(args.address)
    start = args.start_at or time.time() + 1.0
    boundaries = [start + i * args.window_seconds for i in range(args.repeats + 1)]

    if args.writer == "trajectory":
        writer = client.trajectory_writer(num_keep_alive_refs=1)

        def insert(step):
            writer.append(step)
            writer.create_item(TABLE, priority=1.0, trajectory={c: writer.history[c][-1] for c in step})
            writer.flush(block_until_num_items=args.max_in_flight)

    else:
        writer = client.writer(max_sequence_length=1, max_in_flight_items=args.max_in_flight)

        def insert(step):
            writer.append(step)
            writer.create_item(TABLE, num_timesteps=1, priority=1.0)

    inserts = 0
    marks = []
    n = 0
    # A client that comes up after the first window began measured nothing: it says so.
    late = time.time() - boundaries[0]
    while len(marks) < len(boundaries):
        if time.time() >= boundaries[len(marks)]:
            marks.append(inserts)
            continue
        insert(steps[n % PAYLOADS])
        n += 1
        inserts += 1
    if args.writer == "trajectory":
        writer.flush()
        writer.end_episode()
    writer.close()

    windows = [{"acked": (b - a) * k, "acks": b - a} for a, b in zip(marks, marks[1:])]
    print(json.dumps({
        "client": f"reverb_{args.writer}",
        "items_per_message": k,
        "window_seconds": args.window_seconds,
        "windows": windows,
        # Every item the writer created, flushed and closed: on the server.
        "acked_total": inserts * k,
        "acks_total": inserts,
        "error_acks": 0,
        "rtt_p50_us": None,
        "rtt_p99_us": None,
        "status": "ok" if late <= 0 else f"late: started {late:.1f} s after the first window",
    }), flush=True)
    return 0


def table_inserts(address: str) -> int:
    """Items inserted into the table so far (its rate limiter's count)."""
    import reverb

    info = reverb.Client(address).server_info()[TABLE]
    return int(info.rate_limiter_info.insert_stats.completed)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server")
    s.add_argument("--items_per_insert", type=int, required=True)
    s.add_argument("--replay_transitions", type=int, default=1 << 20)
    s.add_argument("--port", type=int, default=0)
    c = sub.add_parser("client")
    c.add_argument("--address", required=True)
    c.add_argument("--writer", choices=["trajectory", "legacy"], required=True)
    c.add_argument("--items_per_insert", type=int, required=True)
    c.add_argument("--start_at", type=float, default=0)
    c.add_argument("--window_seconds", type=float, default=3)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--max_in_flight", type=int, default=8)
    c.add_argument("--seed", type=int, default=1)
    i = sub.add_parser("inserts", help="print the table's completed inserts")
    i.add_argument("--address", required=True)
    args = p.parse_args()
    if args.role == "server":
        return run_server(args)
    if args.role == "client":
        return run_client(args)
    print(table_inserts(args.address))
    return 0


if __name__ == "__main__":
    sys.exit(main())
