"""Build hooks: the gRPC/protobuf stubs (qstream/_proto) are generated with
grpcio-tools (pinned in pyproject.toml's build-system.requires, so every
build emits the same gencode and the dependency floors in [project] hold)
from the repository's proto/ (or $QSTREAM_PROTO_DIR):

- sdist: into the sdist's qstream/_proto, so the sdist is self-contained;
- build_py (wheels, `pip install ./clients/python`): into the built package,
  from proto/ when there is one, else from the stubs an sdist shipped.

Metadata (dependency ranges, the `gym` extra) is static, in pyproject.toml.
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "qstream"))
import _protogen  # noqa: E402  (imported by path: the package needs the stubs it builds)

SHIPPED_STUBS = HERE / "qstream" / "_proto"


def _proto_root():
    for candidate in (os.environ.get("QSTREAM_PROTO_DIR"), HERE.parent.parent / "proto", HERE / "proto"):
        if candidate and (Path(candidate) / "qstream" / "v1" / "experience.proto").is_file():
            return Path(candidate)
    return None


def _shipped() -> bool:
    """An unpacked sdist: stubs beside the sources (a checkout's qstream/_proto
    is generated on import and not used by builds; proto/ wins there)."""
    return (SHIPPED_STUBS / "experience_pb2_grpc.py").is_file()


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        out = Path(self.build_lib) / "qstream" / "_proto"
        root = _proto_root()
        if root is not None:
            _protogen.generate(root, out)
        elif _shipped():
            if out.exists():
                shutil.rmtree(out)
            shutil.copytree(SHIPPED_STUBS, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            raise RuntimeError("qstream: proto/ not found (set QSTREAM_PROTO_DIR) and no pre-generated stubs")


class SdistWithStubs(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        out = Path(base_dir) / "qstream" / "_proto"
        root = _proto_root()
        if root is not None:
            _protogen.generate(root, out)
        elif _shipped():  # an sdist rebuilt from an sdist
            shutil.copytree(SHIPPED_STUBS, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                            dirs_exist_ok=True)
        else:
            raise RuntimeError("qstream: proto/ not found (set QSTREAM_PROTO_DIR) and no pre-generated stubs")


setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithStubs})
