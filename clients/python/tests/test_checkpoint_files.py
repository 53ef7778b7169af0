"""A checkpoint written by the C++ code reads with the reference safetensors library.

tests/trainer/write_test_checkpoint writes a small network and replay with
known values; its comment documents them, and NETWORK below mirrors it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import build_dir

safetensors_numpy = pytest.importorskip("safetensors.numpy")

# tests/trainer/write_test_checkpoint.cc kTestNetwork, kRows, kCapacity.
OBS_DIM = 3
TRUNK = [4, 6]
HEAD = 5
ATOMS = 3
BRANCHES = [2, 3]
ROWS = 5
WEIGHT_FILES = ["online", "target", "adam_m", "adam_v"]


def layer_shapes():
    """(name, out, in) in flat-buffer order (trainer/network_spec.h)."""
    layers, width = [], OBS_DIM
    for k, h in enumerate(TRUNK):
        layers.append((f"trunk.{k}", h, width))
        width = h
    layers += [
        ("value_hidden", HEAD, width),
        ("value_out", ATOMS, HEAD),
        ("adv_hidden", HEAD, width),
        ("adv_out", sum(BRANCHES) * ATOMS, HEAD),
    ]
    return layers


def expected_buffer(name: str, params: np.ndarray) -> np.ndarray:
    return {"online": params, "target": 2 * params, "adam_m": -params, "adam_v": params * params}[name]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    tool = build_dir() / "write_test_checkpoint"
    if not tool.is_file():
        if "QSTREAM_BUILD_DIR" in os.environ:
            pytest.fail(f"{tool} is missing; build the write_test_checkpoint target")
        pytest.skip(f"{tool} not built")
    root = tmp_path_factory.mktemp("ckpt")
    out = subprocess.run([str(tool), str(root)], check=True, capture_output=True, text=True, timeout=60)
    path = Path(out.stdout.strip())
    assert path == root / "ckpt-7"
    return path


def test_files_and_modes(checkpoint_dir: Path):
    names = sorted(p.name for p in checkpoint_dir.iterdir())
    assert names == sorted(
        ["manifest.pbtxt", "manifest.crc32c"] + [f"{n}.safetensors" for n in WEIGHT_FILES + ["replay"]]
    )
    assert checkpoint_dir.stat().st_mode & 0o777 == 0o700
    for p in checkpoint_dir.iterdir():
        assert p.stat().st_mode & 0o777 == 0o600, p.name


@pytest.mark.parametrize("buffer", WEIGHT_FILES)
def test_weights_read_with_numpy(checkpoint_dir: Path, buffer: str):
    path = checkpoint_dir / f"{buffer}.safetensors"
    tensors = safetensors_numpy.load_file(str(path))
    layers = layer_shapes()
    assert set(tensors) == {f"{n}.{part}" for n, _, _ in layers for part in ("weight", "bias")}
    num_params = sum(o * i + o for _, o, i in layers)
    want = expected_buffer(buffer, np.arange(num_params, dtype=np.float32) * np.float32(0.001))
    offset = 0
    for name, out, inp in layers:
        w, b = tensors[f"{name}.weight"], tensors[f"{name}.bias"]
        assert w.dtype == np.float32 and w.shape == (out, inp), name
        assert b.dtype == np.float32 and b.shape == (out,), name
        np.testing.assert_array_equal(w, want[offset : offset + out * inp].reshape(out, inp))
        offset += out * inp
        np.testing.assert_array_equal(b, want[offset : offset + out])
        offset += out
    assert offset == num_params

    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "qstream", "buffer": buffer}


def test_replay_reads_with_numpy(checkpoint_dir: Path):
    t = safetensors_numpy.load_file(str(checkpoint_dir / "replay.safetensors"))
    assert set(t) == {"obs", "next_obs", "actions", "rewards", "discounts", "priorities"}
    r = np.arange(ROWS, dtype=np.float32)
    obs = r[:, None] + np.arange(OBS_DIM, dtype=np.float32)[None, :] / np.float32(10)
    assert t["obs"].dtype == np.float32 and t["obs"].shape == (ROWS, OBS_DIM)
    np.testing.assert_array_equal(t["obs"], obs)
    np.testing.assert_array_equal(t["next_obs"], -obs)
    assert t["actions"].dtype == np.int32 and t["actions"].shape == (ROWS, len(BRANCHES))
    want_actions = (np.arange(ROWS)[:, None] + np.arange(len(BRANCHES))[None, :]) % np.array(BRANCHES)[None, :]
    np.testing.assert_array_equal(t["actions"], want_actions.astype(np.int32))
    np.testing.assert_array_equal(t["rewards"], r / np.float32(2))
    np.testing.assert_array_equal(t["discounts"], np.full(ROWS, 0.99, dtype=np.float32))
    np.testing.assert_array_equal(t["priorities"], r + 1)


def test_weights_load_into_torch_linear(checkpoint_dir: Path):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = safetensors_torch.load_file(str(checkpoint_dir / "online.safetensors"))
    for name, out, inp in layer_shapes():
        layer = torch.nn.Linear(inp, out)
        layer.load_state_dict({"weight": tensors[f"{name}.weight"], "bias": tensors[f"{name}.bias"]})
        assert layer.weight.dtype == torch.float32
    # trunk.0 of the known values: y = W x + b with W[o][i] = (o * in + i) * 0.001.
    w = tensors["trunk.0.weight"]
    assert tuple(w.shape) == (TRUNK[0], OBS_DIM)
    assert torch.equal(w.flatten(), torch.arange(TRUNK[0] * OBS_DIM, dtype=torch.float32) * 0.001)
    replay = safetensors_torch.load_file(str(checkpoint_dir / "replay.safetensors"))
    assert replay["actions"].dtype == torch.int32
