"""qstream.stream.AioExperienceStream against scripted grpc.aio calls (no
server): how it reads a call's end when grpc.aio hides the daemon's status
behind a failed write (grpc/grpc#36066)."""

import asyncio
import threading

import grpc
import grpc.aio
import pytest

from qstream import AuthError, StreamError
from qstream.proto import experience_pb2
from qstream.stream import AioExperienceStream

HIDDEN = (grpc.StatusCode.INTERNAL, "Internal error from Core")
REFUSED = (grpc.StatusCode.PERMISSION_DENIED, "token not allowed on this method")


def rpc_error(code, details):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class ScriptedCall:
    """One call: ends with `status` at once (the daemon refused it), or
    after `end_after` s; records what was written on it."""

    def __init__(self, status, end_after=0.0):
        self.status = status
        self.end_after = end_after
        self.writes = []
        self._ended = None

    def _end(self):
        if self._ended is None:
            self._ended = asyncio.ensure_future(asyncio.sleep(self.end_after))
        return self._ended

    async def code(self):
        await self._end()
        return self.status[0]

    async def read(self):
        await self._end()
        raise rpc_error(*self.status)

    async def write(self, payload):
        self.writes.append(payload)

    async def done_writing(self):
        pass

    def cancel(self):
        if self._ended is not None:
            self._ended.cancel()


class ScriptedChannel:
    def __init__(self, calls):
        self.calls = list(calls)
        self.made = []
        self.lock = threading.Lock()

    def stream_stream(self, *args, **kwargs):
        def make(metadata=None):
            with self.lock:
                call = self.calls.pop(0) if self.calls else ScriptedCall(REFUSED)
                self.made.append(call)
                return call
        return make

    async def close(self):
        pass


def run_stream(channel, reconnect_timeout_s=5.0):
    """A stream with one batch submitted; returns the error it ends with."""
    stream = AioExperienceStream(lambda: channel, stream_id="t", max_in_flight=4, max_backoff_s=0.05,
                                 reconnect_timeout_s=reconnect_timeout_s)
    with stream.cv:
        stream.submit_locked(experience_pb2.TransitionBatch(kind=experience_pb2.TransitionBatch.KIND_STEP))
    with pytest.raises((AuthError, StreamError)) as e:
        stream.wait_idle(timeout=20)
    stream.abort()
    return e.value


def test_refused_token_behind_a_hidden_status_is_reported_as_refused():
    # The first call's status was hidden by its failed write (it reads as
    # INTERNAL); the next call is refused before anything is written on it,
    # so it must end with the daemon's own status, not a reconnect loop.
    channel = ScriptedChannel([ScriptedCall(HIDDEN, end_after=0.05), ScriptedCall(REFUSED)])
    error = run_stream(channel)
    assert isinstance(error, AuthError), error
    assert error.code == grpc.StatusCode.PERMISSION_DENIED
    assert len(channel.made) == 2
    assert channel.made[0].writes, "the first call wrote the batch"
    assert channel.made[1].writes == [], "nothing is written while the next call may end on its own"


def test_after_a_hidden_status_a_live_call_gets_the_batch():
    # The next call does not end within the probe: the batch is written on it.
    channel = ScriptedChannel([ScriptedCall(HIDDEN, end_after=0.05), ScriptedCall(REFUSED, end_after=1.5)])
    error = run_stream(channel)
    assert isinstance(error, AuthError)
    assert len(channel.made[1].writes) == 1


def test_a_real_internal_error_still_ends_in_the_reconnect_timeout():
    # Every call reads INTERNAL after its write: reconnects, then gives up
    # with the code it saw (the probe only delays the writes).
    channel = ScriptedChannel([ScriptedCall(HIDDEN, end_after=0.7) for _ in range(50)])
    error = run_stream(channel, reconnect_timeout_s=1.0)
    assert isinstance(error, StreamError) and not isinstance(error, AuthError)
    assert "could not reconnect within 1.0s (INTERNAL" in str(error)
    assert all(call.writes for call in channel.made), "each call wrote the batch after the probe"
