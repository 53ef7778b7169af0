"""The SDK as a package (ctest python_sdk_packaging; not collected by the
python_sdk run, whose pytest only picks up test_*.py): build the sdist from
a copy of the repository (clients/python and proto/, nothing else), the
wheel from that sdist, install the wheel into a fresh venv with its
dependencies from PyPI, and run a smoke there: the message helpers, the
gym extra left out, and a round trip with a real qstreamd.

Nothing is skipped: a missing venv module, build tool, PyPI or daemon
fails the test. The build frontend is pinned here (BUILD_VERSION) and
installed into its own venv, so the system Python needs only venv.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

BUILD_VERSION = "1.6.1"  # pypa/build

HERE = Path(__file__).resolve().parent
PKG_SRC = HERE.parent  # clients/python
REPO = PKG_SRC.parent.parent
STUBS = [f"{name}_pb2{kind}" for name in ("admin", "config", "experience", "policy")
         for kind in (".py", "_grpc.py", ".pyi")]


def run(cmd, *, cwd=None, timeout=120, env=None):
    """Runs `cmd`; fails the test with its output when it fails."""
    try:
        r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(map(str, cmd))} timed out after {timeout}s:\n{e.stdout}\n{e.stderr}")
    if r.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}")
    return r.stdout + r.stderr


def clean_env():
    """The environment without anything that would point a build or the
    venv back at the checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "QSTREAM_PROTO_DIR", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def venv(path: Path) -> Path:
    run([sys.executable, "-m", "venv", path], timeout=120)
    python = path / "bin" / "python"
    if not python.is_file():
        pytest.fail(f"python3 -m venv made no {python} (install python3-venv: deploy/install-deps.sh)")
    return python


SMOKE = textwrap.dedent('''
    import importlib.util, sys
    from pathlib import Path
    import numpy as np
    import qstream
    from qstream import ActorClient, PolicyWatcher, Writer, fetch_policy, nstep_batch, step_batch
    from qstream.batch import to_numpy
    from qstream.proto import experience_pb2, policy_pb2

    venv, server = Path(sys.argv[1]).resolve(), sys.argv[2]
    pkg = Path(qstream.__file__).resolve().parent
    assert venv in pkg.parents, f"qstream imported from {pkg}, not the venv"
    assert (pkg / "py.typed").is_file(), "py.typed missing"
    assert (pkg / "_proto" / "experience_pb2.pyi").is_file(), "type stubs of the messages missing"
    assert not (pkg.parent / "pyproject.toml").exists()

    # The message helpers, without a daemon.
    b = step_batch(np.ones((3, 4)), [0, 1, 0], [1.0, 0.5, 0.0], np.zeros((3, 4)), [False, False, True],
                   env_ids=[0, 1, 2])
    assert b.kind == experience_pb2.TransitionBatch.KIND_STEP and b.count == 3
    again = experience_pb2.TransitionBatch.FromString(b.SerializeToString())
    np.testing.assert_array_equal(to_numpy(again.obs), np.ones((3, 4), np.float32))
    n = nstep_batch(np.ones((2, 4)), [[1], [0]], [0.5, 1.5], [0.99, 0.0], np.zeros((2, 4)))
    assert n.kind == experience_pb2.TransitionBatch.KIND_NSTEP
    assert list(to_numpy(n.discounts)) == [np.float32(0.99), 0.0]

    # gymnasium is the `gym` extra, not a dependency.
    assert importlib.util.find_spec("gymnasium") is None, "gymnasium was installed without the extra"
    try:
        qstream.run_actor("CartPole-v1", server, total_steps=1)
    except ImportError as e:
        assert "qstream[gym]" in str(e), e
    else:
        raise AssertionError("run_actor without gymnasium did not raise ImportError")

    # A real daemon.
    policy = fetch_policy(server, timeout=30)
    assert policy.arch.obs_dim == 4 and policy.greedy(np.zeros((1, 4))).shape == (1, 1)
    with PolicyWatcher(server) as watcher, ActorClient(server) as client:
        client.send(nstep_batch(np.random.default_rng(0).normal(size=(64, 4)), np.zeros((64, 1)),
                                np.ones(64), np.full(64, 0.99), np.zeros((64, 4))))
        assert client.flush(timeout=30) == 64
        assert watcher.version >= 0
    with Writer(server, obs_dim=4, num_branches=1) as w:
        w.append(np.zeros(4), 1, 1.0, True, False)
        w.flush(timeout=30)
    print("smoke ok", qstream.__version__, pkg)
''')


def test_sdist_builds_a_wheel_that_installs_into_a_fresh_venv(tmp_path, start_daemon):
    env = clean_env()

    # A repository with only what the package is built from.
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "proto", repo / "proto")
    src = repo / "clients" / "python"
    shutil.copytree(PKG_SRC, src, ignore=shutil.ignore_patterns(
        "tests", "_proto", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))

    # sdist, then the wheel from the unpacked sdist (build's default), in an
    # isolated environment with the build-system.requires of pyproject.toml.
    tools = venv(tmp_path / "tools")
    run([tools, "-m", "pip", "install", "-q", f"build=={BUILD_VERSION}"], env=env)
    dist = tmp_path / "dist"
    log = run([tools, "-m", "build", "--outdir", dist, src], cwd=tmp_path, env=env, timeout=240)
    assert "Building wheel from sdist" in log
    sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in dist.iterdir())

    # The sdist is self-contained: the generated stubs, no proto/ needed.
    with tarfile.open(sdists[0]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = {f"qstream/_proto/{s}" for s in STUBS} - names
    assert not missing, f"sdist lacks {sorted(missing)}"
    assert {"qstream/py.typed", "setup.py", "pyproject.toml", "qstream/_protogen.py"} <= names

    # And so is a wheel built from it a second time, away from any proto/.
    unpacked = tmp_path / "unpacked"
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(unpacked, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (sdist_dir,) = unpacked.iterdir()
    dist2 = tmp_path / "dist2"
    run([tools, "-m", "build", "--wheel", "--outdir", dist2, sdist_dir], cwd=tmp_path, env=env, timeout=240)
    assert len(list(dist2.glob("*.whl"))) == 1

    with zipfile.ZipFile(wheels[0]) as whl:
        names = set(whl.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(whl.read(meta_name).decode())
    missing = {f"qstream/_proto/{s}" for s in STUBS} | {"qstream/py.typed", "qstream/__init__.py"}
    assert not missing - names, f"wheel lacks {sorted(missing - names)}"
    requires = {r.split(";")[0].replace(" ", ""): r for r in meta.get_all("Requires-Dist")}
    for name in ("grpcio", "protobuf", "numpy"):
        spec = next((r for r in requires if r.startswith(name + "<") or r.startswith(name + ">")), None)
        assert spec and "<" in spec and ">=" in spec, f"{name}: no lower and upper bound in {sorted(requires)}"
    gym = [r for r in meta.get_all("Requires-Dist") if r.startswith("gymnasium")]
    assert gym and all('extra == "gym"' in r for r in gym), gym
    assert "gym" in meta.get_all("Provides-Extra")

    # A fresh venv: the wheel and its dependencies from PyPI, nothing else.
    python = venv(tmp_path / "venv")
    run([python, "-m", "pip", "install", "-q", wheels[0]], env=env, timeout=240)
    assert (tmp_path / "venv" / "bin" / "qstream-actor-py").is_file()
    run([tmp_path / "venv" / "bin" / "qstream-actor-py", "--help"], cwd=tmp_path, env=env)

    daemon = start_daemon("""
        network { obs_dim: 4 trunk_hidden: 16 head_hidden: 8 num_atoms: 11 branch_actions: 2 }
        replay { capacity: 1024 batch_size: 16 }
        rate_limiter { min_size_to_sample: 64 samples_per_insert: 4 error_buffer: 512 }
    """)
    smoke = tmp_path / "smoke.py"
    smoke.write_text(SMOKE)
    out = run([python, "-I", smoke, tmp_path / "venv", daemon.grpc], cwd=tmp_path, env=env, timeout=120)
    assert "smoke ok" in out, out
