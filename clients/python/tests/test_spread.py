"""The SDK over two real qstreamd ranks (child processes on free loopback
ports): a Writer and run_actor given both addresses put every env on one
rank, both ranks ingest, and the acknowledged counts add up to what the
ranks ingested."""

import numpy as np

from qstream import Writer, run_actor

# The learner never starts (min size = capacity): the replay holds exactly
# what was inserted.
IDLE_CONFIG = """
network { obs_dim: 4 trunk_hidden: 16 head_hidden: 8 num_atoms: 11 branch_actions: 2 }
replay { capacity: 200000 }
rate_limiter { min_size_to_sample: 200000 samples_per_insert: 1 }
returns { n_step: 3 gamma: 0.99 }
"""
N_STEP = 3


def test_writer_puts_each_env_on_one_rank(start_daemon):
    ranks = [start_daemon(IDLE_CONFIG), start_daemon(IDLE_CONFIG)]
    rng = np.random.default_rng(0)
    envs, steps = 4, 250
    with Writer([d.grpc for d in ranks], obs_dim=4, num_branches=1, max_batch=64) as w:
        obs = rng.normal(size=(envs, 4))
        for _ in range(steps):
            next_obs = rng.normal(size=(envs, 4))
            w.append(obs, rng.integers(0, 2, envs), np.ones(envs), np.zeros(envs, bool), np.zeros(envs, bool),
                     next_obs=next_obs)
            obs = next_obs
        acked = w.flush()
    # Envs 0 and 2 on the first rank, 1 and 3 on the second; the half-close
    # flushed each env's n-step window.
    assert [d.status().transitions_ingested for d in ranks] == [2 * steps, 2 * steps]
    assert envs * steps - envs * (N_STEP - 1) <= acked <= envs * steps
    assert w.stats.accepted_transitions == acked


def test_run_actor_spreads_its_envs_and_takes_the_policy_from_the_first(start_daemon):
    ranks = [start_daemon(IDLE_CONFIG), start_daemon(IDLE_CONFIG)]
    result = run_actor("CartPole-v1", f"{ranks[0].grpc},{ranks[1].grpc}", num_envs=4, total_steps=800,
                       batch_size=64, report_every_s=60, log=lambda line: None)
    ingested = [d.status().transitions_ingested for d in ranks]
    assert all(n > 0 for n in ingested), ingested
    assert sum(ingested) == result.env_steps
    assert result.env_steps - 4 * (N_STEP - 1) <= result.accepted_transitions <= result.env_steps
    assert result.policy_version == ranks[0].status().policy_version
