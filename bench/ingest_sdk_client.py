#!/usr/bin/env python3
"""One client process of bench/ingest_compare.py that streams through the
qstream Python SDK as users call it (PYTHONPATH=clients/python).

    ingest_sdk_client.py --address=127.0.0.1:P --items_per_message=K
        --start_at=UNIX_SECONDS --window_seconds=S --repeats=R
        [--max_in_flight=32] [--api=auto|writer|actor_client]

api=writer (auto when qstream.Writer exists): a vector env of K envs; each
env step is one `Writer.append(obs [K, 48], action [K, 4], reward [K],
terminated [K], truncated [K], next_obs [K, 48])` with max_batch=K, so every
append is one message of K transitions (KIND_STEP in the step-stream form:
next_obs goes out only for the rows that end an episode; the daemon assembles the
n-step returns per env). api=actor_client: `ActorClient.send` of a KIND_NSTEP
TransitionBatch whose Tensor columns are built from numpy with tobytes()
(what a user without the Writer does).

Counts acknowledged transitions and acks at start_at + k * S (k = 0..R) and
prints one JSON line in the format of `qstream-bench load`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

import numpy as np

import qstream
from qstream.proto import experience_pb2

OBS_DIM = 48
BRANCHES = 4
ACTIONS_PER_BRANCH = 5
PAYLOADS = 4
TERMINAL_PROBABILITY = 0.02

Tensor = experience_pb2.Tensor
TransitionBatch = experience_pb2.TransitionBatch


def tensor(t, array: np.ndarray, dtype) -> None:
    t.dtype = dtype
    t.shape[:] = array.shape
    t.data = array.tobytes()


def columns(k: int, rng: np.random.Generator) -> dict:
    terminated = rng.random(k) < TERMINAL_PROBABILITY
    return {
        "obs": rng.uniform(-1, 1, (k, OBS_DIM)).astype(np.float32),
        "next_obs": rng.uniform(-1, 1, (k, OBS_DIM)).astype(np.float32),
        "actions": rng.integers(0, ACTIONS_PER_BRANCH, (k, BRANCHES), dtype=np.int32),
        "reward": rng.uniform(-1, 1, (k,)).astype(np.float32),
        "terminated": terminated,
        "truncated": np.zeros(k, dtype=bool),
        "discount": np.where(terminated, 0.0, 0.97).astype(np.float32),
    }


def nstep_batch(c: dict) -> TransitionBatch:
    k = c["obs"].shape[0]
    b = TransitionBatch(kind=TransitionBatch.KIND_NSTEP, count=k)
    tensor(b.obs, c["obs"], Tensor.DTYPE_FLOAT32)
    tensor(b.next_obs, c["next_obs"], Tensor.DTYPE_FLOAT32)
    tensor(b.actions, c["actions"], Tensor.DTYPE_INT32)
    tensor(b.rewards, c["reward"], Tensor.DTYPE_FLOAT32)
    tensor(b.discounts, c["discount"], Tensor.DTYPE_FLOAT32)
    return b


def acked_transitions(client) -> int:
    """Transitions the daemon acknowledged so far (Writer or ActorClient)."""
    stats = getattr(client, "stats", None)
    if callable(stats):
        stats = stats()
    for name in ("accepted_transitions", "acked_transitions", "acked"):
        for source in (stats, client):
            value = getattr(source, name, None)
            if isinstance(value, int):
                return value
    raise RuntimeError(f"{type(client).__name__} exposes no acknowledged-transition count")


def acked_batches(client) -> int:
    stats = getattr(client, "stats", None)
    if callable(stats):
        stats = stats()
    for name in ("acked_batches", "acked_messages", "acks"):
        for source in (stats, client):
            value = getattr(source, name, None)
            if isinstance(value, int):
                return value
    return -1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True)
    p.add_argument("--items_per_message", type=int, default=64)
    p.add_argument("--start_at", type=float, default=0)
    p.add_argument("--window_seconds", type=float, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max_in_flight", type=int, default=32)
    p.add_argument("--api", choices=["auto", "writer", "actor_client"], default="auto")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--buffered", action="store_true",
                   help="Writer with its default flush rule (max_batch max(512, K), max_delay 20 ms) "
                        "instead of one message per append")
    p.add_argument("--transport", choices=["auto", "native", "aio"], default="auto",
                   help="the Writer's stream transport (auto: native where libqstream_native loads)")
    args = p.parse_args()

    api = args.api
    if api == "auto":
        api = "writer" if hasattr(qstream, "Writer") else "actor_client"
    k = args.items_per_message
    rng = np.random.default_rng(args.seed)
    steps = [columns(k, rng) for _ in range(PAYLOADS)]
    stream_id = f"bench-{uuid.uuid4().hex[:12]}"
    if api == "writer":
        # Passed only when asked for: an older SDK's Writer (a comparison run) has no such parameter.
        transport = {} if args.transport == "auto" else {"transport": args.transport}
        if args.buffered:
            client = qstream.Writer(args.address, obs_dim=OBS_DIM, num_branches=BRANCHES, max_batch=max(512, k),
                                    max_in_flight=args.max_in_flight, stream_id=stream_id, **transport)
        else:
            client = qstream.Writer(args.address, obs_dim=OBS_DIM, num_branches=BRANCHES, max_batch=k,
                                    max_delay=1.0, max_in_flight=args.max_in_flight, stream_id=stream_id, **transport)
        env_ids = np.arange(k, dtype=np.uint32)

        def insert(c):
            client.append(c["obs"], c["actions"], c["reward"], c["terminated"], c["truncated"],
                          next_obs=c["next_obs"], env_ids=env_ids)
    else:
        client = qstream.ActorClient(args.address, stream_id=stream_id, batch_size=k,
                                     max_in_flight=args.max_in_flight)

        def insert(c):
            client.send(nstep_batch(c))

    start = args.start_at or time.time() + 1.0
    boundaries = [start + i * args.window_seconds for i in range(args.repeats + 1)]
    marks = []
    n = 0
    # A client that comes up after the first window began measured nothing: it says so.
    late = time.time() - boundaries[0]
    while len(marks) < len(boundaries):
        if time.time() >= boundaries[len(marks)]:
            marks.append((acked_transitions(client), acked_batches(client)))
            continue
        insert(steps[n % PAYLOADS])
        n += 1
    status = "ok" if late <= 0 else f"late: started {late:.1f} s after the first window"
    try:
        client.flush()
    except qstream.QstreamError as e:
        status = str(e)
    acked_total = acked_transitions(client)
    acks_total = acked_batches(client)
    client.close()
    # acks: None when the client does not count acknowledged messages.
    windows = [{"acked": b[0] - a[0], "acks": b[1] - a[1] if a[1] >= 0 else None}
               for a, b in zip(marks, marks[1:])]
    print(json.dumps({
        "client": f"python_{api}" + ("_buffered" if args.buffered else ""),
        "stream": type(getattr(client, "_stream", None)).__name__,  # which transport the Writer took
        "items_per_message": k,
        "window_seconds": args.window_seconds,
        "windows": windows,
        "acked_total": acked_total,
        "acks_total": acks_total if acks_total >= 0 else None,
        "sent_transitions": n * k,
        "error_acks": 0,
        "rtt_p50_us": None,
        "rtt_p99_us": None,
        "status": status,
    }), flush=True)
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
