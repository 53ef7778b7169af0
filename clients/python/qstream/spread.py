"""SpreadWriter: one Writer per rank of a data-parallel learner.

``Writer(["h1:p1", "h2:p2"], ...)`` (or ``Writer("h1:p1,h2:p2", ...)``)
makes one of these: the ranks are qstreamd daemons with a replay shard each
and the same weights. Each address gets a Writer of its own (channel,
stream, buffer and in-flight window), whose stream_id is
"<stream_id>/<k>" for address k, so that two entries reaching the same
daemon cannot take each other's ingest session over.

Rows go by env id: env e's steps go to address e % N, so its n-step window
stays on one rank. Episode reports and send()'s ready batches go to the
addresses in turn. flush()/close() return the acknowledged count summed over
the addresses, and `stats` is the sum of their StreamStats.

Every public method of Writer is here too, with two differences: append()
is not atomic across addresses (a BatchRejected or StreamError of one
address that arrives during the call leaves the rows of the addresses before
it applied; one that arrived earlier is raised before any row is), and
block=False is refused (a Backpressure could not leave the call unapplied).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from qstream.batch import F32, U32
from qstream.channel import QstreamError, Servers, parse_servers
from qstream.proto import experience_pb2
from qstream.stream import StreamStats
from qstream.writer import Writer


class SpreadWriter(Writer):
    """A Writer over several addresses; made by Writer() for a `target`
    that names more than one (see the module docstring). Its state is the
    per-address Writers: it does not run Writer.__init__ for itself."""

    def __init__(self, target: Servers, *, stream_id: str | None = None, block: bool = True, **kwargs: Any) -> None:
        if not block:
            raise ValueError("block=False takes one address: with several, a Backpressure could leave part of "
                             "an append() applied")
        self.servers = parse_servers(target)
        self._stream_id = stream_id or f"py-{uuid.uuid4().hex}"
        self._lanes: list[Writer] = []
        try:
            for k, server in enumerate(self.servers):
                self._lanes.append(Writer(server, stream_id=f"{self._stream_id}/{k}", **kwargs))
        except BaseException:
            for lane in self._lanes:
                lane.abort()
            raise
        first = self._lanes[0]
        self.env, self.max_batch, self.max_delay, self.block = first.env, first.max_batch, first.max_delay, True
        self._last_version = 0
        self._turn = 0  # the address of the next episode report or sent batch

    @property
    def stream_id(self) -> str:
        """The base of the streams' ids: address k's is "<stream_id>/<k>"."""
        return self._stream_id

    @property
    def max_in_flight(self) -> int:
        """Per address."""
        return self._lanes[0].max_in_flight

    @property
    def stats(self) -> StreamStats:
        """Summed over the addresses: counts, windows and replay sizes add
        up (the replay over the shards), the policy version is the newest,
        throttle is set when any address throttles."""
        total = StreamStats()
        for s in (lane.stats for lane in self._lanes):
            for name, value in vars(s).items():
                if name == "daemon_policy_version":
                    total.daemon_policy_version = max(total.daemon_policy_version, value)
                elif name == "throttle":
                    total.throttle = total.throttle or value
                else:
                    setattr(total, name, getattr(total, name) + value)
        return total

    @property
    def acked(self) -> int:
        return sum(lane.acked for lane in self._lanes)

    @property
    def buffered(self) -> int:
        return sum(lane.buffered for lane in self._lanes)

    @property
    def pending_episodes(self) -> int:
        return sum(lane.pending_episodes for lane in self._lanes)

    def append(
        self,
        obs: ArrayLike,
        action: ArrayLike,
        reward: ArrayLike,
        terminated: ArrayLike,
        truncated: ArrayLike,
        next_obs: ArrayLike | None = None,
        env_ids: ArrayLike | None = None,
        policy_version: int = 0,
    ) -> None:
        """Writer.append(), each row to address env_id % N."""
        self._last_version = int(policy_version)
        for lane in self._lanes:  # an error that already arrived goes before any row is applied
            with lane._cv:
                lane._check_open_locked()
        obs = np.asarray(obs, dtype=F32)
        n_lanes = len(self._lanes)
        if obs.ndim <= 1:  # one env, unbatched
            lane = 0 if env_ids is None else int(np.asarray(env_ids).reshape(-1)[0]) % n_lanes
            self._lanes[lane].append(obs, action, reward, terminated, truncated, next_obs, env_ids, policy_version)
            return
        n = obs.shape[0]
        ids = np.arange(n, dtype=U32) if env_ids is None else _rows(env_ids, n, "env_ids").astype(U32)
        columns = dict(action=_rows(action, n, "action"), reward=_rows(reward, n, "reward"),
                       terminated=_rows(terminated, n, "terminated"), truncated=_rows(truncated, n, "truncated"),
                       next_obs=None if next_obs is None else _rows(next_obs, n, "next_obs"))
        lane_of = ids % n_lanes
        for k, lane in enumerate(self._lanes):
            rows = np.flatnonzero(lane_of == k)
            if rows.size:
                lane.append(obs[rows], env_ids=ids[rows], policy_version=policy_version,
                            **{name: None if c is None else c[rows] for name, c in columns.items()})

    def report_episode(self, episode_return: float, length: int, policy_version: int | None = None) -> None:
        """Writer.report_episode() on the addresses in turn (the default
        policy version is that of the latest append() to any of them)."""
        version = self._last_version if policy_version is None else policy_version
        self._next_lane().report_episode(episode_return, length, version)

    def send(self, batch: experience_pb2.TransitionBatch) -> int:
        """Writer.send() on the addresses in turn. A KIND_STEP batch is a
        ValueError: its envs' n-step windows would be split over ranks (use
        append(), which keeps each env on one address, or KIND_NSTEP)."""
        if batch.kind == experience_pb2.TransitionBatch.KIND_STEP:
            raise ValueError("send: a KIND_STEP batch over several addresses would split its envs' n-step "
                             "windows; use append() or KIND_NSTEP batches")
        return self._next_lane().send(batch)

    def flush(self, timeout: float | None = None) -> int:
        """Writer.flush() of every address; returns the sum of their counts.
        Every address is flushed before the first error is raised."""
        return self._each(lambda lane, left: lane.flush(left), timeout)

    def close(self, timeout: float | None = 30.0) -> int:
        """Writer.close() of every address; returns the sum of their counts.
        Every address is closed before the first error is raised."""
        return self._each(lambda lane, left: lane.close(left), timeout)

    def abort(self) -> None:
        for lane in self._lanes:
            lane.abort()

    def _next_lane(self) -> Writer:
        lane = self._lanes[self._turn % len(self._lanes)]
        self._turn += 1
        return lane

    def _each(self, call, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        total = 0
        error: BaseException | None = None
        for lane in self._lanes:
            try:
                total += call(lane, None if deadline is None else max(0.0, deadline - time.monotonic()))
            except (QstreamError, TimeoutError) as e:
                error = error or e
        if error is not None:
            raise error
        return total


def _rows(a: ArrayLike, n: int, name: str) -> np.ndarray:
    """`a` as n rows: (n,) for one value per env, else (n, -1)."""
    a = np.asarray(a)
    if a.size == n and a.ndim <= 1:
        return a.reshape(n)
    if n == 0 or a.size % n:
        raise ValueError(f"{name}: shape {a.shape} does not fit {n} envs")
    return a.reshape(n, -1)
