"""ActorClient: streams experience to a qstreamd over one bidi
ExperienceService.Stream call.

- Batching: add_steps() buffers transitions and sends a batch every
  `batch_size`; send() sends a ready TransitionBatch.
- Backpressure: at most `max_in_flight` batches wait for their Ack; sending
  blocks until the daemon catches up (it stops reading while its learner is
  behind, so the actor slows down instead of buffering without bound).
- Reconnect: when the call breaks (daemon restart, network), the client
  reconnects with exponential backoff and resends every unacknowledged
  batch with the same stream_id and sequence (numbered from 1); the daemon
  acknowledges already-inserted ones again (Ack.duplicate) without
  inserting them twice, and such an ack counts as acknowledged.
- Takeover: a stream ended with ABORTED lost its stream_id to a newer
  stream of the same identity; the client gives way (StreamError) instead
  of taking the session back.
- Errors: a batch the daemon rejects raises BatchRejected (naming the
  field) from the next send()/flush(); the stream itself stays usable. A
  refused token raises AuthError (qstream.channel), without retrying.
- Security: tls_ca/tls_cert/tls_key/tls_server_name/token/token_file as in
  qstream.channel.open_channel.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import uuid
from dataclasses import dataclass

import grpc

from qstream.batch import concat, step_batch
from qstream.channel import PathLike, QstreamError, auth_error, is_token_refused, open_channel
from qstream.proto import experience_pb2, experience_pb2_grpc

# Codes after which resending cannot help: the daemon refused the stream
# (a refused token, UNAUTHENTICATED/PERMISSION_DENIED, raises AuthError).
_FATAL_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ABORTED,  # another stream took this stream_id over
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}


class BatchRejected(QstreamError):
    """The daemon rejected a batch; nothing of it was inserted."""

    def __init__(self, sequence: int, field: str, message: str, code: str = ""):
        super().__init__(f"batch {sequence} rejected: field '{field}': {message}")
        self.sequence = sequence
        self.field = field
        self.message = message
        self.code = code


class StreamError(QstreamError):
    """The stream is unusable: the daemon ended it with a protocol error, or
    reconnecting did not succeed within reconnect_timeout_s."""


@dataclass
class StreamStats:
    sent_batches: int = 0
    acked_batches: int = 0
    sent_transitions: int = 0
    # Sum of Ack.accepted: transitions the daemon confirmed are in its replay
    # (KIND_STEP: assembled n-step transitions).
    accepted_transitions: int = 0
    replay_size: int = 0
    daemon_policy_version: int = 0
    throttle: bool = False
    reconnects: int = 0


class ActorClient:
    def __init__(
        self,
        server: str,
        *,
        stream_id: str | None = None,
        batch_size: int = 256,
        max_in_flight: int = 8,
        max_backoff_s: float = 5.0,
        reconnect_timeout_s: float = 60.0,
        on_ack=None,
        channel_options: list | None = None,
        tls_ca: PathLike | None = None,
        tls_cert: PathLike | None = None,
        tls_key: PathLike | None = None,
        tls_server_name: str | None = None,
        token: str | None = None,
        token_file: PathLike | None = None,
    ):
        """Opens the stream to the daemon at `server` (host:port); the TLS and
        token parameters are those of qstream.channel.open_channel (a
        ValueError names a file that cannot be read)."""
        if max_in_flight < 1 or batch_size < 1:
            raise ValueError("batch_size and max_in_flight must be >= 1")
        self._channel = open_channel(
            server, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, tls_server_name=tls_server_name,
            token=token, token_file=token_file, options=channel_options or (),
        )
        self._stub = experience_pb2_grpc.ExperienceServiceStub(self._channel)
        self.stream_id = stream_id or f"py-{uuid.uuid4().hex}"
        self.batch_size = batch_size
        self.max_in_flight = max_in_flight
        self._max_backoff_s = max_backoff_s
        self._reconnect_timeout_s = reconnect_timeout_s
        self._on_ack = on_ack

        self._cv = threading.Condition()
        self._unacked: collections.OrderedDict[int, experience_pb2.TransitionBatch] = collections.OrderedDict()
        self._next_sequence = 1
        self._rejected: list[BatchRejected] = []
        self._fatal: QstreamError | None = None
        self._closing = False
        self._aborted = False  # stop at once, unacknowledged batches or not
        self._stats = StreamStats()
        self._queue: queue.Queue | None = None
        self._call = None
        self._buffer: list = []
        self._buffered = 0

        self._reader = threading.Thread(target=self._run, name="qstream-acks", daemon=True)
        self._reader.start()

    # ---- sending ---------------------------------------------------------

    def add_steps(self, obs, actions, rewards, next_obs, done, truncated=None, env_ids=None, policy_version=0):
        """Buffers n one-step transitions (see qstream.batch.step_batch) and
        sends a batch once batch_size are buffered."""
        b = step_batch(obs, actions, rewards, next_obs, done, truncated, env_ids, policy_version)
        self._buffer.append(b)
        self._buffered += b.count
        if self._buffered >= self.batch_size:
            self._send_buffer()

    def _send_buffer(self) -> None:
        if not self._buffer:
            return
        batch = concat(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
        self._buffer, self._buffered = [], 0
        self.send(batch)

    def send(self, batch: experience_pb2.TransitionBatch) -> int:
        """Numbers and sends one batch; blocks while max_in_flight batches
        are unacknowledged. Returns its sequence. Raises BatchRejected for an
        earlier batch the daemon rejected (this one is then not sent), or
        StreamError."""
        with self._cv:
            self._cv.wait_for(lambda: self._raisable() or len(self._unacked) < self.max_in_flight)
            self._raise_pending()
            if self._closing:
                raise StreamError("client is closed")
            seq = self._next_sequence
            self._next_sequence += 1
            batch.sequence = seq
            batch.stream_id = self.stream_id
            if batch.kind == experience_pb2.TransitionBatch.KIND_UNSPECIFIED:  # the daemon requires one
                batch.kind = (experience_pb2.TransitionBatch.KIND_STEP if len(batch.done)
                              else experience_pb2.TransitionBatch.KIND_NSTEP)
            self._unacked[seq] = batch
            self._stats.sent_batches += 1
            self._stats.sent_transitions += batch.count
            if self._queue is not None:
                self._queue.put(batch)
            return seq

    def flush(self, timeout: float | None = None) -> None:
        """Sends what add_steps() buffered and waits until every batch is
        acknowledged. Raises BatchRejected/StreamError, or TimeoutError."""
        self._send_buffer()
        with self._cv:
            if not self._cv.wait_for(lambda: self._raisable() or not self._unacked, timeout):
                raise TimeoutError(f"{len(self._unacked)} batches still unacknowledged")
            self._raise_pending()

    def close(self, timeout: float | None = 30.0) -> None:
        """Flushes, half-closes the stream and waits for the daemon to end it."""
        try:
            self.flush(timeout)
        finally:
            with self._cv:
                self._closing = True
                if self._queue is not None:
                    self._queue.put(None)
                self._cv.notify_all()
            self._reader.join(timeout)
            if self._reader.is_alive():
                self._abort()
            self._channel.close()

    def __enter__(self) -> "ActorClient":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abort()
            self._channel.close()

    def _abort(self) -> None:
        """Cancels the call and stops the reader without waiting for acks."""
        with self._cv:
            self._closing = self._aborted = True
            if self._queue is not None:
                self._queue.put(None)
            call = self._call
            self._cv.notify_all()
        if call is not None:
            call.cancel()
        self._reader.join()

    @property
    def stats(self) -> StreamStats:
        with self._cv:
            return StreamStats(**vars(self._stats))

    # ---- internals -------------------------------------------------------

    def _raisable(self) -> bool:
        return bool(self._rejected) or self._fatal is not None

    def _raise_pending(self) -> None:
        if self._rejected:
            raise self._rejected.pop(0)
        if self._fatal is not None:
            raise self._fatal

    @staticmethod
    def _requests(q: queue.Queue):
        while True:
            item = q.get()
            if item is None:
                return
            yield item

    def _open_call(self):
        """A new call fed by a fresh queue holding every unacknowledged batch."""
        with self._cv:
            if self._queue is not None:
                self._queue.put(None)  # ends the previous call's request iterator
            if self._aborted:
                return None
            q: queue.Queue = queue.Queue()
            for batch in self._unacked.values():
                q.put(batch)
            if self._closing:
                q.put(None)
            self._queue = q
            self._call = self._stub.Stream(self._requests(q))
            return self._call

    def _handle_ack(self, ack) -> None:
        with self._cv:
            batch = self._unacked.pop(ack.sequence, None)
            s = self._stats
            s.replay_size = ack.replay_size
            s.daemon_policy_version = ack.policy_version
            s.throttle = ack.throttle
            if batch is not None:
                s.acked_batches += 1
                if ack.HasField("error") and (ack.error.field or ack.error.message):
                    code = experience_pb2.Error.Code.Name(ack.error.code)
                    self._rejected.append(BatchRejected(ack.sequence, ack.error.field, ack.error.message, code))
                else:
                    s.accepted_transitions += ack.accepted
            self._cv.notify_all()
            snapshot = StreamStats(**vars(s))
        if self._on_ack is not None:
            self._on_ack(ack, snapshot)

    def _run(self) -> None:
        backoff = 0.1
        failing_since = None
        while True:
            call = self._open_call()
            if call is None:
                return
            try:
                for ack in call:
                    self._handle_ack(ack)
                    backoff, failing_since = 0.1, None
                with self._cv:
                    if self._closing and not self._unacked:
                        return
                error = None
            except grpc.RpcError as e:
                error = e
                with self._cv:
                    if self._aborted or (self._closing and not self._unacked):
                        return
                if is_token_refused(e):
                    self._fail(auth_error("ExperienceService.Stream", e))
                    return
                if e.code() in _FATAL_CODES:
                    self._fail(StreamError(f"stream ended by the daemon: {e.code().name}: {e.details()}"))
                    return
            now = time.monotonic()
            failing_since = failing_since or now
            if now - failing_since > self._reconnect_timeout_s:
                detail = f"{error.code().name}: {error.details()}" if error is not None else "stream ended"
                self._fail(StreamError(f"could not reconnect within {self._reconnect_timeout_s}s ({detail})"))
                return
            with self._cv:
                # Sleeps out the backoff, but wakes at once on abort.
                if self._cv.wait_for(lambda: self._aborted, backoff):
                    return
            backoff = min(backoff * 2, self._max_backoff_s)
            with self._cv:
                self._stats.reconnects += 1

    def _fail(self, error: QstreamError) -> None:
        with self._cv:
            self._fatal = error
            self._cv.notify_all()
