"""Fixtures starting a real qstreamd on free loopback ports.

The daemon binary comes from $QSTREAM_BUILD_DIR (set by ctest) or ../../../build.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PKG_ROOT = HERE.parent
if str(PKG_ROOT) not in sys.path:
    sys.path.insert(0, str(PKG_ROOT))  # test the working tree, installed or not

_LISTENING = re.compile(r"listening grpc=(\S+) metrics=(\S+)")


def build_dir() -> Path:
    return Path(os.environ.get("QSTREAM_BUILD_DIR", PKG_ROOT.parent.parent / "build"))


def require_native() -> None:
    """Skips the test unless libqstream_native loads ($QSTREAM_NATIVE_LIB,
    set by ctest to the build's library; empty in sanitizer builds, which
    do not build it: an ASan library cannot load into Python)."""
    from qstream import native

    if native.library() is None:
        pytest.skip("libqstream_native is not built here (set QSTREAM_NATIVE_LIB)")


def qstreamd_path() -> Path:
    path = build_dir() / "qstreamd"
    if not path.is_file():
        if "QSTREAM_BUILD_DIR" in os.environ:
            pytest.fail(f"{path} is missing; build the qstreamd target")
        pytest.skip(f"{path} not built")
    return path


class Daemon:
    """One qstreamd child process."""

    def __init__(self, workdir: Path, config_text: str, extra_args=()):
        self.workdir = workdir
        self.config = workdir / "qstreamd.pbtxt"
        self.config.write_text(config_text)
        self.log_path = workdir / "qstreamd.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [
                str(qstreamd_path()),
                f"--config={self.config}",
                "--listen=127.0.0.1:0",
                "--metrics_listen=127.0.0.1:0",
                "--backend=cpu",
                *extra_args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.grpc, self.metrics = self._wait_listening(timeout=60)

    def _wait_listening(self, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _LISTENING.search(self.log_path.read_text())
            if m:
                return m.group(1), m.group(2)
            if self.proc.poll() is not None:
                raise RuntimeError(f"qstreamd exited {self.proc.returncode}:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"qstreamd did not report its ports:\n{self.log_path.read_text()}")

    def status(self, **security):
        """AdminService.Status; `security`: the TLS/token parameters of
        qstream.AdminClient for a daemon that needs them."""
        from qstream import AdminClient

        with AdminClient(self.grpc, **security) as admin:
            return admin.status()

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def start_daemon(tmp_path):
    """Factory: start_daemon(config_text, *extra_args) -> Daemon, stopped at teardown."""
    started = []

    def start(config_text: str, *extra_args) -> Daemon:
        workdir = tmp_path / f"daemon{len(started)}"
        workdir.mkdir()
        d = Daemon(workdir, config_text, extra_args)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
