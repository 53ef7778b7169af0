"""qstream.native: where the Writer's gRPC C++ transport is looked for, and
what a Writer does when it is or is not there (no daemon needed: a Writer
connects on its first batch)."""

import os
import subprocess
import sys

import grpc
import pytest
from conftest import require_native
from fake_daemon import FakeDaemon

import qstream
from qstream import NativeUnavailable, Writer, native
from qstream.stream import AioExperienceStream, NativeExperienceStream

ADDRESS = "127.0.0.1:1"  # nothing is sent


def stream_of(**kw):
    w = Writer(ADDRESS, obs_dim=2, num_branches=1, **kw)
    try:
        return type(w._stream)
    finally:
        w.abort()


def test_an_unloadable_library_is_an_error_naming_the_variable_and_the_file(monkeypatch, tmp_path):
    bogus = tmp_path / "libqstream_native.so"
    bogus.write_bytes(b"not an ELF file")
    monkeypatch.setenv(native.ENV_VAR, str(bogus))
    with pytest.raises(NativeUnavailable, match=f"QSTREAM_NATIVE_LIB={bogus}: cannot load"):
        native.library()
    for transport in ("auto", "native"):  # asked for by name: never a silent fallback
        with pytest.raises(NativeUnavailable, match="QSTREAM_NATIVE_LIB="):
            Writer(ADDRESS, obs_dim=2, num_branches=1, transport=transport)


def test_an_empty_variable_turns_the_native_transport_off(monkeypatch):
    monkeypatch.setenv(native.ENV_VAR, "")
    assert native.library() is None
    assert stream_of() is AioExperienceStream
    with pytest.raises(NativeUnavailable, match="QSTREAM_NATIVE_LIB is empty .*transport='aio'"):
        Writer(ADDRESS, obs_dim=2, num_branches=1, transport="native")


def test_auto_takes_the_library_when_it_loads_and_aio_when_asked():
    require_native()
    assert stream_of() is NativeExperienceStream
    assert stream_of(transport="native") is NativeExperienceStream
    assert stream_of(transport="aio") is AioExperienceStream


def test_actor_client_passes_the_transport_to_its_writer(monkeypatch):
    client = qstream.ActorClient(ADDRESS, transport="aio")
    try:
        assert type(client.writer._stream) is AioExperienceStream
    finally:
        client.writer.abort()
    monkeypatch.setenv(native.ENV_VAR, "")
    with pytest.raises(NativeUnavailable):
        qstream.ActorClient(ADDRESS, transport="native")


def test_bad_transport_arguments_are_named():
    with pytest.raises(ValueError, match="transport must be 'auto', 'native' or 'aio', got 'tcp'"):
        Writer(ADDRESS, obs_dim=2, num_branches=1, transport="tcp")
    channel = grpc.insecure_channel(ADDRESS)
    try:
        with pytest.raises(ValueError, match="transport='native' takes an address"):
            Writer(channel, obs_dim=2, num_branches=1, transport="native")
    finally:
        channel.close()


def test_a_channel_option_of_another_type_is_named():
    require_native()
    with pytest.raises(ValueError, match="channel option 'grpc.x': 1.5 is neither an int nor a str"):
        Writer(ADDRESS, obs_dim=2, num_branches=1, transport="native", channel_options=[("grpc.x", 1.5)])


@pytest.mark.parametrize("daemon", [False, True])
def test_a_program_that_never_closes_its_writer_exits_cleanly(daemon):
    """The stream's reader thread blocks inside the library (a daemon
    thread) and gRPC's own threads keep running: the interpreter must still
    exit at once and without a crash, whether the stream is reconnecting
    (nothing listens) or connected with batches in flight."""
    require_native()
    d = FakeDaemon() if daemon else None
    try:
        address = d.address if d is not None else ADDRESS
        code = ("import numpy as np, qstream\n"
                f"w = qstream.Writer({address!r}, obs_dim=2, num_branches=1, transport='native', max_batch=8)\n"
                "for k in range(40):\n"
                "    w.append(np.ones((4, 2)), [0] * 4, [1.0] * 4, [False] * 4, [False] * 4,\n"
                "             next_obs=np.ones((4, 2)))\n"
                "print('sent', flush=True)\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout == "sent\n"
    finally:
        if d is not None:
            d.stop()


def test_writers_opened_and_closed_one_after_another_leave_the_process_sound():
    """Each close() drops the Writer's channel; its last reference must not
    go on a gRPC callback thread (the channel's destructor frees that
    thread's completion queue): that aborted ~1 in 7 closes (a double free
    or "ref_counted.h assertion failed: prior > 0") before the call was
    freed on the Python side. 200 Writers one after another in each of three
    child processes, each Writer sending a few batches and closing; every
    child must exit cleanly (the old code failed this about half the time)."""
    require_native()
    d = FakeDaemon()
    try:
        code = ("import numpy as np, qstream\n"
                "for i in range(200):\n"
                f"    w = qstream.Writer({d.address!r}, obs_dim=2, num_branches=1, transport='native', max_batch=8)\n"
                "    for k in range(4):\n"
                "        w.append(np.ones((4, 2)), [0] * 4, [1.0] * 4, [k % 5 == 4] * 4, [False] * 4,\n"
                "                 next_obs=np.ones((4, 2)))\n"
                "    w.close()\n"
                "print('closed', flush=True)\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # Three at once: the window is narrow, and busy cores widen it.
        children = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True) for _ in range(3)]
        for child in children:
            out, err = child.communicate(timeout=120)
            assert child.returncode == 0, err[-2000:]
            assert out == "closed\n"
    finally:
        d.stop()


def test_the_package_exports_the_error():
    assert qstream.NativeUnavailable is NativeUnavailable
