"""run_actor: a gymnasium vector env acting epsilon-greedily on the daemon's
latest policy and streaming 1-step transitions (KIND_STEP, one env_id per
sub-env; the daemon assembles n-step returns).

Episode ends: `terminated` is sent as done (no bootstrap), `truncated` as
truncated (the daemon bootstraps from next_obs). With gymnasium >= 1.0's
default next-step autoreset, the step that ends an episode returns the
final observation, and the following step only resets that sub-env: its
(action, reward) is not a transition and is not sent. With same-step
autoreset (and gymnasium < 1.0) the final observation comes in `infos`.

Every finished episode is reported to the daemon (Writer.report_episode,
labelled env=env_id): its return, length and the policy version of its last
step, exported as qstream_episode_return / qstream_episode_length_steps.

Several ranks (`server` = "h1:p1,h2:p2" or a list): sub-env e streams to
address e % N (qstream.spread); the policy comes from the first address, as
every rank holds the same weights.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from qstream.channel import PathLike, Servers, parse_servers
from qstream.policy import PolicyWatcher
from qstream.writer import Writer


@dataclass
class EpsilonSchedule:
    """Linear decay from start to end over decay_steps env steps."""

    start: float = 1.0
    end: float = 0.01
    decay_steps: int = 10_000

    def __call__(self, step: int) -> float:
        if self.decay_steps <= 0:
            return self.end
        frac = min(1.0, step / self.decay_steps)
        return self.end + (self.start - self.end) * (1.0 - frac)


@dataclass
class ActorResult:
    env_steps: int
    episodes: int
    mean_return: float
    reached_target: bool
    wall_seconds: float
    accepted_transitions: int
    policy_version: int


def _import_gymnasium() -> Any:
    try:
        import gymnasium
    except ImportError as e:
        raise ImportError(
            "qstream.run_actor needs gymnasium, an optional dependency: pip install 'qstream[gym]'"
        ) from e
    return gymnasium


def _autoreset_mode(envs: Any) -> str:
    """"next_step", "same_step" (gymnasium >= 1.0) or "legacy" (< 1.0,
    final observation in infos["final_observation"])."""
    mode = getattr(envs, "metadata", {}).get("autoreset_mode")
    if mode is None:
        gymnasium = _import_gymnasium()
        return "next_step" if int(gymnasium.__version__.split(".")[0]) >= 1 else "legacy"
    name = str(getattr(mode, "value", mode)).lower().replace("_", "")
    canonical = {"nextstep": "next_step", "samestep": "same_step"}
    if name not in canonical:
        raise ValueError(f"vector env autoreset mode {mode} is not supported (use next-step or same-step)")
    return canonical[name]


class FinishedEpisode(NamedTuple):
    episode_return: float  # undiscounted sum of its rewards
    length: int  # transitions (env steps) in it


class TransitionRecorder:
    """Turns vector-env steps into the 1-step transitions to send and the
    episodes that finished (return and length), for every autoreset mode."""

    def __init__(self, num_envs: int, mode: str):
        self.mode = mode
        self.running = np.zeros(num_envs, dtype=np.float64)
        self.lengths = np.zeros(num_envs, dtype=np.int64)
        # next_step mode: the sub-envs whose coming step only resets them.
        self.resetting = np.zeros(num_envs, dtype=bool)

    def record(self, obs, actions, rewards, next_obs, terminated, truncated, infos):
        """Returns (transitions dict: obs, actions, rewards, next_obs, done,
        truncated, env_ids; list of FinishedEpisode)."""
        n = len(terminated)
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool)
        rewards = np.asarray(rewards, dtype=np.float32)
        next_obs = np.asarray(next_obs, dtype=np.float32).reshape(n, -1)
        ended = terminated | truncated
        if self.mode == "next_step":
            valid = ~self.resetting
            self.resetting = ended & valid
            recorded_next = next_obs  # the final observation on an ending step
        else:
            valid = np.ones(n, dtype=bool)
            recorded_next = next_obs.copy()
            key = "final_obs" if self.mode == "same_step" else "final_observation"
            for i in np.flatnonzero(ended):
                recorded_next[i] = np.asarray(infos[key][i], dtype=np.float32).ravel()
        idx = np.flatnonzero(valid)
        finished = []
        self.running[idx] += rewards[idx]
        self.lengths[idx] += 1
        for i in idx[ended[idx]]:
            finished.append(FinishedEpisode(float(self.running[i]), int(self.lengths[i])))
            self.running[i] = 0.0
            self.lengths[i] = 0
        steps = dict(
            obs=np.asarray(obs, dtype=np.float32).reshape(n, -1)[idx],
            actions=np.asarray(actions)[idx],
            rewards=rewards[idx],
            next_obs=recorded_next[idx],
            done=terminated[idx],
            truncated=truncated[idx] & ~terminated[idx],
            env_ids=idx,
        )
        return steps, finished


def make_vector_env(env_id: str, num_envs: int, **env_kwargs: Any) -> Any:
    """A gymnasium SyncVectorEnv of `num_envs` copies of `env_id`."""
    gym = _import_gymnasium()

    return gym.vector.SyncVectorEnv([lambda: gym.make(env_id, **env_kwargs) for _ in range(num_envs)])


def run_actor(
    env_id: str,
    server: Servers = "127.0.0.1:50051",
    *,
    num_envs: int = 8,
    total_steps: int | None = None,
    epsilon: EpsilonSchedule | None = None,
    seed: int = 0,
    stop_at_return: float | None = None,
    return_window: int = 20,
    batch_size: int = 256,
    max_in_flight: int = 32,
    max_delay: float | None = 0.02,
    report_every_s: float = 5.0,
    envs: Any = None,
    log: Callable[[str], Any] = print,
    connect_timeout_s: float = 30.0,
    tls_ca: PathLike | None = None,
    tls_cert: PathLike | None = None,
    tls_key: PathLike | None = None,
    tls_server_name: str | None = None,
    token: str | None = None,
    token_file: PathLike | None = None,
    max_receive_message_length: int | None = None,
    transport: str = "auto",
) -> ActorResult:
    """Acts in `env_id` (or the given vector env `envs`) until total_steps env
    steps, or until the mean return of the last `return_window` episodes
    reaches stop_at_return; flushes and returns the result. Transitions go
    through a qstream.Writer (batch_size = its max_batch, max_delay and
    max_in_flight as there, env = env_id), and so does every finished
    episode (Writer.report_episode). `server` is host:port, several of
    them (a list or comma-separated: sub-env e streams to address e % N,
    the policy comes from the first) or a dns:/// URI. The TLS and
    token parameters are those of qstream.channel.open_channel; a refused
    token raises AuthError, an unreachable daemon ConnectError.
    max_receive_message_length bounds the policy messages (PolicyWatcher;
    default 256 MiB, -1: none); a larger policy raises MessageTooLarge.
    `envs` is a gymnasium vector env (default make_vector_env(env_id,
    num_envs), which needs the `gym` extra: pip install 'qstream[gym]').
    `transport` is the Writer's ("auto", "native" or "aio")."""
    security: dict[str, Any] = dict(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, tls_server_name=tls_server_name,
                    token=token, token_file=token_file)
    servers = parse_servers(server)
    epsilon = epsilon or EpsilonSchedule()
    envs = envs if envs is not None else make_vector_env(env_id, num_envs)
    n = envs.num_envs
    mode = _autoreset_mode(envs)
    rng = np.random.default_rng(seed)
    returns: collections.deque[float] = collections.deque(maxlen=return_window)
    episodes = 0
    steps = 0
    start = time.monotonic()
    next_report = start + report_every_s

    reached = False
    # On an exception the writer cancels its stream instead of flushing.
    with PolicyWatcher(servers[0], timeout=connect_timeout_s, max_receive_message_length=max_receive_message_length,
                       **security) as watcher, Writer(
        servers, max_batch=batch_size, max_delay=max_delay, max_in_flight=max_in_flight, env=env_id,
        transport=transport, **security
    ) as writer:
        try:
            obs, _ = envs.reset(seed=seed)
            obs = np.asarray(obs, dtype=np.float32).reshape(n, -1)
            recorder = TransitionRecorder(n, mode)
            while total_steps is None or steps < total_steps:
                policy = watcher.policy
                actions = policy.act(obs, epsilon(steps), rng)
                env_actions = actions[:, 0] if policy.num_branches == 1 else actions
                next_obs, rewards, terminated, truncated, infos = envs.step(env_actions)
                transitions, finished = recorder.record(obs, actions, rewards, next_obs, terminated, truncated, infos)
                if transitions["env_ids"].size:
                    t = transitions
                    writer.append(t["obs"], t["actions"], t["rewards"], t["done"], t["truncated"],
                                  next_obs=t["next_obs"], env_ids=t["env_ids"], policy_version=policy.version)
                    steps += transitions["env_ids"].size
                for e in finished:
                    writer.report_episode(e.episode_return, e.length, policy.version)
                returns.extend(e.episode_return for e in finished)
                episodes += len(finished)
                obs = np.asarray(next_obs, dtype=np.float32).reshape(n, -1)

                now = time.monotonic()
                mean = float(np.mean(list(returns))) if returns else 0.0
                if now >= next_report:
                    st = writer.stats
                    log(
                        f"progress env_steps={steps} episodes={episodes} mean_return_{return_window}={mean:.1f} "
                        f"epsilon={epsilon(steps):.3f} policy_version={policy.version} "
                        f"steps_per_s={steps / (now - start):.0f} replay_size={st.replay_size}"
                    )
                    next_report += report_every_s
                if stop_at_return is not None and len(returns) == return_window and mean >= stop_at_return:
                    reached = True
                    break
            writer.flush()
        finally:
            envs.close()
    mean = float(np.mean(list(returns))) if returns else 0.0
    wall = time.monotonic() - start
    log(
        f"{'reached' if reached else 'done'} env_steps={steps} episodes={episodes} "
        f"mean_return_{return_window}={mean:.1f} wall_s={wall:.1f}"
    )
    return ActorResult(
        env_steps=steps,
        episodes=episodes,
        mean_return=mean,
        reached_target=reached,
        wall_seconds=wall,
        accepted_transitions=writer.stats.accepted_transitions,
        policy_version=watcher.version,
    )
