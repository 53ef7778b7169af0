"""Columnar TransitionBatch messages from numpy arrays."""

from __future__ import annotations

import numpy as np

from qstream.proto import experience_pb2

TransitionBatch = experience_pb2.TransitionBatch


def _rows(x, dtype) -> np.ndarray:
    a = np.asarray(x, dtype=dtype)
    return a.reshape(a.shape[0], -1) if a.ndim > 0 else a.reshape(1, 1)


def step_batch(obs, actions, rewards, next_obs, done, truncated=None, env_ids=None, policy_version: int = 0):
    """KIND_STEP batch of n one-step transitions; the daemon assembles the
    n-step returns per env_id. obs/next_obs: (n, obs_dim); actions: (n,) or
    (n, branches); done: episode ended in a terminal state; truncated:
    episode cut by a time limit (bootstraps from next_obs)."""
    obs = _rows(obs, np.float32)
    n = obs.shape[0]
    b = TransitionBatch(kind=TransitionBatch.KIND_STEP, count=n, policy_version=int(policy_version))
    b.obs.extend(obs.ravel().tolist())
    b.next_obs.extend(_rows(next_obs, np.float32).ravel().tolist())
    b.actions.extend(np.asarray(actions, dtype=np.int64).ravel().tolist())
    b.rewards.extend(np.asarray(rewards, dtype=np.float32).ravel().tolist())
    b.done.extend(np.asarray(done, dtype=bool).ravel().tolist())
    if truncated is not None:
        b.truncated.extend(np.asarray(truncated, dtype=bool).ravel().tolist())
    if env_ids is not None:
        b.env_ids.extend(np.asarray(env_ids, dtype=np.int64).ravel().tolist())
    return b


def nstep_batch(obs, actions, returns, discounts, next_obs, policy_version: int = 0):
    """KIND_NSTEP batch of client-assembled transitions: returns is the
    discounted n-step return, discounts the bootstrap factor
    gamma^k * (1 - terminal) in [0, 1]."""
    obs = _rows(obs, np.float32)
    n = obs.shape[0]
    b = TransitionBatch(kind=TransitionBatch.KIND_NSTEP, count=n, policy_version=int(policy_version))
    b.obs.extend(obs.ravel().tolist())
    b.next_obs.extend(_rows(next_obs, np.float32).ravel().tolist())
    b.actions.extend(np.asarray(actions, dtype=np.int64).ravel().tolist())
    b.rewards.extend(np.asarray(returns, dtype=np.float32).ravel().tolist())
    b.discounts.extend(np.asarray(discounts, dtype=np.float32).ravel().tolist())
    return b


def concat(batches: list) -> "TransitionBatch":
    """One batch holding the transitions of several of the same kind."""
    out = TransitionBatch()
    out.CopyFrom(batches[0])
    for b in batches[1:]:
        out.MergeFrom(b)  # repeated fields append
    out.count = sum(b.count for b in batches)
    out.policy_version = min(b.policy_version for b in batches)
    return out
