"""qstream.Writer against a real qstreamd: flushes by size, by time and on
close, the exact acknowledged count, vector envs in the step-stream form, error
acks, and back-pressure from a daemon whose paused learner holds inserts."""

import re
import threading
import time
import urllib.request

import numpy as np
import pytest

from qstream import AdminClient, Backpressure, BatchRejected, Writer

OBS_DIM = 4

# The learner never starts (min size = capacity): the replay holds exactly
# what was inserted.
IDLE_CONFIG = """
network { obs_dim: 4 trunk_hidden: 16 head_hidden: 8 num_atoms: 11 branch_actions: 2 }
replay { capacity: 200000 }
rate_limiter { min_size_to_sample: 200000 samples_per_insert: 1 }
returns { n_step: 3 gamma: 0.99 }
"""

# Inserts pass while inserted - sampled <= min_size + error_buffer = 54, so
# with the learner paused the 7th batch of 10 waits at the learner.
LIMITED_CONFIG = """
network { obs_dim: 4 trunk_hidden: 16 head_hidden: 8 num_atoms: 11 branch_actions: 2 }
replay { capacity: 10000 batch_size: 8 }
rate_limiter { min_size_to_sample: 50 samples_per_insert: 1 error_buffer: 4 }
returns { n_step: 3 gamma: 0.99 }
"""


def wait_until(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout}s"
        time.sleep(0.01)


def terminal_steps(w, rng, n):
    """n one-step episodes: every step is inserted at once (no n-step wait)."""
    obs = rng.normal(size=(n, OBS_DIM))
    w.append(obs, rng.integers(0, 2, n), np.ones(n), np.ones(n, bool), np.zeros(n, bool), next_obs=obs + 0.1,
             env_ids=np.arange(n))


def test_flush_by_size_and_close_with_the_exact_acknowledged_count(start_daemon):
    d = start_daemon(IDLE_CONFIG)
    rng = np.random.default_rng(0)
    w = Writer(d.grpc, obs_dim=OBS_DIM, num_branches=1, max_batch=10, max_delay=None)
    for _ in range(5):
        terminal_steps(w, rng, 5)  # 25 rows: two full batches go out, 5 stay buffered
    wait_until(lambda: d.status().transitions_ingested == 20, what="two batches by size")
    assert w.buffered == 5
    assert w.flush() == 25
    terminal_steps(w, rng, 3)
    assert w.close() == 28
    st = d.status()
    assert st.transitions_ingested == st.replay_size == 28
    assert st.batches_ingested == 4


def test_flush_by_time_without_another_append(start_daemon):
    d = start_daemon(IDLE_CONFIG)
    with Writer(d.grpc, max_batch=512, max_delay=0.05) as w:
        terminal_steps(w, np.random.default_rng(1), 3)
        wait_until(lambda: d.status().transitions_ingested == 3, timeout=10, what="the time flush")
        assert w.buffered == 0
        # The ack leaves the daemon after the insert that Status counts: it may arrive a moment later.
        wait_until(lambda: w.acked == 3, timeout=10, what="the ack of the time flush")


def test_vector_env_chaining_and_episode_ends_reach_the_replay(start_daemon):
    """Four envs appended without next_obs for 30 vector steps, each env
    ending an episode every 7 steps (terminated) or truncating it with its
    final obs: every row is sent (the step-stream form) and every step whose
    next obs is known is inserted (the n-step windows are flushed at close);
    the last step of each env whose episode is still open is not."""
    d = start_daemon(IDLE_CONFIG)
    rng = np.random.default_rng(2)
    num_envs, steps = 4, 30
    w = Writer(d.grpc, obs_dim=OBS_DIM, num_branches=1, max_batch=16, max_delay=None)
    for t in range(steps):
        obs = rng.normal(size=(num_envs, OBS_DIM))
        ends = (t + np.arange(num_envs)) % 7 == 6
        terminated = ends & (np.arange(num_envs) % 2 == 0)
        truncated = ends & ~terminated
        if truncated.any():
            w.append(obs, rng.integers(0, 2, num_envs), np.ones(num_envs), terminated, truncated,
                     next_obs=obs + 1)
        else:
            w.append(obs, rng.integers(0, 2, num_envs), np.ones(num_envs), terminated, truncated)
    w.close()
    sent = w.stats.sent_transitions
    assert sent == num_envs * steps
    open_at_close = int(((steps - 1 + np.arange(num_envs)) % 7 != 6).sum())
    assert open_at_close == num_envs
    st = d.status()
    assert st.transitions_ingested == st.replay_size == sent - open_at_close


def test_error_ack_raises_batch_rejected_and_the_stream_carries_on(start_daemon):
    d = start_daemon(IDLE_CONFIG)
    rng = np.random.default_rng(3)
    with Writer(d.grpc, obs_dim=OBS_DIM, num_branches=1, max_batch=8, max_delay=None) as w:
        obs = rng.normal(size=(8, OBS_DIM))
        w.append(obs, np.zeros(8), np.full(8, np.nan), np.ones(8, bool), np.zeros(8, bool), next_obs=obs)
        with pytest.raises(BatchRejected) as e:
            w.flush()
        assert e.value.field == "rewards"
        assert "rewards" in str(e.value)
        w.append(obs, np.full(8, 2), np.ones(8), np.ones(8, bool), np.zeros(8, bool), next_obs=obs)
        with pytest.raises(BatchRejected) as e:
            w.flush()
        assert e.value.field == "actions"  # action 2 of a 2-action branch
        terminal_steps(w, rng, 8)
        assert w.flush() == 8
    st = d.status()
    assert st.transitions_ingested == 8
    assert st.batches_rejected == 2


def test_backpressure_raises_or_blocks_while_a_paused_learner_holds_inserts(start_daemon):
    d = start_daemon(LIMITED_CONFIG)
    rng = np.random.default_rng(4)
    with AdminClient(d.grpc) as admin:
        admin.pause()
        w = Writer(d.grpc, obs_dim=OBS_DIM, num_branches=1, max_batch=10, max_in_flight=2, max_delay=None,
                   block=False)
        for i in range(1, 7):
            terminal_steps(w, rng, 10)
            wait_until(lambda: w.stats.acked_batches == i, what=f"ack {i}")
        terminal_steps(w, rng, 10)  # the 7th waits at the rate limiter: 60 inserted > 54
        terminal_steps(w, rng, 10)  # the 8th fills the window (the daemon reads it only after the 7th)
        terminal_steps(w, rng, 10)  # fits the buffer
        assert w.buffered == 10
        with pytest.raises(Backpressure):
            terminal_steps(w, rng, 1)
        with pytest.raises(Backpressure):
            w.flush()
        assert w.buffered == 10 and w.stats.acked_batches == 6

        # A blocking writer on another stream waits instead.
        b = Writer(d.grpc, obs_dim=OBS_DIM, num_branches=1, max_batch=10, max_in_flight=1, max_delay=None)
        terminal_steps(b, rng, 10)  # in flight: the window is full
        blocked_done = threading.Event()

        def second():
            terminal_steps(b, rng, 10)  # a full buffer waits for a slot
            blocked_done.set()

        t = threading.Thread(target=second)
        t.start()
        assert not blocked_done.wait(0.5)

        admin.resume()  # the learner samples, the limiter lets inserts through
        assert blocked_done.wait(30)
        t.join()
        assert w.close() == 90
        assert b.close() == 20
    assert d.status().transitions_ingested == 110


def episode_metrics(d) -> dict:
    """{(name, env): value} of the qstream_episode_* samples on the daemon's /metrics."""
    with urllib.request.urlopen(f"http://{d.metrics}/metrics", timeout=10) as r:
        page = r.read().decode()
    return {(m.group(1), m.group(2)): float(m.group(3))
            for m in re.finditer(r'^(qstream_episode_\w+)\{env="([^"]*)"\} (\S+)$', page, re.M)}


def test_reported_episodes_reach_the_daemon_metrics_once(start_daemon):
    d = start_daemon(IDLE_CONFIG)
    rng = np.random.default_rng(5)
    w = Writer(d.grpc, obs_dim=OBS_DIM, num_branches=1, max_batch=4, max_delay=None, env="CartPole-v1")
    terminal_steps(w, rng, 3)
    w.report_episode(21.0, 21, policy_version=0)
    w.report_episode(-3.5, 4)
    terminal_steps(w, rng, 1)  # fills the batch: the reports go with it
    assert w.flush() == 4
    w.report_episode(100.25, 101)  # no row left: goes alone at close
    w.close()
    wait_until(lambda: episode_metrics(d).get(("qstream_episode_return_count", "CartPole-v1")) == 3,
               what="three episodes on /metrics")
    time.sleep(1.2)  # later polls count nothing again
    m = episode_metrics(d)
    assert m[("qstream_episode_return_count", "CartPole-v1")] == 3
    assert m[("qstream_episode_return_sum", "CartPole-v1")] == 21.0 - 3.5 + 100.25
    assert m[("qstream_episode_length_steps_sum", "CartPole-v1")] == 21 + 4 + 101
    assert d.status().replay_size == 4
