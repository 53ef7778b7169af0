"""ExperienceStream: the numbered, reconnecting ExperienceService.Stream call
under qstream.Writer (and through it ActorClient and run_actor), on grpc's
synchronous API (a ready grpc.Channel); AioExperienceStream is the same
stream on grpc.aio (the Writer's for an address).

- Numbering: batches get sequence 1, 2, ... under one stream_id; each is
  serialized once and kept, as bytes, until its Ack arrives.
- Window: at most `max_in_flight` batches are unacknowledged; the owner
  checks has_room_locked() before submit_locked().
- Reconnect: when the call breaks (daemon restart, network) a new call is
  opened after an exponential backoff and every unacknowledged batch is
  resent with its stream_id and sequence; the daemon acknowledges one it
  already inserted again with accepted = 0, duplicate = true and
  accepted_before = what its first arrival inserted (while the daemon
  remembers it: its newest 64 batches, across restarts), without inserting
  it twice, and that ack settles the batch.
- Takeover: a call ended with ABORTED lost its stream_id to a newer stream
  of the same identity; the stream gives way (StreamError) instead of
  taking the session back.
- Errors: an error ack becomes a BatchRejected that the owner raises from
  its next call (the stream carries on); a refused token an AuthError; a
  protocol error, or no reconnect within reconnect_timeout_s, a StreamError.

Every method named *_locked expects the caller to hold `cv`, the condition
shared with the owner: acks notify it, so the owner can wait on its own
predicates (a free slot, no batch in flight) with cv.wait_for.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import grpc.aio

from qstream.channel import QstreamError, auth_error, is_token_refused
from qstream.proto import experience_pb2

STREAM_METHOD = "/qstream.v1.ExperienceService/Stream"
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}

# Codes after which resending cannot help: the daemon refused the stream
# (a refused token, UNAUTHENTICATED/PERMISSION_DENIED, raises AuthError).
_FATAL_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ABORTED,  # another stream took this stream_id over
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}

_FIRST_BACKOFF_S = 0.1
_IDLE = object()  # AioExperienceStream's writer: nothing to write yet


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
    # Sum of Ack.accepted + Ack.accepted_before: transitions the daemon
    # confirmed are in its replay (KIND_STEP: assembled n-step transitions).
    # A duplicate ack adds its first insert's count when the daemon still
    # knows it (its newest 64 batches of the stream_id), else 0.
    accepted_transitions: int = 0
    replay_size: int = 0
    daemon_policy_version: int = 0
    throttle: bool = False
    # Acks with throttle set, and the in-flight window now (max_in_flight,
    # halved on a throttled ack; see Ack.throttle).
    throttled_acks: int = 0
    window: int = 0
    reconnects: int = 0


def serialize(batch: experience_pb2.TransitionBatch, tail=()) -> bytes:
    """The wire bytes of `batch` followed by `tail`, encoded fields of the
    same message (protobuf merges concatenated fields into one message)."""
    payload = batch.SerializeToString()
    return b"".join((payload, *tail)) if tail else payload


@dataclass
class _Sent:
    payload: bytes
    count: int


class ExperienceStream:
    def __init__(
        self,
        channel: grpc.Channel | None,
        *,
        stream_id: str,
        max_in_flight: int,
        max_backoff_s: float,
        reconnect_timeout_s: float,
        on_ack=None,
        cv: threading.Condition | None = None,
    ):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        # Requests go out already serialized (bytes): a resend after a
        # reconnect costs no second serialization.
        if channel is not None:  # None: a subclass opens its own
            self._call_stream = channel.stream_stream(
                STREAM_METHOD, request_serializer=None, response_deserializer=experience_pb2.Ack.FromString
            )
        self.stream_id = stream_id
        self.max_in_flight = max_in_flight
        # AIMD on Ack.throttle: halved on a throttled ack at most once per
        # window of acks, +1 per unthrottled ack, within [1, max_in_flight].
        self._window = max_in_flight
        self._acks_since_cut = max_in_flight  # the first throttled ack cuts at once
        self._max_backoff_s = max_backoff_s
        self._reconnect_timeout_s = reconnect_timeout_s
        self._on_ack = on_ack
        self.cv = cv or threading.Condition()

        self._unacked: collections.OrderedDict[int, _Sent] = collections.OrderedDict()
        self._next_sequence = 1
        self._rejected: list[BatchRejected] = []
        self._fatal: QstreamError | None = None
        self._closing = False
        self._aborted = False  # stop at once, unacknowledged batches or not
        self._stats = StreamStats(window=max_in_flight)
        self._queue: queue.Queue | None = None
        self._call = None
        # Called (cv held) after each ack settled a batch: the owner's hook
        # for waking a thread that waits for a free slot on its own condition.
        self.on_acked_locked: Callable[[], None] | None = None

        self._reader = threading.Thread(target=self._run, name="qstream-acks", daemon=True)
        self._reader.start()

    # ---- called with cv held ---------------------------------------------

    def has_room_locked(self) -> bool:
        return len(self._unacked) < self._window

    def free_slots_locked(self) -> int:
        return max(0, self._window - len(self._unacked))

    def in_flight_locked(self) -> int:
        return len(self._unacked)

    def raisable_locked(self) -> bool:
        """A rejected batch or a fatal error waits to be raised."""
        return bool(self._rejected) or self._fatal is not None

    def failure_locked(self) -> QstreamError | None:
        """The error that ended the stream, if any."""
        return self._fatal

    def raise_pending_locked(self) -> None:
        """Raises the oldest BatchRejected (once), or the fatal error."""
        if self._rejected:
            raise self._rejected.pop(0)
        if self._fatal is not None:
            raise self._fatal

    def submit_locked(self, batch: experience_pb2.TransitionBatch, tail=()) -> int:
        """Numbers `batch` (sets sequence and stream_id on it), serializes it
        followed by `tail` (already encoded fields of the same message, as
        buffers) and queues it for the call. The caller has checked
        has_room_locked(). Returns the sequence."""
        if self._closing:
            raise StreamError("stream is closed")
        seq = self._next_sequence
        self._next_sequence += 1
        batch.sequence = seq
        batch.stream_id = self.stream_id
        sent = _Sent(serialize(batch, tail), batch.count)
        self._unacked[seq] = sent
        self._stats.sent_batches += 1
        self._stats.sent_transitions += sent.count
        self._enqueue_locked(sent.payload)
        return seq

    def stats_locked(self) -> StreamStats:
        return StreamStats(**vars(self._stats))

    # ---- lifecycle (cv not held) -----------------------------------------

    def wait_idle(self, timeout: float | None) -> None:
        """Waits until every batch is acknowledged; raises BatchRejected or
        the fatal error, or TimeoutError."""
        with self.cv:
            if not self.cv.wait_for(lambda: self.raisable_locked() or not self._unacked, timeout):
                raise TimeoutError(f"{len(self._unacked)} batches still unacknowledged")
            self.raise_pending_locked()

    def close(self, timeout: float | None) -> None:
        """Half-closes the call and waits (up to `timeout`) for the daemon to
        end it (at a clean half-close it first flushes the n-step windows
        into its replay); cancels it when it does not end in time."""
        with self.cv:
            self._closing = True
            self._end_writes_locked()
            self.cv.notify_all()
        self._reader.join(timeout)
        if self._reader.is_alive():
            self.abort()

    def abort(self) -> None:
        """Cancels the call and stops the reader without waiting for acks."""
        with self.cv:
            self._closing = self._aborted = True
            self._end_writes_locked()
            call = self._call
            self.cv.notify_all()
        if call is not None:
            self._cancel(call)
        self._reader.join()

    # ---- the transport: grpc's synchronous stream ------------------------

    def _enqueue_locked(self, payload: bytes) -> None:
        if self._queue is not None:
            self._queue.put(payload)

    def _end_writes_locked(self) -> None:
        if self._queue is not None:
            self._queue.put(None)

    def _cancel(self, call) -> None:
        call.cancel()

    # ---- the ack reader thread -------------------------------------------

    @staticmethod
    def _requests(q: queue.Queue):
        while True:
            item = q.get()
            if item is None:
                return
            yield item

    def _open_call(self):
        """A new call fed by a fresh queue holding every unacknowledged batch."""
        with self.cv:
            if self._queue is not None:
                self._queue.put(None)  # ends the previous call's request iterator
            if self._aborted:
                return None
            q: queue.Queue = queue.Queue()
            for sent in self._unacked.values():
                q.put(sent.payload)
            if self._closing:
                q.put(None)
            self._queue = q
            self._call = self._call_stream(self._requests(q))
            return self._call

    def _handle_ack(self, ack) -> None:
        with self.cv:
            sent = self._unacked.pop(ack.sequence, None)
            s = self._stats
            s.replay_size = ack.replay_size
            s.daemon_policy_version = ack.policy_version
            s.throttle = ack.throttle
            self._acks_since_cut += 1
            if ack.throttle:
                s.throttled_acks += 1
                if self._acks_since_cut >= self._window:
                    self._window = max(1, self._window // 2)
                    self._acks_since_cut = 0
            elif self._window < self.max_in_flight:
                self._window += 1
            s.window = self._window
            if sent is not None:
                s.acked_batches += 1
                if ack.HasField("error") and (ack.error.field or ack.error.message):
                    code = experience_pb2.Error.Code.Name(ack.error.code)
                    self._rejected.append(BatchRejected(ack.sequence, ack.error.field, ack.error.message, code))
                else:
                    # A duplicate's count is its first insert's (accepted_before).
                    s.accepted_transitions += ack.accepted + ack.accepted_before
                if self.on_acked_locked is not None:
                    self.on_acked_locked()
            self.cv.notify_all()
            snapshot = StreamStats(**vars(s)) if self._on_ack is not None else None
        if self._on_ack is not None:
            self._on_ack(ack, snapshot)

    def _serve_call(self, call) -> tuple[bool, grpc.RpcError | None]:
        """Handles the call's acks until it ends: (whether an ack came, the
        call's error or None for a clean end)."""
        acked = False
        try:
            for ack in call:
                self._handle_ack(ack)
                acked = True
        except grpc.RpcError as e:
            return acked, e
        return acked, None

    def _run(self) -> None:
        backoff = _FIRST_BACKOFF_S
        failing_since = None
        while True:
            call = self._open_call()
            if call is None:
                return
            acked, error = self._serve_call(call)
            if acked:
                backoff, failing_since = _FIRST_BACKOFF_S, None
            if error is None:
                with self.cv:
                    if self._closing and not self._unacked:
                        return
            elif self._ends_stream(error):
                return
            now = time.monotonic()
            failing_since = failing_since or now
            if self._gave_up(error, now - failing_since):
                return
            with self.cv:
                # Sleeps out the backoff, but wakes at once on abort.
                if self.cv.wait_for(lambda: self._aborted, backoff):
                    return
            backoff = min(backoff * 2, self._max_backoff_s)
            with self.cv:
                self._stats.reconnects += 1

    def _ends_stream(self, e: grpc.RpcError) -> bool:
        """Whether the call's error `e` ends the stream (an abort, a clean
        close, a refused token, a fatal code) rather than a reconnect."""
        with self.cv:
            if self._aborted or (self._closing and not self._unacked):
                return True
        if is_token_refused(e):
            self._fail(auth_error("ExperienceService.Stream", e))
            return True
        if e.code() in _FATAL_CODES:
            self._fail(StreamError(f"stream ended by the daemon: {e.code().name}: {e.details()}"))
            return True
        return False

    def _gave_up(self, error: grpc.RpcError | None, failing_s: float) -> bool:
        """Fails the stream once reconnecting failed for reconnect_timeout_s."""
        if failing_s <= self._reconnect_timeout_s:
            return False
        detail = f"{error.code().name}: {error.details()}" if error is not None else "stream ended"
        self._fail(StreamError(f"could not reconnect within {self._reconnect_timeout_s}s ({detail})"))
        return True

    def _fail(self, error: QstreamError) -> None:
        with self.cv:
            self._fatal = error
            if self.on_acked_locked is not None:
                self.on_acked_locked()
            self.cv.notify_all()


# grpc.aio reports a write that Core refused, because the daemon had already
# ended the call, as INTERNAL "Internal error from Core", over the status the
# daemon sent (grpc/grpc#36066; the fix, PR #43486, is not in grpcio 1.85): a refused token,
# sent before the first batch could go out, read as a transient error until
# reconnect_timeout_s. After such an error the next call writes nothing for
# up to this long, so a call the daemon ends at once (a refused token) shows
# its own status.
_LOST_STATUS_PROBE_S = 0.5


def _status_lost(error: grpc.RpcError | None) -> bool:
    """Whether `error` is grpc.aio's stand-in for a status a failed write hid."""
    return (error is not None and error.code() == grpc.StatusCode.INTERNAL
            and "Internal error from Core" in (error.details() or ""))


class AioExperienceStream(ExperienceStream):
    """The same stream on grpc.aio: one event-loop thread writes the batches
    (await call.write) and reads the acks. The synchronous stream hands every
    batch to grpc's request-iterator thread, which waits for each send before
    taking the next, and every ack to grpc's channel thread and then the ack
    reader, each a wake-up that needs the GIL; here a batch wakes the loop
    only when its writer is idle, and an ack is handled where it is read.

    `open_channel` makes the grpc.aio channel (called on the loop's thread,
    which owns and closes it); `metadata` goes with every call."""

    def __init__(self, open_channel: Callable[[], "grpc.aio.Channel"], *, metadata=(), **kwargs):
        self._open_aio_channel = open_channel
        self._metadata = tuple(metadata) or None
        self._loop = asyncio.new_event_loop()
        self._pending: collections.deque[bytes] = collections.deque()  # for the current call, in order
        self._writer_idle = False
        self._wake: asyncio.Event | None = None  # the writer's, set on the loop
        self._stop: asyncio.Event | None = None  # cuts a backoff short on abort
        super().__init__(None, **kwargs)

    def _enqueue_locked(self, payload: bytes) -> None:
        self._pending.append(payload)
        self._wake_writer_locked()

    def _end_writes_locked(self) -> None:
        self._wake_writer_locked()
        if self._aborted:
            self._call_soon(lambda: self._stop is not None and self._stop.set())

    def _cancel(self, call) -> None:
        self._call_soon(call.cancel)

    def _wake_writer_locked(self) -> None:
        if self._writer_idle:
            self._writer_idle = False
            self._call_soon(lambda: self._wake is not None and self._wake.set())

    def _call_soon(self, fn) -> None:
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:
            pass  # the loop has ended: nothing left to wake

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._run_async())
        finally:
            self._loop.close()

    async def _run_async(self) -> None:
        self._wake, self._stop = asyncio.Event(), asyncio.Event()
        channel = self._open_aio_channel()
        try:
            self._call_stream = channel.stream_stream(
                STREAM_METHOD, request_serializer=None, response_deserializer=experience_pb2.Ack.FromString
            )
            await self._run_calls()
        finally:
            await channel.close()

    async def _run_calls(self) -> None:
        backoff = _FIRST_BACKOFF_S
        failing_since = None
        error = None
        while True:
            with self.cv:
                if self._aborted:
                    return
                self._pending = collections.deque(sent.payload for sent in self._unacked.values())
                self._writer_idle = False
                call = self._call = self._call_stream(metadata=self._metadata)
            writer = None
            if not (_status_lost(error) and await self._ends_unwritten(call)):
                writer = asyncio.ensure_future(self._write(call))
            error = None
            try:
                while True:
                    ack = await call.read()
                    if ack is grpc.aio.EOF:
                        break
                    self._handle_ack(ack)
                    backoff, failing_since = _FIRST_BACKOFF_S, None
                with self.cv:
                    if self._closing and not self._unacked:
                        return
            except grpc.RpcError as e:
                error = e
                if self._ends_stream(e):
                    return
            except asyncio.CancelledError:  # call.cancel() from abort()
                with self.cv:
                    if self._aborted:
                        return
            finally:
                if writer is not None:
                    writer.cancel()
            now = time.monotonic()
            failing_since = failing_since or now
            if self._gave_up(error, now - failing_since):
                return
            try:
                await asyncio.wait_for(self._stop.wait(), backoff)
                return  # aborted
            except asyncio.TimeoutError:
                pass
            backoff = min(backoff * 2, self._max_backoff_s)
            with self.cv:
                self._stats.reconnects += 1

    @staticmethod
    async def _ends_unwritten(call) -> bool:
        """Whether `call` ends within _LOST_STATUS_PROBE_S with nothing
        written on it (its status is then the daemon's, which the read
        raises); else the writer starts."""
        try:
            await asyncio.wait_for(asyncio.shield(call.code()), _LOST_STATUS_PROBE_S)
            return True
        except asyncio.TimeoutError:
            return False

    async def _write(self, call) -> None:
        """Writes the call's batches in order as they are submitted, and
        half-closes it once the stream is closing and none is left."""
        try:
            while True:
                with self.cv:
                    if self._pending:
                        payload = self._pending.popleft()
                    elif self._closing:
                        payload = None
                    else:
                        self._writer_idle = True
                        self._wake.clear()
                        payload = _IDLE
                if payload is _IDLE:
                    await self._wake.wait()
                elif payload is None:
                    await call.done_writing()
                    return
                else:
                    await call.write(payload)
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the call ended: the reader sees why and reconnects or stops


class _NativeRpcError(grpc.RpcError):
    """A native call's end status, read as grpc's errors are (code(), details())."""

    def __init__(self, code: int, details: str):
        super().__init__(f"{_STATUS_CODES.get(code, grpc.StatusCode.UNKNOWN).name}: {details}")
        self._code = _STATUS_CODES.get(code, grpc.StatusCode.UNKNOWN)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class NativeExperienceStream(ExperienceStream):
    """The same stream on libqstream_native (qstream.native: gRPC C++ under
    ctypes). A batch is written by the thread that submits it (one copy of
    the payload, the GIL released) and gRPC's own threads write the rest of
    the queue in order; the ack reader thread blocks in the library (GIL
    released) and handles each ack as the synchronous stream does. The call
    is written to, cancelled and dropped only with cv held, so abort() never
    reaches a call the reader has freed.

    `channel` is a qstream.native.Channel (the stream owns and closes it);
    `metadata` goes with every call."""

    def __init__(self, channel, *, metadata=(), **kwargs):
        self._native_channel = channel
        self._metadata = tuple(metadata)
        super().__init__(None, **kwargs)

    def _enqueue_locked(self, payload: bytes) -> None:
        if self._call is not None:
            self._call.write(payload)  # False: the call has ended; the batch is resent on the next one

    def _end_writes_locked(self) -> None:
        if self._call is not None:
            if self._aborted:
                self._call.cancel()
            else:
                self._call.writes_done()

    def _cancel(self, call) -> None:
        pass  # cancelled by _end_writes_locked, with cv held

    def _open_call(self):
        with self.cv:
            if self._aborted:
                return None
            call = self._native_channel.start_call(STREAM_METHOD, self._metadata)
            for sent in self._unacked.values():
                call.write(sent.payload)
            if self._closing:
                call.writes_done()
            self._call = call
            return call

    def _finish(self, call) -> grpc.RpcError | None:
        """Ends `call` (dropped first, so no other thread reaches it) and
        returns its error, None for OK."""
        with self.cv:
            self._call = None
        code, details = call.finish()
        call.free()
        return None if code == 0 else _NativeRpcError(code, details)

    def _serve_call(self, call) -> tuple[bool, grpc.RpcError | None]:
        acked = False
        try:
            while (data := call.read()) is not None:
                self._handle_ack(experience_pb2.Ack.FromString(data))
                acked = True
        finally:
            error = self._finish(call)
        return acked, error

    def _run(self) -> None:
        try:
            super()._run()
        finally:
            self._native_channel.close()
