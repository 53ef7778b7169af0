"""The qstream wire API (proto/qstream/v1) as Python modules.

    from qstream.proto import experience_pb2, policy_pb2, admin_pb2
"""

from qstream._protogen import ensure_generated

ensure_generated()

from qstream._proto import (  # noqa: E402
    admin_pb2,
    admin_pb2_grpc,
    config_pb2,
    experience_pb2,
    experience_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
)

__all__ = [
    "admin_pb2",
    "admin_pb2_grpc",
    "config_pb2",
    "experience_pb2",
    "experience_pb2_grpc",
    "policy_pb2",
    "policy_pb2_grpc",
]
