"""Build hook: generates the gRPC/protobuf stubs from ../../proto into the
built package (qstream/_proto) with grpcio-tools, and pins the runtime
protobuf/grpcio to at least the versions the stubs were generated for."""

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "qstream"))
import _protogen  # noqa: E402  (imported by path: the package needs the stubs it builds)


def _proto_root():
    for candidate in (os.environ.get("QSTREAM_PROTO_DIR"), HERE.parent.parent / "proto", HERE / "proto"):
        if candidate and (Path(candidate) / "qstream" / "v1" / "experience.proto").is_file():
            return Path(candidate)
    return None


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        root = _proto_root()
        out = Path(self.build_lib) / "qstream" / "_proto"
        if root is not None:
            _protogen.generate(root, out)
        elif not (HERE / "qstream" / "_proto" / "experience_pb2.py").is_file():
            raise RuntimeError("qstream: proto/ not found (set QSTREAM_PROTO_DIR) and no pre-generated stubs")


def _runtime_requirements():
    reqs = ["numpy>=1.22", "gymnasium>=0.29"]
    try:
        import grpc_tools
        from google.protobuf import __version__ as pb_version
        from importlib.metadata import version

        tools = version("grpcio-tools")
        reqs += [f"grpcio>={tools}", f"protobuf>={pb_version}"]
    except Exception:  # building without grpcio-tools fails later with a clear error
        reqs += ["grpcio", "protobuf"]
    return reqs


setup(cmdclass={"build_py": BuildPyWithStubs}, install_requires=_runtime_requirements())
