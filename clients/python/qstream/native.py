"""The native stream transport: libqstream_native (gRPC C++, built with the
daemon: `<build>/lib/libqstream_native.so`) loaded with ctypes.

qstream.stream.NativeExperienceStream keeps every decision of the stream in
Python (numbering, window, acks, reconnect, errors) and hands the library
only serialized batches and the call's lifecycle. The library writes the
batches in order and queues the acks on gRPC's own threads; ctypes releases
the GIL for each call into it, so a write costs the caller one copy of the
payload and no event-loop hand-off (bench/NOTES.md, "The native stream").

Where the library is looked for, first found wins:
- the file named by $QSTREAM_NATIVE_LIB (an error if it cannot be loaded;
  an empty value turns the native transport off; read at each Writer);
- libqstream_native.so beside this module (a copy made for a deployment);
- libqstream_native.so on the dynamic linker's path (LD_LIBRARY_PATH, ...).

The library links the system's gRPC C++ (not grpcio's): it loads where the
daemon's build dependencies are installed. Without it, Writer(transport=
"auto") uses the grpc.aio stream.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any, Iterable

from qstream.channel import QstreamError, bearer_metadata, channel_pem_parts

ENV_VAR = "QSTREAM_NATIVE_LIB"
LIB_NAME = "libqstream_native.so"


class NativeUnavailable(QstreamError):
    """transport="native" was asked for and libqstream_native cannot be loaded."""


_lock = threading.Lock()
# What each value of $QSTREAM_NATIVE_LIB (None: unset) found: (library or
# None, why not, the error to raise).
_found: dict[str | None, tuple[ctypes.CDLL | None, str, NativeUnavailable | None]] = {}

_c_char_pp = ctypes.POINTER(ctypes.c_char_p)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    lib.qsn_channel_open.argtypes = [cp, cp, sz, cp, sz, cp, sz, _c_char_pp, _c_char_pp,
                                     ctypes.POINTER(ctypes.c_longlong), ctypes.c_int, ctypes.c_char_p, sz]
    lib.qsn_channel_open.restype = vp
    lib.qsn_channel_free.argtypes = [vp]
    lib.qsn_channel_free.restype = None
    lib.qsn_call_start.argtypes = [vp, cp, _c_char_pp, _c_char_pp, ctypes.c_int]
    lib.qsn_call_start.restype = vp
    lib.qsn_call_write.argtypes = [vp, cp, sz]
    lib.qsn_call_write.restype = ctypes.c_int
    lib.qsn_call_writes_done.argtypes = [vp]
    lib.qsn_call_writes_done.restype = None
    lib.qsn_call_read.argtypes = [vp, ctypes.c_void_p, sz, ctypes.c_double, ctypes.POINTER(sz)]
    lib.qsn_call_read.restype = ctypes.c_int
    lib.qsn_call_cancel.argtypes = [vp]
    lib.qsn_call_cancel.restype = None
    lib.qsn_call_finish.argtypes = [vp, ctypes.c_char_p, sz]
    lib.qsn_call_finish.restype = ctypes.c_int
    lib.qsn_call_free.argtypes = [vp]
    lib.qsn_call_free.restype = None
    return lib


def _find(given: str | None) -> tuple[ctypes.CDLL | None, str, NativeUnavailable | None]:
    if given is not None:
        if not given:
            return None, f"${ENV_VAR} is empty (native transport off)", None
        try:
            return _declare(ctypes.CDLL(given)), "", None
        except (OSError, AttributeError) as e:
            return None, str(e), NativeUnavailable(f"${ENV_VAR}={given}: cannot load: {e}")
    errors = []
    for candidate in (str(Path(__file__).with_name(LIB_NAME)), LIB_NAME):
        try:
            return _declare(ctypes.CDLL(candidate)), "", None
        except (OSError, AttributeError) as e:
            errors.append(f"{candidate}: {e}")
    return None, "; ".join(errors), None


def _lookup() -> tuple[ctypes.CDLL | None, str]:
    given = os.environ.get(ENV_VAR)  # read at every Writer: a test or a program may change it
    with _lock:
        if given not in _found:
            _found[given] = _find(given)
        lib, why, error = _found[given]
    if error is not None:
        raise error
    return lib, why


def library() -> ctypes.CDLL | None:
    """The loaded library, or None when it is not found (see the module's
    docstring). Raises NativeUnavailable when $QSTREAM_NATIVE_LIB names a
    file that cannot be loaded."""
    return _lookup()[0]


def require() -> ctypes.CDLL:
    """The loaded library; NativeUnavailable saying where it was looked for."""
    lib, why = _lookup()
    if lib is None:
        raise NativeUnavailable(f"libqstream_native not found ({why}); build it (target qstream_native) "
                                f"and set ${ENV_VAR} to <build>/lib/{LIB_NAME}, or pass transport='aio'")
    return lib


def _strings(values: Iterable[str]) -> Any:
    items = [v.encode() for v in values]
    return (ctypes.c_char_p * max(1, len(items)))(*items)


class Channel:
    """A gRPC C++ channel: TLS when `pems` (root CA, key, cert: PEM bytes or
    None each) is given, with `options` as (key, int | str) pairs."""

    def __init__(self, target: str, pems: tuple[bytes | None, bytes | None, bytes | None] | None,
                 options: Iterable[tuple[str, Any]]):
        self._lib = require()
        keys, strs, ints = [], [], []
        for key, value in options:
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError(f"channel option {key!r}: {value!r} is neither an int nor a str")
            keys.append(key.encode())
            strs.append(value.encode() if isinstance(value, str) else None)
            ints.append(value if isinstance(value, int) else 0)
        n = len(keys)
        c_keys = (ctypes.c_char_p * max(1, n))(*keys)
        c_strs = (ctypes.c_char_p * max(1, n))(*strs)
        c_ints = (ctypes.c_longlong * max(1, n))(*ints)
        ca, key, cert = pems or (None, None, None)  # TLS when ca or cert is given (channel_pem_parts)
        err = ctypes.create_string_buffer(1024)
        handle = self._lib.qsn_channel_open(
            target.encode(), ca, len(ca or b""), key, len(key or b""), cert, len(cert or b""),
            c_keys, c_strs, c_ints, n, err, len(err))
        if not handle:
            raise ValueError(err.value.decode(errors="replace"))
        self._handle: int | None = handle

    def start_call(self, method: str, metadata: Iterable[tuple[str, str]] = ()) -> "Call":
        assert self._handle is not None, "channel is closed"
        metadata = list(metadata)
        handle = self._lib.qsn_call_start(self._handle, method.encode(), _strings(k for k, _ in metadata),
                                          _strings(v for _, v in metadata), len(metadata))
        return Call(self._lib, handle)

    def close(self) -> None:
        """Frees the channel; its calls must have been finished."""
        if self._handle is not None:
            self._lib.qsn_channel_free(self._handle)
            self._handle = None


def open_channel(server: str, *, options: Iterable[tuple[str, Any]] = (), **security: Any
                 ) -> tuple[Channel, tuple[tuple[str, str], ...]]:
    """(channel, metadata) to `server` with the parameters of
    qstream.channel.open_channel (those that are not None), checked by the
    same code; `metadata` (the bearer token, if any) goes with each call.
    The counterpart of qstream.channel.aio_channel_factory."""
    pems, channel_options, token = channel_pem_parts(server, options=options, **security)
    return Channel(server, pems, channel_options), bearer_metadata(token)


class Call:
    """One bidi streaming call (see qstream_native.cc for the contract)."""

    def __init__(self, lib: ctypes.CDLL, handle: int):
        self._lib, self._handle = lib, handle
        self._buf = ctypes.create_string_buffer(4096)
        self._size = ctypes.c_size_t(0)

    def write(self, payload: bytes) -> bool:
        """Queues `payload` (written in order); False when the call has ended."""
        return self._lib.qsn_call_write(self._handle, payload, len(payload)) == 0

    def writes_done(self) -> None:
        self._lib.qsn_call_writes_done(self._handle)

    def read(self, timeout: float | None = None) -> bytes | None:
        """The next message, None once the reads have ended; TimeoutError
        when `timeout` seconds pass first."""
        while True:
            got = self._lib.qsn_call_read(self._handle, self._buf, len(self._buf),
                                          -1.0 if timeout is None else timeout, ctypes.byref(self._size))
            if got == 0:
                return None
            if got < 0:
                raise TimeoutError("no message within the timeout")
            size = self._size.value
            if size <= len(self._buf):
                return ctypes.string_at(self._buf, size)
            self._buf = ctypes.create_string_buffer(size)

    def cancel(self) -> None:
        self._lib.qsn_call_cancel(self._handle)

    def finish(self) -> tuple[int, str]:
        """Waits for the call's end: (gRPC status code, details)."""
        details = ctypes.create_string_buffer(4096)
        code = self._lib.qsn_call_finish(self._handle, details, len(details))
        return code, details.value.decode(errors="replace")

    def free(self) -> None:
        """After finish(): lets go of the call."""
        if self._handle is not None:
            self._lib.qsn_call_free(self._handle)
            self._handle = None
