"""Client-side cost of qstream.Writer, no daemon: appends/s and batches
built + serialized/s, obs_dim 48, 4 action branches.

    python3 clients/python/bench_writer.py [--seconds 1.0] [--repeats 3]

Each cell is the best of --repeats runs (the machine is shared).

The Writer's stream is replaced by a sink that encodes each batch to its
wire bytes (qstream.stream.serialize, as the real stream does) and drops
them, so what is timed is append(), the buffer copies and the encoding,
nothing of gRPC.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qstream import Writer  # noqa: E402
from qstream.stream import serialize  # noqa: E402

OBS_DIM, BRANCHES = 48, 4


class _Sink:
    def __init__(self):
        self.batches = 0
        self.bytes = 0

    def submit_locked(self, batch, tail=()) -> int:
        self.batches += 1
        self.bytes += len(serialize(batch, tail))
        return self.batches


def _writer(max_batch: int) -> tuple[Writer, _Sink]:
    # Nothing listens on port 1: the stream's reader retries in the background
    # and never acknowledges, so the window never frees; the sink replaces it.
    w = Writer("127.0.0.1:1", obs_dim=OBS_DIM, num_branches=BRANCHES, max_batch=max_batch, max_delay=None,
               reconnect_timeout_s=3600)
    sink = _Sink()
    w._stream.submit_locked = sink.submit_locked
    return w, sink


def _rate(fn, seconds: float) -> tuple[float, int]:
    n, start = 0, time.perf_counter()
    while True:
        for _ in range(64):
            fn()
        n += 64
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return n / elapsed, n


def bench(max_batch: int, num_envs: int, stream: bool, seconds: float) -> dict:
    rng = np.random.default_rng(0)
    shape = (OBS_DIM,) if num_envs == 1 else (num_envs, OBS_DIM)
    obs = rng.normal(size=shape).astype(np.float32)
    next_obs = obs + np.float32(0.1)
    action = rng.integers(0, 3, size=(BRANCHES,) if num_envs == 1 else (num_envs, BRANCHES)).astype(np.int32)
    reward = np.float32(1.0) if num_envs == 1 else np.ones(num_envs, np.float32)
    flags = False if num_envs == 1 else np.zeros(num_envs, bool)
    w, sink = _writer(max_batch)
    if stream:  # next_obs not given: the step-stream form (the next append brings it)
        def step():
            w.append(obs, action, reward, flags, flags)
    else:
        def step():
            w.append(obs, action, reward, flags, flags, next_obs=next_obs)
    appends_per_s, appends = _rate(step, seconds)
    w.abort()
    return dict(appends_per_s=appends_per_s, transitions_per_s=appends_per_s * num_envs,
                batches_per_s=sink.batches * appends_per_s / appends, bytes_per_batch=sink.bytes / max(1, sink.batches))


def bench_flush(max_batch: int, seconds: float) -> float:
    """Batches/s of building the Tensor columns from a full buffer and
    serializing them (the flush alone, without the appends)."""
    w, sink = _writer(max_batch)
    rng = np.random.default_rng(1)
    w.append(rng.normal(size=(max_batch - 1, OBS_DIM)), np.zeros((max_batch - 1, BRANCHES)),
             np.ones(max_batch - 1), np.zeros(max_batch - 1, bool), np.zeros(max_batch - 1, bool),
             next_obs=rng.normal(size=(max_batch - 1, OBS_DIM))) if max_batch > 1 else None
    w._n = max_batch  # a full buffer, sent again and again

    def flush_once():
        w._send_buffer_locked()
        w._n = max_batch

    rate, _ = _rate(flush_once, seconds)
    w._n = 0
    w.abort()
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell; the best is shown")
    a = p.parse_args()
    print(f"obs_dim {OBS_DIM}, {BRANCHES} branches, {a.seconds:g} s per cell; rates are per second")
    print(f"{'max_batch':>9} {'envs':>4} {'next_obs':>9} {'appends':>10} {'transitions':>12} {'batches':>9} "
          f"{'bytes/batch':>11}")
    for max_batch in (1, 64, 1024):
        # The last case: every append is one whole batch (max_batch envs per vector step).
        cases = ((1, False), (1, True), (16, False)) + (((max_batch, False),) if max_batch > 16 else ())
        for num_envs, stream in cases:
            r = max((bench(max_batch, num_envs, stream, a.seconds) for _ in range(a.repeats)),
                    key=lambda r: r["appends_per_s"])
            print(f"{max_batch:>9} {num_envs:>4} {'stream' if stream else 'given':>9} {r['appends_per_s']:>10.0f} "
                  f"{r['transitions_per_s']:>12.0f} {r['batches_per_s']:>9.0f} {r['bytes_per_batch']:>11.0f}")
    print("\nflush alone (a full buffer encoded to wire bytes):")
    for max_batch in (1, 64, 1024):
        rate = max(bench_flush(max_batch, a.seconds) for _ in range(a.repeats))
        print(f"  max_batch {max_batch:>5}: {rate:>9.0f} batches/s, {1e6 / rate:7.1f} us/batch, "
              f"{rate * max_batch:>11.0f} transitions/s")


if __name__ == "__main__":
    main()
