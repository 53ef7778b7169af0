"""run_actor's bookkeeping of vector-env steps: which transitions are sent,
with which next observation and flags, under each autoreset mode; and
run_actor against a real qstreamd, reporting every finished episode."""

import re
import time
import urllib.request

import gymnasium as gym
import numpy as np
import pytest

from qstream.actor import EpsilonSchedule, TransitionRecorder, _autoreset_mode, run_actor


def step(rec, obs, next_obs, rewards, terminated, truncated, infos=None):
    return rec.record(
        np.asarray(obs, np.float32), np.array([[0], [1]]), rewards, np.asarray(next_obs, np.float32),
        terminated, truncated, infos or {},
    )


def test_next_step_mode_sends_final_obs_and_skips_the_reset_step():
    rec = TransitionRecorder(2, "next_step")
    # env 0 terminates: its next_obs is the final observation, done=True.
    t, fin = step(rec, [[0.0], [10.0]], [[1.0], [11.0]], [1, 2], [True, False], [False, False])
    np.testing.assert_array_equal(t["env_ids"], [0, 1])
    np.testing.assert_array_equal(t["done"], [True, False])
    np.testing.assert_array_equal(t["next_obs"], [[1.0], [11.0]])
    assert fin == [(1.0, 1)]  # (return, length)
    # The following step only resets env 0: not a transition.
    t, fin = step(rec, [[1.0], [11.0]], [[5.0], [12.0]], [0, 2], [False, False], [False, False])
    np.testing.assert_array_equal(t["env_ids"], [1])
    np.testing.assert_array_equal(t["obs"], [[11.0]])
    assert fin == []
    # env 1 hits the time limit: truncated, not done; its return is 2 + 2 + 3
    # over 3 steps.
    t, fin = step(rec, [[5.0], [12.0]], [[6.0], [13.0]], [1, 3], [False, False], [False, True])
    np.testing.assert_array_equal(t["env_ids"], [0, 1])
    np.testing.assert_array_equal(t["done"], [False, False])
    np.testing.assert_array_equal(t["truncated"], [False, True])
    assert fin == [(7.0, 3)]
    assert fin[0].episode_return == 7.0 and fin[0].length == 3
    # env 0's next episode counts from its first real step, not the reset step.
    t, fin = step(rec, [[6.0], [0.0]], [[7.0], [1.0]], [4, 0], [True, False], [False, False])
    assert fin == [(5.0, 2)]


def test_terminated_and_truncated_together_is_terminal():
    rec = TransitionRecorder(2, "next_step")
    t, _ = step(rec, [[0.0], [0.0]], [[1.0], [1.0]], [1, 1], [True, False], [True, False])
    np.testing.assert_array_equal(t["done"], [True, False])
    np.testing.assert_array_equal(t["truncated"], [False, False])


def test_same_step_mode_takes_final_obs_from_infos():
    rec = TransitionRecorder(2, "same_step")
    infos = {"final_obs": np.array([np.array([9.0], np.float32), None], dtype=object)}
    t, fin = step(rec, [[0.0], [10.0]], [[0.5], [11.0]], [1, 1], [True, False], [False, False], infos)
    np.testing.assert_array_equal(t["env_ids"], [0, 1])
    np.testing.assert_array_equal(t["next_obs"], [[9.0], [11.0]])  # not the reset obs 0.5
    t, _ = step(rec, [[0.5], [11.0]], [[0.6], [12.0]], [1, 1], [False, False], [False, False])
    np.testing.assert_array_equal(t["env_ids"], [0, 1])  # nothing skipped in same-step mode


def test_real_cartpole_vector_env_transitions_chain_per_env():
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(3)])
    assert _autoreset_mode(envs) == "next_step"
    rec = TransitionRecorder(3, "next_step")
    rng = np.random.default_rng(0)
    obs, _ = envs.reset(seed=0)
    last_next = {}
    sent = np.zeros(3, int)  # transitions of each env's current episode
    episodes = 0
    for _ in range(400):
        a = rng.integers(0, 2, 3)
        next_obs, r, term, trunc, infos = envs.step(a)
        t, fin = rec.record(obs, a[:, None], r, next_obs, term, trunc, infos)
        ended = []
        for k, i in enumerate(t["env_ids"]):
            sent[i] += 1
            if t["done"][k] or t["truncated"][k]:
                ended.append(int(sent[i]))
                sent[i] = 0
            if i in last_next:  # continues the same episode: obs == previous next_obs
                np.testing.assert_array_equal(t["obs"][k], last_next[i])
            if t["done"][k]:
                x, theta = t["next_obs"][k][0], t["next_obs"][k][2]
                assert abs(x) > 2.4 or abs(theta) > 12 * 2 * np.pi / 360  # the real final state
                last_next.pop(i)
            else:
                last_next[i] = t["next_obs"][k]
        assert [e.length for e in fin] == ended  # every transition of the episode, counted once
        assert all(e.episode_return == e.length for e in fin)  # CartPole: reward 1 per step
        episodes += len(fin)
        obs = next_obs
    envs.close()
    assert episodes > 5


def test_epsilon_schedule():
    e = EpsilonSchedule(1.0, 0.1, 100)
    assert e(0) == 1.0 and e(50) == pytest.approx(0.55) and e(100) == pytest.approx(0.1) and e(10**6) == 0.1


# CartPole's network; the learner never starts (min size = capacity).
CARTPOLE_IDLE_CONFIG = """
network { obs_dim: 4 trunk_hidden: 16 head_hidden: 8 num_atoms: 11 branch_actions: 2 }
replay { capacity: 100000 }
rate_limiter { min_size_to_sample: 100000 samples_per_insert: 1 }
returns { n_step: 3 gamma: 0.99 }
"""


def test_run_actor_reports_every_finished_episode_to_the_daemon(start_daemon):
    d = start_daemon(CARTPOLE_IDLE_CONFIG)
    result = run_actor("CartPole-v1", d.grpc, num_envs=3, total_steps=600, epsilon=EpsilonSchedule(1.0, 1.0, 1),
                       log=lambda *_: None)
    assert result.episodes > 10  # random actions end CartPole episodes after ~20 steps

    def metric(name):
        with urllib.request.urlopen(f"http://{d.metrics}/metrics", timeout=10) as r:
            m = re.search(rf'^{name}{{env="CartPole-v1"}} (\S+)$', r.read().decode(), re.M)
        return float(m.group(1)) if m else None

    deadline = time.monotonic() + 20
    while metric("qstream_episode_return_count") != result.episodes:
        assert time.monotonic() < deadline, f"{metric('qstream_episode_return_count')} of {result.episodes} episodes"
        time.sleep(0.05)
    # CartPole pays 1 per step: the returns add up to the lengths.
    assert metric("qstream_episode_return_sum") == metric("qstream_episode_length_steps_sum") > 0
