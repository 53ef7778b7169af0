"""Policy: the daemon's C51 network run in numpy, and PolicyWatcher, which
keeps the latest published Policy of a daemon up to date in the background.

Weight layout (proto/qstream/v1/policy.proto, trainer/network_spec.h): one
flat float32 array of Linear layers, each W[out][in] row-major then b[out]:
trunk layers (ReLU after each), value hidden (ReLU), value out (atoms),
advantage hidden (ReLU), advantage out ([branch][action][atom]).
Per branch the logits are l[a] = V + A[a] - mean_a A[a]; Q[a] is the mean of
the atoms under softmax(l[a]).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
from numpy.typing import ArrayLike

from qstream.channel import (
    AuthError,
    ConnectError,
    MessageTooLarge,
    PathLike,
    auth_error,
    channel_for,
    is_too_large,
    is_token_refused,
)
from qstream.proto import policy_pb2, policy_pb2_grpc


@dataclass(frozen=True)
class Architecture:
    obs_dim: int
    trunk_hidden: tuple[int, ...]
    head_hidden: int
    num_atoms: int
    v_min: float
    v_max: float
    branch_actions: tuple[int, ...]

    @classmethod
    def from_proto(cls, arch: policy_pb2.Architecture) -> "Architecture":
        return cls(
            obs_dim=arch.obs_dim,
            trunk_hidden=tuple(arch.trunk_hidden),
            head_hidden=arch.head_hidden,
            num_atoms=arch.num_atoms,
            v_min=arch.v_min,
            v_max=arch.v_max,
            branch_actions=tuple(arch.branch_actions),
        )

    @property
    def total_actions(self) -> int:
        return sum(self.branch_actions)

    def layer_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of every Linear layer in buffer order."""
        shapes = []
        width = self.obs_dim
        for h in self.trunk_hidden:
            shapes.append((width, h))
            width = h
        shapes.append((width, self.head_hidden))  # value hidden
        shapes.append((self.head_hidden, self.num_atoms))  # value out
        shapes.append((width, self.head_hidden))  # advantage hidden
        shapes.append((self.head_hidden, self.total_actions * self.num_atoms))  # advantage out
        return shapes

    @property
    def num_params(self) -> int:
        return sum(i * o + o for i, o in self.layer_shapes())


class Policy:
    """One policy snapshot: Q-values, greedy and epsilon-greedy actions."""

    def __init__(self, arch: Architecture, weights: ArrayLike, version: int = 0) -> None:
        weights = np.asarray(weights, dtype=np.float32)
        if weights.ndim != 1 or weights.size != arch.num_params:
            raise ValueError(f"policy needs {arch.num_params} weights for {arch}, got {weights.size}")
        if not arch.trunk_hidden or not arch.branch_actions or arch.num_atoms < 2:
            raise ValueError(f"invalid architecture {arch}")
        self.arch = arch
        self.version = version
        self._layers = []
        offset = 0
        for n_in, n_out in arch.layer_shapes():
            w = weights[offset : offset + n_in * n_out].reshape(n_out, n_in).astype(np.float64)
            offset += n_in * n_out
            b = weights[offset : offset + n_out].astype(np.float64)
            offset += n_out
            self._layers.append((w, b))
        self._atoms = arch.v_min + np.arange(arch.num_atoms, dtype=np.float64) * (
            (arch.v_max - arch.v_min) / (arch.num_atoms - 1)
        )

    @classmethod
    def from_proto(cls, policy: policy_pb2.Policy) -> "Policy":
        return cls(
            Architecture.from_proto(policy.architecture),
            np.asarray(policy.weights, dtype=np.float32),
            policy.version,
        )

    @property
    def num_branches(self) -> int:
        return len(self.arch.branch_actions)

    def q_values(self, obs: ArrayLike) -> np.ndarray:
        """obs: (n, obs_dim) or (obs_dim,). Returns (n, total_actions) Q-values,
        branches concatenated (float64)."""
        x = np.asarray(obs, dtype=np.float64).reshape(-1, self.arch.obs_dim)
        num_trunk = len(self.arch.trunk_hidden)

        def linear(h, layer):
            w, b = self._layers[layer]
            return h @ w.T + b

        for i in range(num_trunk):
            x = np.maximum(linear(x, i), 0.0)
        value = linear(np.maximum(linear(x, num_trunk), 0.0), num_trunk + 1)  # (n, atoms)
        adv = linear(np.maximum(linear(x, num_trunk + 2), 0.0), num_trunk + 3)
        adv = adv.reshape(x.shape[0], self.arch.total_actions, self.arch.num_atoms)
        qs = []
        start = 0
        for k in self.arch.branch_actions:
            a = adv[:, start : start + k, :]
            logits = value[:, None, :] + a - a.mean(axis=1, keepdims=True)
            logits -= logits.max(axis=2, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=2, keepdims=True)
            qs.append(p @ self._atoms)
            start += k
        return np.concatenate(qs, axis=1)

    def greedy(self, obs: ArrayLike) -> np.ndarray:
        """(n, num_branches) int32 argmax per branch (ties: lowest index)."""
        q = self.q_values(obs)
        out = np.empty((q.shape[0], self.num_branches), dtype=np.int32)
        start = 0
        for b, k in enumerate(self.arch.branch_actions):
            out[:, b] = np.argmax(q[:, start : start + k], axis=1)
            start += k
        return out

    def act(self, obs: ArrayLike, epsilon: float, rng: np.random.Generator | None = None) -> np.ndarray:
        """Epsilon-greedy per observation: with probability epsilon every
        branch of that observation takes a uniform random action."""
        rng = rng if rng is not None else np.random.default_rng()
        actions = self.greedy(obs)
        explore = rng.random(actions.shape[0]) < epsilon
        if explore.any():
            for b, k in enumerate(self.arch.branch_actions):
                actions[explore, b] = rng.integers(0, k, size=int(explore.sum()))
        return actions


_TLS_HINT = ("; check tls_ca (the CA of the daemon's certificate), tls_server_name, and tls_cert/tls_key "
             "for a daemon that requires client certificates")


def _get_policy(stub: policy_pb2_grpc.PolicyServiceStub, server: str, timeout: float, tls: bool) -> Policy:
    """GetPolicy, retried with backoff while the daemon is unreachable (or
    restoring) for up to `timeout` seconds. Raises AuthError at once for a
    refused token, MessageTooLarge for a policy over the channel's receive
    limit, ConnectError with gRPC's last reason (refused connection, failed
    TLS handshake, ...) after the timeout."""
    deadline = time.monotonic() + timeout
    backoff = 0.05
    while True:
        left = deadline - time.monotonic()
        try:
            return Policy.from_proto(stub.GetPolicy(policy_pb2.GetPolicyRequest(), timeout=max(left, 0.05)))
        except grpc.RpcError as e:
            if is_token_refused(e):
                raise auth_error("PolicyService.GetPolicy", e) from None
            if is_too_large(e):
                raise MessageTooLarge("PolicyService.GetPolicy", e.details() or "") from None
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            if time.monotonic() + backoff >= deadline:
                hint = _TLS_HINT if tls and e.code() == grpc.StatusCode.UNAVAILABLE else ""
                raise ConnectError(server, timeout, f"{e.code().name}: {e.details()}{hint}") from None
        time.sleep(backoff)
        backoff = min(backoff * 2, 1.0)


def fetch_policy(
    server: str | grpc.Channel,
    timeout: float = 30.0,
    *,
    tls_ca: PathLike | None = None,
    tls_cert: PathLike | None = None,
    tls_key: PathLike | None = None,
    tls_server_name: str | None = None,
    token: str | None = None,
    token_file: PathLike | None = None,
    max_receive_message_length: int | None = None,
) -> Policy:
    """GetPolicy once, waiting up to `timeout` seconds for the daemon.
    `server` is an address (TLS and token parameters as in
    qstream.channel.open_channel) or a ready channel. Raises AuthError,
    MessageTooLarge or ConnectError (see PolicyWatcher)."""
    channel, owned = channel_for(server, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                 tls_server_name=tls_server_name, token=token, token_file=token_file,
                                 max_receive_message_length=max_receive_message_length)
    try:
        return _get_policy(policy_pb2_grpc.PolicyServiceStub(channel), _name(server), timeout,
                           tls=tls_ca is not None or tls_cert is not None)
    finally:
        if owned:
            channel.close()


def _name(server: str | grpc.Channel) -> str:
    return server if isinstance(server, str) else "the given channel"


class PolicyWatcher:
    """The latest Policy of a daemon: GetPolicy at construction, then a
    background thread follows WatchPolicy (reconnecting with backoff).
    Use as a context manager or call close().

    `server` is an address (TLS and token parameters as in
    qstream.channel.open_channel) or a ready channel. The constructor raises
    AuthError when the daemon refuses the token, MessageTooLarge when the
    policy is larger than the channel's receive limit, and ConnectError
    when the daemon cannot be reached within `timeout` seconds (the message
    carries gRPC's reason, e.g. a failed TLS handshake). A token refused
    later, or a later policy over the limit, ends the watch; `.error` then
    holds the AuthError or MessageTooLarge.

    max_receive_message_length: the largest policy message accepted, in
    bytes (4 per network parameter, ~100 more; -1: no limit); default
    qstream.channel.DEFAULT_MAX_RECEIVE_MESSAGE_LENGTH, 256 MiB. Address
    only: a ready channel has its own (gRPC's default is 4 MiB, about 1M
    parameters)."""

    def __init__(
        self,
        server: str | grpc.Channel,
        timeout: float = 30.0,
        max_backoff_s: float = 2.0,
        *,
        tls_ca: PathLike | None = None,
        tls_cert: PathLike | None = None,
        tls_key: PathLike | None = None,
        tls_server_name: str | None = None,
        token: str | None = None,
        token_file: PathLike | None = None,
        max_receive_message_length: int | None = None,
    ) -> None:
        self._channel, self._own_channel = channel_for(
            server, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, tls_server_name=tls_server_name,
            token=token, token_file=token_file, max_receive_message_length=max_receive_message_length,
        )
        self._stub = policy_pb2_grpc.PolicyServiceStub(self._channel)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._call = None
        self._max_backoff_s = max_backoff_s
        self.error: AuthError | MessageTooLarge | None = None
        try:
            self._policy = _get_policy(self._stub, _name(server), timeout,
                                       tls=tls_ca is not None or tls_cert is not None)
        except BaseException:
            if self._own_channel:
                self._channel.close()
            raise
        self._thread = threading.Thread(target=self._watch, name="qstream-policy-watch", daemon=True)
        self._thread.start()

    @property
    def policy(self) -> Policy:
        with self._lock:
            return self._policy

    @property
    def version(self) -> int:
        return self.policy.version

    def act(self, obs: ArrayLike, epsilon: float, rng: np.random.Generator | None = None) -> np.ndarray:
        return self.policy.act(obs, epsilon, rng)

    def _watch(self) -> None:
        backoff = 0.1
        while not self._closed.is_set():
            with self._lock:
                # Checked under the lock close() cancels under: no call escapes cancellation.
                if self._closed.is_set():
                    return
                call = self._stub.WatchPolicy(policy_pb2.WatchPolicyRequest(after_version=self._policy.version))
                self._call = call
            try:
                for message in call:
                    policy = Policy.from_proto(message)
                    with self._lock:
                        if policy.version > self._policy.version:
                            self._policy = policy
                    backoff = 0.1
            except grpc.RpcError as e:
                if is_token_refused(e):
                    self.error = auth_error("PolicyService.WatchPolicy", e)
                    return
                if is_too_large(e):
                    self.error = MessageTooLarge("PolicyService.WatchPolicy", e.details() or "")
                    return
            if self._closed.wait(backoff):
                return
            backoff = min(backoff * 2, self._max_backoff_s)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        self._thread.join()
        if self._own_channel:
            self._channel.close()

    def __enter__(self) -> "PolicyWatcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
