"""run_actor's bookkeeping of vector-env steps: which transitions are sent,
with which next observation and flags, under each autoreset mode."""

import gymnasium as gym
import numpy as np
import pytest

from qstream.actor import EpsilonSchedule, TransitionRecorder, _autoreset_mode


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
    assert fin == [1.0]
    # The following step only resets env 0: not a transition.
    t, fin = step(rec, [[1.0], [11.0]], [[5.0], [12.0]], [0, 2], [False, False], [False, False])
    np.testing.assert_array_equal(t["env_ids"], [1])
    np.testing.assert_array_equal(t["obs"], [[11.0]])
    assert fin == []
    # env 1 hits the time limit: truncated, not done; its return is 2 + 2 + 3.
    t, fin = step(rec, [[5.0], [12.0]], [[6.0], [13.0]], [1, 3], [False, False], [False, True])
    np.testing.assert_array_equal(t["env_ids"], [0, 1])
    np.testing.assert_array_equal(t["done"], [False, False])
    np.testing.assert_array_equal(t["truncated"], [False, True])
    assert fin == [7.0]


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
    episodes = 0
    for _ in range(400):
        a = rng.integers(0, 2, 3)
        next_obs, r, term, trunc, infos = envs.step(a)
        t, fin = rec.record(obs, a[:, None], r, next_obs, term, trunc, infos)
        for k, i in enumerate(t["env_ids"]):
            if i in last_next:  # continues the same episode: obs == previous next_obs
                np.testing.assert_array_equal(t["obs"][k], last_next[i])
            if t["done"][k]:
                x, theta = t["next_obs"][k][0], t["next_obs"][k][2]
                assert abs(x) > 2.4 or abs(theta) > 12 * 2 * np.pi / 360  # the real final state
                last_next.pop(i)
            else:
                last_next[i] = t["next_obs"][k]
        episodes += len(fin)
        obs = next_obs
    envs.close()
    assert episodes > 5


def test_epsilon_schedule():
    e = EpsilonSchedule(1.0, 0.1, 100)
    assert e(0) == 1.0 and e(50) == pytest.approx(0.55) and e(100) == pytest.approx(0.1) and e(10**6) == 0.1
