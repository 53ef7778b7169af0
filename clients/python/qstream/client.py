"""ActorClient: the SDK's original interface to ExperienceService.Stream, a
thin layer over qstream.Writer (one code path for the stream).

- Batching: add_steps() buffers ready transitions (explicit next_obs) and
  sends a batch of exactly `batch_size` each time that many are buffered;
  send() sends a ready TransitionBatch after them. No time-based flush.
- Backpressure: at most `max_in_flight` batches wait for their Ack; sending
  blocks until the daemon catches up (it stops reading while its learner is
  behind, so the actor slows down instead of buffering without bound).
- Reconnect, takeover and errors: those of qstream.stream (resend with the
  same stream_id and sequence; ABORTED gives way with StreamError; a
  rejected batch raises BatchRejected from the next send()/flush(); a
  refused token AuthError).
- Security: tls_ca/tls_cert/tls_key/tls_server_name/token/token_file as in
  qstream.channel.open_channel.
- Several ranks: `server` as in qstream.Writer ("h1:p1,h2:p2", a list, or a
  dns:/// URI); with several addresses env e's steps go to address e % N
  (so pass env_ids: without them every row is env 0, on the first address),
  send() takes the addresses in turn and refuses KIND_STEP batches, and
  flush() sums the counts.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np
from numpy.typing import ArrayLike

from qstream.channel import PathLike, Servers
from qstream.proto import experience_pb2
from qstream.stream import BatchRejected, StreamError, StreamStats
from qstream.writer import Writer

__all__ = ["ActorClient", "BatchRejected", "StreamError", "StreamStats"]


class ActorClient:
    def __init__(
        self,
        server: Servers,
        *,
        stream_id: str | None = None,
        batch_size: int = 256,
        max_in_flight: int = 32,
        max_backoff_s: float = 5.0,
        reconnect_timeout_s: float = 60.0,
        on_ack: Callable[[experience_pb2.Ack, StreamStats], None] | None = None,
        channel_options: Iterable[tuple[str, Any]] | None = None,
        tls_ca: PathLike | None = None,
        tls_cert: PathLike | None = None,
        tls_key: PathLike | None = None,
        tls_server_name: str | None = None,
        token: str | None = None,
        token_file: PathLike | None = None,
        transport: str = "auto",
    ) -> None:
        """Opens the stream to the daemon at `server` (host:port, or several:
        see the module docstring); the TLS and token parameters are those of
        qstream.channel.open_channel (a ValueError names a file that cannot
        be read) and apply to every address; `transport` is the Writer's
        ("auto", "native" or "aio")."""
        if max_in_flight < 1 or batch_size < 1:
            raise ValueError("batch_size and max_in_flight must be >= 1")
        self.batch_size = batch_size
        self._writer = Writer(
            server, max_batch=batch_size, max_delay=None, max_in_flight=max_in_flight, block=True,
            stream_id=stream_id, max_backoff_s=max_backoff_s, reconnect_timeout_s=reconnect_timeout_s,
            on_ack=on_ack, channel_options=channel_options, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
            tls_server_name=tls_server_name, token=token, token_file=token_file, transport=transport,
        )

    @property
    def stream_id(self) -> str:
        return self._writer.stream_id

    @property
    def max_in_flight(self) -> int:
        return self._writer.max_in_flight

    @property
    def writer(self) -> Writer:
        return self._writer

    def add_steps(
        self,
        obs: ArrayLike,
        actions: ArrayLike,
        rewards: ArrayLike,
        next_obs: ArrayLike,
        done: ArrayLike,
        truncated: ArrayLike | None = None,
        env_ids: ArrayLike | None = None,
        policy_version: int = 0,
    ) -> None:
        """Buffers n one-step transitions (the arguments of
        qstream.batch.step_batch; env_ids unset: all env 0) and sends a batch
        each time batch_size are buffered."""
        obs = np.asarray(obs, dtype=np.float32)
        n = obs.shape[0] if obs.ndim else 1
        obs = obs.reshape(n, -1)
        self._writer.append(
            obs, np.asarray(actions).reshape(n, -1), rewards, done,
            np.zeros(n, bool) if truncated is None else truncated,
            next_obs=np.asarray(next_obs, dtype=np.float32).reshape(n, -1),
            env_ids=np.zeros(n, np.uint32) if env_ids is None else env_ids,
            policy_version=policy_version,
        )

    def send(self, batch: experience_pb2.TransitionBatch) -> int:
        """Numbers and sends one batch (after what add_steps() buffered);
        blocks while max_in_flight batches are unacknowledged. Returns its
        sequence. Raises BatchRejected for an earlier batch the daemon
        rejected (this one is then not sent), or StreamError."""
        if batch.kind == experience_pb2.TransitionBatch.KIND_UNSPECIFIED:  # the daemon requires one
            batch.kind = (experience_pb2.TransitionBatch.KIND_STEP if batch.HasField("done")
                          else experience_pb2.TransitionBatch.KIND_NSTEP)
        return self._writer.send(batch)

    def flush(self, timeout: float | None = None) -> int:
        """Sends what add_steps() buffered and waits until every batch is
        acknowledged; returns stats.accepted_transitions (Writer.flush).
        Raises BatchRejected/StreamError, or TimeoutError."""
        return self._writer.flush(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Flushes, half-closes the stream and waits for the daemon to end it."""
        self._writer.close(timeout)

    def __enter__(self) -> "ActorClient":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._writer.__exit__(exc_type, *exc)

    @property
    def stats(self) -> StreamStats:
        return self._writer.stats
