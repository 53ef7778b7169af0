"""qstream: Python actor SDK for the qstreamd C51 learner.

    from qstream import Writer, PolicyWatcher, run_actor
"""

from qstream.actor import ActorResult, EpsilonSchedule, run_actor
from qstream.admin import AdminClient
from qstream.batch import nstep_batch, step_batch
from qstream.channel import (
    DEFAULT_MAX_RECEIVE_MESSAGE_LENGTH,
    AuthError,
    ConnectError,
    MessageTooLarge,
    QstreamError,
    open_channel,
)
from qstream.client import ActorClient
from qstream.native import NativeUnavailable
from qstream.policy import Architecture, Policy, PolicyWatcher, fetch_policy
from qstream.stream import BatchRejected, StreamError, StreamStats
from qstream.writer import Backpressure, Writer

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MAX_RECEIVE_MESSAGE_LENGTH",
    "ActorClient",
    "ActorResult",
    "AdminClient",
    "Architecture",
    "AuthError",
    "Backpressure",
    "BatchRejected",
    "ConnectError",
    "EpsilonSchedule",
    "MessageTooLarge",
    "NativeUnavailable",
    "Policy",
    "PolicyWatcher",
    "QstreamError",
    "StreamError",
    "StreamStats",
    "Writer",
    "fetch_policy",
    "nstep_batch",
    "open_channel",
    "run_actor",
    "step_batch",
]
