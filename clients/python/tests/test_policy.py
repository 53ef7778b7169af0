"""The numpy forward pass equals the daemon's own Q-values (PolicyService.Evaluate)."""

import time

import grpc
import numpy as np
import pytest

from qstream import ActorClient, Policy, PolicyWatcher, fetch_policy, nstep_batch
from qstream.proto import policy_pb2, policy_pb2_grpc

# Dueling + two branches + a non-symmetric support, so every part of the
# layout is exercised; the learner trains on random data so weights move.
BRANCHING_CONFIG = """
network { obs_dim: 6 trunk_hidden: 32 trunk_hidden: 16 head_hidden: 8 num_atoms: 11
          v_min: -5 v_max: 7 branch_actions: 3 branch_actions: 2 }
replay { capacity: 4096 batch_size: 32 }
rate_limiter { min_size_to_sample: 256 samples_per_insert: 4 error_buffer: 512 }
server { publish_every: 5 }
seed: 11
"""


def evaluate(target, obs):
    with grpc.insecure_channel(target) as ch:
        stub = policy_pb2_grpc.PolicyServiceStub(ch)
        r = stub.Evaluate(policy_pb2.EvaluateRequest(obs=obs.ravel().tolist(), count=obs.shape[0]), timeout=10)
    return r.version, np.asarray(r.q, dtype=np.float64).reshape(obs.shape[0], -1)


def matching_q(target, obs):
    """(policy, daemon q) for the same snapshot version (retrying across publishes)."""
    for _ in range(50):
        policy = fetch_policy(target)
        version, q = evaluate(target, obs)
        if version == policy.version:
            return policy, q
    pytest.fail("policy version kept changing between GetPolicy and Evaluate")


def feed_random(target, n_batches, rng, arch):
    with ActorClient(target, max_in_flight=4) as client:
        for _ in range(n_batches):
            n = 128
            obs = rng.normal(size=(n, arch.obs_dim))
            actions = np.stack([rng.integers(0, k, n) for k in arch.branch_actions], axis=1)
            client.send(
                nstep_batch(obs, actions, rng.normal(size=n), rng.uniform(0, 1, n), rng.normal(size=(n, arch.obs_dim)))
            )
        client.flush()


def test_numpy_forward_matches_daemon_q_values(start_daemon):
    d = start_daemon(BRANCHING_CONFIG)
    rng = np.random.default_rng(0)
    obs = rng.normal(scale=2.0, size=(64, 6)).astype(np.float32)

    policy, q = matching_q(d.grpc, obs)
    assert policy.arch.branch_actions == (3, 2) and policy.arch.num_atoms == 11
    assert q.shape == (64, 5)
    np.testing.assert_allclose(policy.q_values(obs), q, rtol=0, atol=1e-5)
    first_version = policy.version

    # After training steps the weights differ; the forward still matches.
    feed_random(d.grpc, 8, rng, policy.arch)
    deadline = 200
    while policy.version <= first_version and deadline:
        policy, q = matching_q(d.grpc, obs)
        deadline -= 1
    assert policy.version > first_version
    np.testing.assert_allclose(policy.q_values(obs), q, rtol=0, atol=1e-5)
    assert np.abs(q).max() > 1e-3  # a real comparison, not two zero arrays


def test_greedy_and_epsilon_greedy_actions():
    from qstream.policy import Architecture

    arch = Architecture(obs_dim=3, trunk_hidden=(4,), head_hidden=4, num_atoms=5, v_min=-1, v_max=1,
                        branch_actions=(3, 2))
    rng = np.random.default_rng(1)
    p = Policy(arch, rng.normal(size=arch.num_params).astype(np.float32), version=3)
    obs = rng.normal(size=(200, 3))
    q = p.q_values(obs)
    g = p.greedy(obs)
    np.testing.assert_array_equal(g[:, 0], q[:, :3].argmax(1))
    np.testing.assert_array_equal(g[:, 1], q[:, 3:].argmax(1))
    np.testing.assert_array_equal(p.act(obs, 0.0, rng), g)
    random = p.act(obs, 1.0, rng)
    assert random.shape == (200, 2)
    assert set(np.unique(random[:, 0])) == {0, 1, 2} and set(np.unique(random[:, 1])) == {0, 1}
    with pytest.raises(ValueError):
        Policy(arch, np.zeros(arch.num_params - 1, np.float32))


def test_watcher_follows_new_versions(start_daemon):
    d = start_daemon(BRANCHING_CONFIG)
    rng = np.random.default_rng(2)
    with PolicyWatcher(d.grpc) as w:
        v0 = w.version
        feed_random(d.grpc, 8, rng, w.policy.arch)
        for _ in range(300):
            if w.version > v0:
                break
            time.sleep(0.05)
        assert w.version > v0
