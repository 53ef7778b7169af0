"""Writer: the buffered experience writer of the SDK.

    with qstream.Writer("daemon:50051", obs_dim=4, num_branches=1) as w:
        obs, _ = envs.reset()
        while ...:
            next_obs, reward, terminated, truncated, _ = envs.step(action)
            w.append(obs, action, reward, terminated, truncated, next_obs=next_obs)
            obs = next_obs
        acked = w.flush()

Each append() is one env step (a vectorized env: one call per vector step,
leading dimension num_envs; a single env may pass unbatched arrays). Rows
are copied into preallocated numpy columns of `max_batch` transitions (rows
that make whole batches while the buffer is empty and a slot is free are
encoded straight from the caller's arrays instead) and sent as one
KIND_STEP TransitionBatch in the step-stream form (obs, action, reward and
flags per row with env_ids, and the final observation only of
the rows that end an episode: a step's next state is its env's next obs,
which the daemon takes from the next row of that env while it assembles
the n-step returns per env) when the buffer is full, when its oldest row is
`max_delay` seconds old, on flush() and on close(). The batch that flush()
or close() sends goes in the full form (next_obs of every row) when every
row of it came with next_obs, so each env's newest step is complete when
the stream closes. Sending is pipelined:
up to `max_in_flight` batches wait for their ack. The stream itself
(numbering, reconnect and resend, error acks) is qstream.stream: for an
address its grpc.aio form (one event-loop thread writes the batches and
reads the acks) or, where libqstream_native is found, its gRPC C++ form
(qstream.native: the batches written and the acks read on gRPC's own
threads, without the GIL); for a ready grpc.Channel grpc's synchronous
stream.

Several addresses (the ranks of a data-parallel learner: Writer(["h1:p1",
"h2:p2"]) or "h1:p1,h2:p2") make a qstream.spread.SpreadWriter, a Writer
per address with env e's steps going to address e % N; a dns:/// URI is one
address whose channel puts the stream on one of the name's addresses
(round_robin).

Finished episodes are reported with report_episode(return, length): the
reports ride on the next batch that goes out (labelled with the Writer's
`env`), and flush()/close() send them alone when no row is left to carry
them. The daemon counts each once, into qstream_episode_return and
qstream_episode_length_steps.
"""

from __future__ import annotations

import math
import re
import threading
import time
import uuid
from typing import Any, Callable, Iterable

import grpc
import numpy as np
from numpy.typing import ArrayLike

from qstream import native
from qstream.batch import BOOL, F32, I32, U32, StepColumns
from qstream.channel import PathLike, QstreamError, Servers, aio_channel_factory, channel_for, parse_servers
from qstream.proto import experience_pb2
from qstream.stream import (AioExperienceStream, BatchRejected, ExperienceStream, NativeExperienceStream, StreamError,
                            StreamStats)

# Bounds of episode reports fixed by the wire API (proto/episode_limits.h).
MAX_EPISODES_PER_BATCH = 4096
MAX_EPISODE_LENGTH = 1_000_000_000
MAX_ABS_EPISODE_RETURN = 1e12
MAX_ENV_BYTES = 64
_ENV_LABEL = re.compile(r"[A-Za-z0-9_.:/-]*")


class Backpressure(QstreamError):
    """The in-flight window is full and the Writer was made with
    block=False. Nothing of the call that raised it was applied: retry it
    once acks came back (the buffered rows go out as soon as a slot frees)."""


class _Columns:
    """`rows` transitions of every column, preallocated once; final_obs
    holds one row per buffered row that ends an episode, in row order."""

    def __init__(self, rows: int, obs_dim: int, num_branches: int):
        self.obs = np.zeros((rows, obs_dim), F32)
        self.next_obs = np.zeros((rows, obs_dim), F32)  # valid while every row came with next_obs
        self.final_obs = np.zeros((rows, obs_dim), F32)
        self.actions = np.zeros((rows, num_branches), I32)
        self.rewards = np.zeros(rows, F32)
        self.done = np.zeros(rows, BOOL)
        self.truncated = np.zeros(rows, BOOL)
        self.env_ids = np.zeros(rows, U32)


class Writer:
    """Buffered, pipelined KIND_STEP writer over one ExperienceService.Stream.

    Args:
        target: the daemon's host:port or a gRPC target URI such as
            dns:///name:port, or a ready grpc.Channel (then no TLS or token
            parameter: the channel has its own). Several addresses, as a
            list or comma-separated, make a SpreadWriter (qstream.spread):
            one stream per address, env e's steps to address e % N, the
            counts summed; the other parameters apply to each address.
        obs_dim, num_branches: the network's observation width and action
            branches; when None, taken from the first append().
        max_batch: transitions per batch, 1 to the daemon's
            server.max_batch_transitions (default 2048; a larger batch is
            rejected, BatchRejected on `count`).
        max_delay: seconds the oldest buffered row may wait before the
            buffer is sent anyway (checked on append() and by the sender
            thread); None: only by size, flush() and close().
        max_in_flight: batches sent and not yet acknowledged, at most.
        block: what append()/flush()/send() do when their rows must go out
            and the window is full: wait (True) or raise Backpressure.
        step_stream: send batches in the step-stream form (next_obs only of
            the rows that end an episode: half the bytes); False: the full
            form, every append() then needs next_obs.
        stream_id: the ingest session's identity (sequence numbers and
            n-step windows survive reconnects under it); default a fresh
            "py-<uuid>".
        max_backoff_s, reconnect_timeout_s: reconnect backoff cap, and how
            long reconnecting may fail before StreamError.
        on_ack: called as on_ack(ack, stats) from the thread that reads
            the acks (for an address, the stream's event loop, which also
            sends the batches: keep it short and never wait on the Writer).
        env: the environment's name, e.g. "CartPole-v1": the `env` label of
            the daemon's episode metrics for report_episode() (up to 64
            characters of [A-Za-z0-9_.:/-]); None: "unnamed".
        channel_options: extra gRPC channel options (address only).
        tls_ca, tls_cert, tls_key, tls_server_name, token, token_file: as in
            qstream.channel.open_channel.
        transport: for an address, how the stream goes over the wire:
            "native" the gRPC C++ transport of libqstream_native
            (qstream.native; NativeUnavailable when it cannot be loaded),
            "aio" grpc.aio, "auto" (default) native when the library is
            found, else aio. A ready grpc.Channel always takes grpc's
            synchronous stream.
    """

    def __new__(cls, target: Servers | grpc.Channel, *args: Any, **kwargs: Any) -> "Writer":
        # Several addresses make a SpreadWriter (a subclass, so Python then
        # runs its __init__ with the same arguments).
        if cls is Writer and not isinstance(target, grpc.Channel) and len(parse_servers(target)) > 1:
            from qstream.spread import SpreadWriter

            cls = SpreadWriter
        return super().__new__(cls)

    def __init__(
        self,
        target: Servers | grpc.Channel,
        *,
        obs_dim: int | None = None,
        num_branches: int | None = None,
        max_batch: int = 512,
        max_delay: float | None = 0.02,
        max_in_flight: int = 32,
        block: bool = True,
        step_stream: bool = True,
        stream_id: str | None = None,
        max_backoff_s: float = 5.0,
        reconnect_timeout_s: float = 60.0,
        on_ack: Callable[[experience_pb2.Ack, StreamStats], None] | None = None,
        env: str | None = None,
        channel_options: Iterable[tuple[str, Any]] | None = None,
        tls_ca: PathLike | None = None,
        tls_cert: PathLike | None = None,
        tls_key: PathLike | None = None,
        tls_server_name: str | None = None,
        token: str | None = None,
        token_file: PathLike | None = None,
        transport: str = "auto",
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if max_delay is not None and max_delay < 0:
            raise ValueError(f"max_delay must be >= 0 or None, got {max_delay}")
        for name, v in (("obs_dim", obs_dim), ("num_branches", num_branches)):
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if env is not None and (len(env) > MAX_ENV_BYTES or not _ENV_LABEL.fullmatch(env)):
            raise ValueError(f"env: {env!r} is not up to {MAX_ENV_BYTES} characters of [A-Za-z0-9_.:/-]")
        self.env = env or ""
        self.max_batch = int(max_batch)
        self.max_delay = max_delay
        self.block = block
        self.step_stream = step_stream
        self._obs_dim = obs_dim
        self._num_branches = num_branches

        lock = threading.RLock()
        self._cv = threading.Condition(lock)  # acks, free slots: shared with the stream
        self._sender_cv = threading.Condition(lock)  # wakes the sender thread only
        stream_args = dict(stream_id=stream_id or f"py-{uuid.uuid4().hex}", max_in_flight=max_in_flight,
                           max_backoff_s=max_backoff_s, reconnect_timeout_s=reconnect_timeout_s, on_ack=on_ack,
                           cv=self._cv)
        security = dict(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, tls_server_name=tls_server_name,
                        token=token, token_file=token_file)
        self._channel, self._own_channel = None, False
        if transport not in ("auto", "native", "aio"):
            raise ValueError(f"transport must be 'auto', 'native' or 'aio', got {transport!r}")
        if isinstance(target, grpc.Channel):
            if transport == "native":
                raise ValueError("transport='native' takes an address, not a grpc.Channel")
            self._channel, self._own_channel = channel_for(target, options=channel_options or (), **security)
            self._stream = ExperienceStream(self._channel, **stream_args)
        else:
            (target,) = parse_servers(target)
            if transport == "native" or (transport == "auto" and native.library() is not None):
                channel, metadata = native.open_channel(target, options=channel_options or (), **security)
                self._stream = NativeExperienceStream(channel, metadata=metadata, **stream_args)
            else:  # the stream opens its own grpc.aio channel on its event loop
                open_aio, metadata = aio_channel_factory(target, options=channel_options or (), **security)
                self._stream = AioExperienceStream(open_aio, metadata=metadata, **stream_args)
        self._stream.on_acked_locked = self._on_acked_locked

        # The buffer: rows [0, _n) of _buf (and final_obs rows [0, _ends)),
        # the oldest appended at _oldest.
        self._buf: _Columns | None = None
        self._n = 0
        self._ends = 0
        self._all_next = True  # every buffered row came with next_obs
        self._oldest = 0.0
        self._min_version = 0
        self._last_version = 0  # of the latest append: report_episode's default
        # Finished episodes not sent yet: (return, length, policy version).
        self._episodes: list[tuple[float, int, int]] = []
        self._arange = np.arange(0, dtype=U32)

        self._stopping = False
        self._sender_deadline = float("inf")  # when the sender thread wakes by itself
        self._sender_wants_room = False
        if obs_dim is not None and num_branches is not None:
            self._allocate(obs_dim, num_branches)
        self._sender = threading.Thread(target=self._send_loop, name="qstream-writer", daemon=True)
        self._sender.start()

    # ---- public API ------------------------------------------------------

    @property
    def stream_id(self) -> str:
        return self._stream.stream_id

    @property
    def max_in_flight(self) -> int:
        return self._stream.max_in_flight

    @property
    def stats(self) -> StreamStats:
        with self._cv:
            return self._stream.stats_locked()

    @property
    def acked(self) -> int:
        """Sum of Ack.accepted so far (see flush())."""
        with self._cv:
            return self._stream.stats_locked().accepted_transitions

    @property
    def buffered(self) -> int:
        """Transitions in the buffer, not yet sent."""
        with self._cv:
            return self._n

    @property
    def pending_episodes(self) -> int:
        """Episode reports not sent yet (they go with the next batch)."""
        with self._cv:
            return len(self._episodes)

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
        """Adds one env step: obs (obs_dim,) or (num_envs, obs_dim); action
        (num_branches,) / scalar, or (num_envs, num_branches) / (num_envs,);
        reward, terminated, truncated scalars or (num_envs,).

        env_ids: which env each row is (default 0..num_envs-1; an env may
        appear several times, its rows in order). A step's next state is the
        obs of the same env's next append (the daemon chains them: the
        step-stream form, no next_obs on the wire), except for a step that
        ends its episode: its next state is its next_obs row, the final
        observation (required for a truncated step, which bootstraps from
        it; a terminated step without next_obs gets its own obs, never
        bootstrapped from). next_obs rows of steps that do not end their
        episode are sent only in a full-form batch (flush(), close(), or
        step_stream=False): they must equal the env's next obs. The newest
        step of each env whose episode has not ended waits in the daemon for
        that next obs; at close() it has none and is dropped, unless it went
        out with next_obs in the full-form batch of flush()/close().
        terminated and truncated both true is terminated.

        With block=True a call that fills the buffer returns once it went
        out, waiting for a slot while max_in_flight batches are in flight.

        Raises ValueError (naming the argument) for a truncated step without
        next_obs or shapes that do not fit; Backpressure (block=False) when
        the rows do not fit in the buffer and the window is full, without
        applying any of them (a full buffer then goes out, by the sender
        thread, once a slot frees);
        BatchRejected for an earlier batch the daemon rejected (this step is
        then not added); StreamError/AuthError when the stream is unusable.
        """
        obs = np.asarray(obs, dtype=F32)
        if self._obs_dim is None:
            self._obs_dim = int(obs.size if obs.ndim <= 1 else math.prod(obs.shape[1:]))
        d = self._obs_dim
        n = 1 if obs.size == d else (obs.shape[0] if obs.ndim >= 2 else -1)
        if n < 0 or obs.size != n * d:
            raise ValueError(f"obs: shape {obs.shape} is neither ({d},) nor (num_envs, {d})")
        obs = obs.reshape(n, d)
        action = np.asarray(action, dtype=I32)
        if self._num_branches is None:
            if action.size % n:
                raise ValueError(f"action: shape {action.shape} does not fit {n} envs")
            self._num_branches = max(1, action.size // n)
        if self._buf is None:
            self._allocate(d, self._num_branches)
        action = _shaped(action, (n, self._num_branches), "action")
        reward = _shaped(np.asarray(reward, dtype=F32), (n,), "reward")
        terminated = _shaped(np.asarray(terminated, dtype=BOOL), (n,), "terminated")
        truncated = _shaped(np.asarray(truncated, dtype=BOOL), (n,), "truncated")
        truncated = truncated & ~terminated
        if env_ids is None:
            if self._arange.size != n:
                self._arange = np.arange(n, dtype=U32)
            ids = self._arange
        else:
            ids = _shaped(np.asarray(env_ids, dtype=U32), (n,), "env_ids")
        ended = terminated | truncated
        if next_obs is not None:
            next_obs = _shaped(np.asarray(next_obs, dtype=F32), (n, d), "next_obs")
        elif not self.step_stream:
            raise ValueError("next_obs: required by a Writer made with step_stream=False")
        elif truncated.any():
            raise ValueError(
                f"truncated: a truncated step needs next_obs (its final observation); env_ids "
                f"{ids[truncated].tolist()} were truncated without it")
        # The final observations of the rows that end, in row order (a
        # terminated row without next_obs: its own obs stands in).
        final = None
        if ended.any():
            final = (next_obs if next_obs is not None else obs)[ended]
        version = int(policy_version)
        self._last_version = version

        with self._cv:
            self._check_open_locked()
            if n == 0:
                return
            if self._sends_needed_locked(n):
                if not self.block:
                    self._check_room_locked(n)
                else:
                    self._await_room_locked()  # a rejection arriving meanwhile raises, nothing applied
            now = time.monotonic()
            self._put_locked(now, obs, action, reward, terminated, truncated, ids, version,
                             None if final is None else ended, final, next_obs)
            self._after_append_locked(now)

    def report_episode(self, episode_return: float, length: int, policy_version: int | None = None) -> None:
        """Reports a finished episode: its undiscounted return, its length in
        env steps and the policy version it was (last) acted with (default:
        that of the latest append()). The report goes out with the next
        batch, after the rows appended so far (report an episode once the
        append() of its last step is done); flush() and close() send it
        alone when no row is buffered. The daemon counts it once, under this
        Writer's `env`, even across resends.

        Raises ValueError (naming the argument) for a non-finite return or
        one beyond 1e12 in magnitude, a length outside [1, 1e9] or a
        negative policy version; Backpressure (block=False) when
        4096 reports are waiting and the window is full; like append() for
        an earlier rejection or an unusable stream.
        """
        ret = float(episode_return)
        if not math.isfinite(ret) or abs(ret) > MAX_ABS_EPISODE_RETURN:
            raise ValueError(f"episode_return: {ret} is not a finite number in [-1e12, 1e12]")
        length = int(length)
        if not 1 <= length <= MAX_EPISODE_LENGTH:
            raise ValueError(f"length: {length} is not in [1, {MAX_EPISODE_LENGTH}]")
        with self._cv:
            self._check_open_locked()
            version = self._last_version if policy_version is None else int(policy_version)
            if version < 0:
                raise ValueError(f"policy_version: {version} is negative")
            if len(self._episodes) >= MAX_EPISODES_PER_BATCH:
                if not self.block and not self._stream.has_room_locked():
                    raise Backpressure(f"{len(self._episodes)} episode reports wait and "
                                       f"{self._stream.in_flight_locked()} batches are in flight: no room for more")
                self._send_when_room_locked(None)
            self._episodes.append((ret, length, version))

    def send(self, batch: experience_pb2.TransitionBatch) -> int:
        """Sends a ready TransitionBatch (qstream.step_batch/nstep_batch)
        on this stream, after the rows buffered before it; numbers it (sets
        its sequence and stream_id) and returns the sequence. Blocks, or
        raises Backpressure (block=False), while the window is full."""
        with self._cv:
            self._check_open_locked()
            needed = 2 if self._n else 1
            if not self.block and self._stream.free_slots_locked() < needed:
                raise Backpressure(f"{self._stream.in_flight_locked()} of {self._stream.max_in_flight} batches "
                                   f"in flight: no slot for this batch")
            if self._n:
                self._await_room_locked()
                self._send_when_room_locked(None)
            self._await_room_locked()
            self._send_when_room_locked(batch)
            return batch.sequence

    def flush(self, timeout: float | None = None) -> int:
        """Sends the buffered rows, waits until every batch sent so far is
        acknowledged, and returns the transitions acknowledged since the
        Writer started: the sum of Ack.accepted (+ accepted_before). For
        KIND_STEP that is the n-step transitions the daemon inserted; the
        last steps of each env's unfinished episode stay in its n-step
        window (inserted as later steps come, at the episode's end, or at
        close(), which drops a newest step that went out without its
        next_obs). The rows flush() sends go in the full form when all came
        with next_obs. A duplicate ack (a resend after a reconnect whose
        first ack was lost) adds the count of the batch's first insert
        (Ack.accepted_before), which the daemon keeps for a stream_id's
        newest 64 batches, across restarts; older ones add 0.

        Raises BatchRejected (once per rejected batch; call again for the
        count), StreamError/AuthError, TimeoutError after `timeout` seconds,
        or Backpressure (block=False) when the buffer cannot go out because
        the window is full (nothing is lost: it is still buffered).
        """
        return self._flush(timeout, self.block)

    def close(self, timeout: float | None = 30.0) -> int:
        """Flushes (waiting for a free slot even with block=False), half-closes
        the stream, waits for the daemon to end it (it first inserts what
        its n-step windows hold, but for an env's newest step that has no
        next observation: see append()) and closes the channel if the
        Writer opened it. Returns flush()'s count; raises like flush() (a BatchRejected only after the
        buffer went out and every ack came back), after closing all the
        same."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            rejected = None
            while True:  # an earlier rejection must not keep the buffer from going out
                try:
                    acked = self._flush(None if deadline is None else max(0.0, deadline - time.monotonic()), True)
                    break
                except BatchRejected as e:
                    rejected = rejected or e
            if rejected is not None:
                raise rejected
            return acked
        finally:
            self._stop_sender()
            self._stream.close(timeout)
            if self._own_channel:
                self._channel.close()

    def abort(self) -> None:
        """Cancels the stream without sending what is buffered or waiting for
        acks (unacknowledged batches may or may not be in the replay)."""
        self._stop_sender()
        self._stream.abort()
        if self._own_channel:
            self._channel.close()

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # ---- internals (the *_locked ones with _cv held) ---------------------

    def _allocate(self, obs_dim: int, num_branches: int) -> None:
        self._obs_dim, self._num_branches = obs_dim, num_branches
        self._buf = _Columns(self.max_batch, obs_dim, num_branches)
        self._columns = StepColumns(obs_dim, num_branches)

    def _check_open_locked(self) -> None:
        """Raises a pending rejection or failure, or StreamError once the
        Writer is closed."""
        self._stream.raise_pending_locked()
        if self._stopping:
            raise StreamError("the Writer is closed")

    def _sends_needed_locked(self, k: int) -> int:
        """Batches that must go out so that `k` more rows fit in the buffer."""
        over = self._n + k - self.max_batch
        return -(-over // self.max_batch) if over > 0 else 0

    def _check_room_locked(self, k: int) -> None:
        """Raises Backpressure unless `k` more rows fit: the batches that must
        go out so that the rest fits in the buffer each need a free slot."""
        if self._sends_needed_locked(k) > self._stream.free_slots_locked():
            raise Backpressure(
                f"{self._stream.in_flight_locked()} of {self._stream.max_in_flight} batches in flight and "
                f"{self._n} of {self.max_batch} rows buffered: no room for {k} more")

    def _put_locked(self, now, obs, actions, rewards, done, truncated, env_ids, version: int, ended, final,
                    next_obs) -> None:
        """Copies k rows into the buffer, sending it each time it fills and
        more rows follow (waiting for a slot: block=False callers checked);
        `final` holds the final obs of the rows `ended` marks (None: no row
        ends); next_obs, when not None, is kept for a full-form batch. A
        batch carries the smallest policy version of its rows. Rows that
        make a whole batch while the buffer is empty go out from the
        caller's arrays, the same batch without the copy into the buffer,
        once a slot is free (with block=False only when one is free now)."""
        k = obs.shape[0]
        b = self._buf
        w = 0
        e = 0  # rows of `final` copied
        while w < k:
            m = min(self.max_batch - self._n, k - w)
            src = slice(w, w + m)
            ends = 0 if final is None else int(np.count_nonzero(ended[src]))
            if m == self.max_batch and self.block and not self._stream.has_room_locked():
                self._wait_for_slot_locked()  # then send them as they are, unless another thread buffered rows
                continue
            if m == self.max_batch and self._stream.has_room_locked():
                c = np.ascontiguousarray  # a view unless the caller's array is strided
                self._submit_rows_locked(m, version, c(obs[src]), c(actions[src]), c(rewards[src]), c(done[src]),
                                         c(truncated[src]), c(env_ids[src]),
                                         c(final[e:e + ends]) if ends else None,
                                         None if next_obs is None else c(next_obs[src]))
                w += m
                e += ends
                continue
            if self._n == self.max_batch:
                self._send_when_room_locked(None)
                continue  # the sender thread may have sent it meanwhile
            dst = slice(self._n, self._n + m)
            b.obs[dst] = obs[src]
            if next_obs is None:
                self._all_next = False
            elif self._all_next:
                b.next_obs[dst] = next_obs[src]
            b.actions[dst] = actions[src]
            b.rewards[dst] = rewards[src]
            b.done[dst] = done[src]
            b.truncated[dst] = truncated[src]
            b.env_ids[dst] = env_ids[src]
            if ends:
                b.final_obs[self._ends:self._ends + ends] = final[e:e + ends]
                self._ends += ends
                e += ends
            if self._n == 0:
                self._oldest = now
                self._min_version = version
            elif version < self._min_version:
                self._min_version = version
            self._n += m
            w += m

    def _after_append_locked(self, now: float) -> None:
        """Sends a full or overdue buffer when a slot is free (a full one
        after waiting for a slot, with block=True: no thread hand-off on the
        common path); otherwise makes sure the sender thread wakes when it
        is due."""
        if not self._n:
            return
        full = self._n == self.max_batch
        due = full or (self.max_delay is not None and now - self._oldest >= self.max_delay)
        if due and (self._stream.has_room_locked() or (full and self.block)):
            self._send_when_room_locked(None)
            return
        if self._sender_wants_room:
            return  # the next ack wakes it
        wake_at = now if due else (self._oldest + self.max_delay if self.max_delay is not None else None)
        if wake_at is not None and wake_at < self._sender_deadline:
            self._sender_cv.notify()

    def _await_room_locked(self, deadline: float | None = None) -> None:
        """Waits for a free slot; raises a BatchRejected that arrived
        meanwhile (or the stream's failure), or TimeoutError."""
        s = self._stream
        if s.has_room_locked():
            return
        ok = self._cv.wait_for(lambda: s.has_room_locked() or s.raisable_locked(),
                               None if deadline is None else max(0.0, deadline - time.monotonic()))
        s.raise_pending_locked()
        if not ok:
            raise TimeoutError(f"no free slot: {s.in_flight_locked()} batches still unacknowledged")

    def _wait_for_slot_locked(self, deadline: float | None = None) -> None:
        """Waits for a free slot; raises only the stream's failure (a
        rejection waits for the caller's next call), or TimeoutError."""
        s = self._stream
        if s.has_room_locked():
            return
        ok = self._cv.wait_for(lambda: s.has_room_locked() or s.failure_locked() is not None,
                               None if deadline is None else max(0.0, deadline - time.monotonic()))
        if s.failure_locked() is not None:
            raise s.failure_locked()
        if not ok:
            raise TimeoutError(f"no free slot: {s.in_flight_locked()} batches still unacknowledged")

    def _send_when_room_locked(self, batch, deadline: float | None = None, full: bool = False) -> None:
        """Sends `batch` (None: the buffer; in the full form when `full` and
        every row has next_obs) once a slot is free."""
        s = self._stream
        self._wait_for_slot_locked(deadline)
        if batch is None:
            if self._n or self._episodes:  # the sender thread may have sent it while we waited
                self._send_buffer_locked(full)
        else:
            s.submit_locked(batch)

    def _send_buffer_locked(self, full: bool = False) -> None:
        """Sends the buffered rows with the waiting episode reports (at most
        MAX_EPISODES_PER_BATCH of them, which report_episode keeps to); with
        no row, a batch of count 0 that carries the reports alone. The full
        form when asked (flush, close) or without step_stream, and every row
        has next_obs; else the step-stream form."""
        n, b = self._n, self._buf
        full_form = (full or not self.step_stream) and self._all_next
        if n:
            self._submit_rows_locked(n, self._min_version, b.obs[:n], b.actions[:n], b.rewards[:n], b.done[:n],
                                     b.truncated[:n], b.env_ids[:n], b.final_obs[:self._ends],
                                     b.next_obs[:n] if full_form else None, full_form)
        else:
            self._submit_rows_locked(0, 0)
        self._n = 0
        self._ends = 0
        self._all_next = True

    def _submit_rows_locked(self, n: int, version: int, obs=None, actions=None, rewards=None, done=None,
                            truncated=None, env_ids=None, final_obs=None, next_obs=None,
                            full_form: bool | None = None) -> None:
        """Submits n rows (C-contiguous arrays of the wire dtypes, encoded and
        copied out before it returns) as one batch with the waiting episode
        reports: the full form when `full_form` (None: when not step_stream
        and next_obs is given), else the step-stream form with final_obs."""
        episodes, self._episodes = self._episodes, []
        if not n:
            version = min((v for _, _, v in episodes), default=0)
        head = experience_pb2.TransitionBatch(kind=experience_pb2.TransitionBatch.KIND_STEP, count=n,
                                              policy_version=version)
        if episodes:
            head.env = self.env
            for ret, length, v in episodes:
                head.episodes.add(episode_return=ret, length=length, policy_version=v)
        columns = ()
        if n:
            if full_form is None:
                full_form = not self.step_stream and next_obs is not None
            columns = self._columns.encode(obs, actions, rewards, done, truncated, env_ids,
                                           final_obs=None if full_form else final_obs,
                                           next_obs=next_obs if full_form else None)
        self._stream.submit_locked(head, columns)  # copies the columns out: the arrays are free again

    def _flush(self, timeout: float | None, block: bool) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._stream.raise_pending_locked()
            if self._n or self._episodes:
                if not block and not self._stream.has_room_locked():
                    raise Backpressure(
                        f"{self._stream.in_flight_locked()} batches in flight: the {self._n} buffered rows "
                        f"and {len(self._episodes)} episode reports cannot go out yet")
                self._await_room_locked(deadline)
                self._send_when_room_locked(None, deadline, full=True)
        self._stream.wait_idle(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self.acked

    def _on_acked_locked(self) -> None:
        if self._sender_wants_room:
            self._sender_cv.notify()

    def _stop_sender(self) -> None:
        with self._cv:
            self._stopping = True
            self._sender_cv.notify()
        if self._sender is not threading.current_thread():
            self._sender.join()

    def _send_loop(self) -> None:
        """Sends the buffer when it is due (full, or max_delay old) and a slot
        is free, so rows go out while the caller does not append."""
        s = self._stream
        with self._cv:
            while not self._stopping:
                now = time.monotonic()
                timeout = None
                self._sender_wants_room = False
                if self._n and s.failure_locked() is None:
                    due_at = now if self._n == self.max_batch else (
                        self._oldest + self.max_delay if self.max_delay is not None else None)
                    if due_at is not None and due_at <= now:
                        if s.has_room_locked():
                            try:
                                self._send_buffer_locked()
                            except StreamError:
                                pass  # closed meanwhile: the caller hears of it
                            continue
                        self._sender_wants_room = True
                    elif due_at is not None:
                        timeout = due_at - now
                self._sender_deadline = float("inf") if timeout is None else now + timeout
                self._sender_cv.wait(timeout)
            self._sender_wants_room = False


def _shaped(a: np.ndarray, shape: tuple, name: str) -> np.ndarray:
    if a.shape == shape:
        return a
    if a.size != math.prod(shape):
        raise ValueError(f"{name}: shape {a.shape} does not fit {shape}")
    return a.reshape(shape)
