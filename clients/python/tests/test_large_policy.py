"""Policies larger than gRPC's default 4 MiB receive limit, against a real
qstreamd: the SDK's channels take DEFAULT_MAX_RECEIVE_MESSAGE_LENGTH (256
MiB) or the caller's max_receive_message_length, and a policy over the
limit raises MessageTooLarge naming the option instead of gRPC's bare
RESOURCE_EXHAUSTED."""

import time

import grpc
import numpy as np
import pytest

from qstream import (
    DEFAULT_MAX_RECEIVE_MESSAGE_LENGTH,
    ActorClient,
    MessageTooLarge,
    PolicyWatcher,
    fetch_policy,
    nstep_batch,
    open_channel,
)
from qstream.channel import MiB, check_receive_limit
from qstream.proto import policy_pb2, policy_pb2_grpc

GRPC_DEFAULT_LIMIT = 4 * MiB

# obs 4 -> 1024 -> 2048 trunk, dueling heads of 64: 2,376,537 parameters,
# a 9.5 MB Policy message. Published every 2 learner steps once 128
# transitions are in.
LARGE_CONFIG = """
network { obs_dim: 4 trunk_hidden: 1024 trunk_hidden: 2048 head_hidden: 64 num_atoms: 51
          v_min: -10 v_max: 10 branch_actions: 2 }
replay { capacity: 4096 batch_size: 32 }
rate_limiter { min_size_to_sample: 128 samples_per_insert: 4 error_buffer: 1024 }
server { publish_every: 2 }
seed: 5
"""
LARGE_PARAMS = 2_376_537


def feed(target, rng, batches=4, n=128):
    with ActorClient(target, max_in_flight=4) as client:
        for _ in range(batches):
            client.send(nstep_batch(rng.normal(size=(n, 4)), rng.integers(0, 2, (n, 1)), rng.normal(size=n),
                                    rng.uniform(0, 1, n), rng.normal(size=(n, 4))))
        client.flush()


def test_policy_over_4mib_is_fetched_and_watched(start_daemon):
    d = start_daemon(LARGE_CONFIG)
    # The wire size, through a channel of the SDK's default options.
    with open_channel(d.grpc) as ch:
        raw = policy_pb2_grpc.PolicyServiceStub(ch).GetPolicy(policy_pb2.GetPolicyRequest(), timeout=30,
                                                              wait_for_ready=True)
    assert raw.ByteSize() > 2 * GRPC_DEFAULT_LIMIT
    assert raw.ByteSize() < DEFAULT_MAX_RECEIVE_MESSAGE_LENGTH

    policy = fetch_policy(d.grpc)
    assert policy.arch.trunk_hidden == (1024, 2048)
    assert policy.arch.num_params == LARGE_PARAMS == len(raw.weights)
    assert policy.q_values(np.zeros((3, 4))).shape == (3, 2)

    # A limit just above the message is enough: the limit is per message.
    exact = fetch_policy(d.grpc, max_receive_message_length=raw.ByteSize() + 64)
    assert exact.arch == policy.arch

    # WatchPolicy streams every new snapshot (each 9.5 MB) to the watcher.
    with PolicyWatcher(d.grpc, timeout=30) as watcher:
        first = watcher.version
        feed(d.grpc, np.random.default_rng(0))
        deadline = time.monotonic() + 90
        while watcher.version <= first and watcher.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.error is None
        assert watcher.version > first, "no newer policy arrived through WatchPolicy"
        assert watcher.policy.arch.num_params == LARGE_PARAMS
        assert watcher.act(np.zeros((2, 4)), 0.0).shape == (2, 1)

    # A ready channel carries its own limit.
    with grpc.insecure_channel(d.grpc, options=[("grpc.max_receive_message_length", 64 * MiB)]) as ch:
        with PolicyWatcher(ch, timeout=30) as watcher:
            assert watcher.policy.arch.num_params == LARGE_PARAMS


def test_policy_over_the_limit_raises_message_too_large(start_daemon):
    d = start_daemon(LARGE_CONFIG)
    with pytest.raises(MessageTooLarge, match="max_receive_message_length") as e:
        fetch_policy(d.grpc, max_receive_message_length=GRPC_DEFAULT_LIMIT)
    assert "larger than max" in e.value.details

    with pytest.raises(MessageTooLarge):
        PolicyWatcher(d.grpc, timeout=30, max_receive_message_length=GRPC_DEFAULT_LIMIT)

    # A channel opened without the option has gRPC's 4 MiB default.
    with grpc.insecure_channel(d.grpc) as ch:
        with pytest.raises(MessageTooLarge, match="grpc.max_receive_message_length"):
            PolicyWatcher(ch, timeout=30)
        with pytest.raises(ValueError, match="max_receive_message_length"):
            fetch_policy(ch, max_receive_message_length=64 * MiB)  # set on the channel instead

    # -1: no limit.
    assert fetch_policy(d.grpc, max_receive_message_length=-1).arch.num_params == LARGE_PARAMS


def test_receive_limit_values():
    assert DEFAULT_MAX_RECEIVE_MESSAGE_LENGTH == 256 * MiB
    assert check_receive_limit(-1) == -1
    assert check_receive_limit(5 * MiB) == 5 * MiB
    for bad in (0, -2, 1 << 31, 1.5, "big"):
        with pytest.raises(ValueError, match="max_receive_message_length"):
            check_receive_limit(bad)
    with pytest.raises(ValueError, match="max_receive_message_length"):
        open_channel("127.0.0.1:1", max_receive_message_length=0)
    # A channel option given by the caller replaces the SDK's value.
    open_channel("127.0.0.1:1", options=[("grpc.max_receive_message_length", 8 * MiB)]).close()
