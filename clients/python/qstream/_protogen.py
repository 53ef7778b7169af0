"""Python stubs for proto/qstream/v1, generated with grpcio-tools.

The stubs (``*_pb2.py``, ``*_pb2_grpc.py`` and ``*_pb2.pyi`` type stubs) are
produced at build time: setup.py's build_py hook generates them into the
wheel from the repository's proto/, and its sdist hook into the sdist, so a
wheel built from the sdist needs no proto/. When the package runs from a
source checkout they are generated on first import. They land in
``qstream/_proto`` as flat modules importing each other relatively, so the
``qstream.v1`` proto package never collides with this ``qstream`` package.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

PROTO_FILES = ("config", "experience", "policy", "admin")
_PROTO_SUBDIR = Path("qstream") / "v1"
# `from qstream.v1 import config_pb2 as qstream_dot_v1_dot_config__pb2`
_CROSS_IMPORT = re.compile(r"^from qstream\.v1 import (\w+) as (\w+)$", re.MULTILINE)


def find_proto_root(start: Path | None = None) -> Path | None:
    """The folder holding qstream/v1/*.proto: $QSTREAM_PROTO_DIR, or a
    `proto/` folder in a parent of this file (a source checkout)."""
    env = os.environ.get("QSTREAM_PROTO_DIR")
    if env:
        return Path(env)
    here = (start or Path(__file__)).resolve()
    for parent in here.parents:
        candidate = parent / "proto"
        if (candidate / _PROTO_SUBDIR / "experience.proto").is_file():
            return candidate
    return None


def generate(proto_root: Path, out_dir: Path) -> None:
    """Generates *_pb2.py and *_pb2_grpc.py for every qstream proto into
    out_dir, replacing what is there. The new package is written beside it
    and renamed into place, so concurrent importers never see half of one."""
    from grpc_tools import protoc  # build/first-import dependency only

    import importlib.resources

    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".qstream_proto_") as tmp:
        raw = Path(tmp) / "raw"
        pkg = Path(tmp) / "pkg"
        raw.mkdir()
        pkg.mkdir()
        files = [str(proto_root / _PROTO_SUBDIR / f"{name}.proto") for name in PROTO_FILES]
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{well_known}",
            f"--python_out={raw}",
            f"--grpc_python_out={raw}",
            f"--pyi_out={raw}",
            *files,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"grpc_tools.protoc failed on {proto_root}")
        for src in sorted((raw / _PROTO_SUBDIR).glob("*.py*")):
            text = _CROSS_IMPORT.sub(r"from . import \1 as \2", src.read_text())
            (pkg / src.name).write_text(text)
        (pkg / "__init__.py").write_text('"""Generated from proto/qstream/v1 by qstream._protogen."""\n')
        if out_dir.exists():
            os.rename(out_dir, Path(tmp) / "old")  # removed with tmp
        try:
            os.rename(pkg, out_dir)
        except OSError:
            if not (out_dir / "experience_pb2_grpc.py").is_file():
                raise  # not a concurrent generator winning the race


def _stale(out_dir: Path, root: Path) -> bool:
    marker = out_dir / "__init__.py"
    if not (out_dir / "experience_pb2_grpc.py").is_file() or not marker.is_file():
        return True
    newest = max((root / _PROTO_SUBDIR / f"{n}.proto").stat().st_mtime for n in PROTO_FILES)
    return newest > marker.stat().st_mtime


def _source_tree(package_dir: Path) -> bool:
    """Whether the package runs from its source folder (clients/python or an
    unpacked sdist, beside pyproject.toml) rather than from an install."""
    return (package_dir.parent / "pyproject.toml").is_file()


def ensure_generated() -> None:
    """Makes qstream._proto importable. In a source checkout (a proto/
    folder above this file, or $QSTREAM_PROTO_DIR) the stubs are generated
    when missing or older than the .proto files; an installed package (a
    wheel, even one installed into a venv inside a checkout) always uses the
    stubs its build generated, and so does an unpacked sdist."""
    package_dir = Path(__file__).resolve().parent
    out_dir = package_dir / "_proto"
    if (out_dir / "experience_pb2_grpc.py").is_file() and not _source_tree(package_dir):
        return
    root = find_proto_root()
    if root is None:
        if (out_dir / "experience_pb2_grpc.py").is_file():
            return
        raise ImportError(
            "qstream: generated stubs are missing and no proto/ folder was found; "
            "install the wheel or sdist (`pip install ./clients/python`) or set QSTREAM_PROTO_DIR"
        )
    if _stale(out_dir, root):
        generate(root, out_dir)


if __name__ == "__main__":
    # python -m qstream._protogen PROTO_ROOT OUT_DIR
    generate(Path(sys.argv[1]), Path(sys.argv[2]))
