"""qstream.Writer over several addresses (a SpreadWriter) against two
in-process fake ExperienceServices: which rows, reports and batches go to
which address, under which stream ids, and the counts summed."""

import numpy as np
import pytest
from fake_daemon import FakeDaemon

from qstream import ActorClient, Writer, nstep_batch, step_batch
from qstream.batch import to_numpy
from qstream.spread import SpreadWriter

OBS_DIM = 3


@pytest.fixture
def fakes():
    ds = [FakeDaemon(), FakeDaemon()]
    yield ds
    for d in ds:
        d.stop()


def rows(n, value=0.0):
    obs = np.full((n, OBS_DIM), value, np.float32)
    return obs, np.zeros(n), np.ones(n), np.zeros(n, bool), np.zeros(n, bool)


def env_ids(daemon):
    return sorted({int(e) for b in daemon.batches if b.HasField("env_ids") for e in to_numpy(b.env_ids)})


def test_each_env_goes_to_address_env_id_mod_n(fakes):
    a, b = fakes
    w = Writer(f"{a.address},{b.address}", obs_dim=OBS_DIM, num_branches=1, max_delay=None, stream_id="spread")
    assert isinstance(w, SpreadWriter) and isinstance(w, Writer)
    assert w.servers == [a.address, b.address] and w.stream_id == "spread"
    for step in range(3):
        obs, act, rew, term, trunc = rows(5, step)
        w.append(obs, act, rew, term, trunc, next_obs=obs + 1)  # env ids 0..4
    # Without next_obs too (the daemon chains an env's next obs, on its address).
    obs, act, rew, term, trunc = rows(2, 9)
    w.append(obs, act, rew, term, trunc, env_ids=[6, 7])
    w.append(obs + 1, act, rew, term, trunc, env_ids=[6, 7])
    assert w.flush() == 3 * 5 + 4  # the fake acknowledges every row
    assert env_ids(a) == [0, 2, 4, 6] and env_ids(b) == [1, 3, 7]
    assert {x.stream_id for x in a.batches} == {"spread/0"} and {x.stream_id for x in b.batches} == {"spread/1"}
    assert not any(x.HasField("next_obs") for x in a.batches + b.batches)
    stats = w.stats
    assert stats.accepted_transitions == 19 and stats.acked_batches == len(a.batches) + len(b.batches)
    assert w.close() == 19


def test_single_env_reports_and_ready_batches(fakes):
    a, b = fakes
    w = Writer([a.address, b.address], obs_dim=OBS_DIM, num_branches=1, max_delay=None)
    w.append(np.zeros(OBS_DIM), 1, 1.0, True, False, env_ids=[3])  # one env, unbatched: 3 % 2 -> b
    for length in (1, 2, 3):
        w.report_episode(float(length), length, policy_version=5)
    w.send(nstep_batch(np.zeros((2, OBS_DIM)), np.zeros((2, 1)), np.ones(2), np.ones(2), np.zeros((2, OBS_DIM))))
    with pytest.raises(ValueError, match="KIND_STEP"):
        w.send(step_batch(np.zeros((1, OBS_DIM)), np.zeros((1, 1)), np.ones(1), np.zeros((1, OBS_DIM)), [True]))
    assert w.close() == 3
    reports = [[e.length for x in d.batches for e in x.episodes] for d in fakes]
    assert sorted(reports[0] + reports[1]) == [1, 2, 3] and reports[0] and reports[1]
    assert env_ids(b) == [3] and sum(x.count for x in a.batches) + sum(x.count for x in b.batches) == 3


def test_refusals(fakes):
    a, b = fakes
    with pytest.raises(ValueError, match="block=False takes one address"):
        Writer([a.address, b.address], block=False)
    with pytest.raises(ValueError, match="listed twice"):
        Writer([a.address, a.address])


def test_actor_client_spreads_by_env_id(fakes):
    a, b = fakes
    with ActorClient([a.address, b.address], batch_size=4, stream_id="client") as c:
        assert c.stream_id == "client"
        obs, act, rew, _, _ = rows(4)
        c.add_steps(obs, act, rew, obs + 1, np.ones(4, bool), env_ids=[0, 1, 2, 3])
        assert c.flush() == 4
    assert env_ids(a) == [0, 2] and env_ids(b) == [1, 3]
