"""ActorClient against a real qstreamd: acks, rejected batches, and a client
killed mid-stream losing nothing that was acknowledged."""

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tcp_proxy import TcpProxy

from qstream import ActorClient, AdminClient, BatchRejected, Writer, nstep_batch, step_batch
from qstream.batch import to_numpy

# CartPole-shaped; the learner never starts (min size = capacity), so the
# replay holds exactly what was inserted.
IDLE_CONFIG = """
network { obs_dim: 4 trunk_hidden: 16 head_hidden: 8 num_atoms: 11 branch_actions: 2 }
replay { capacity: 200000 }
rate_limiter { min_size_to_sample: 200000 samples_per_insert: 1 }
returns { n_step: 3 gamma: 0.99 }
"""


def good_steps(rng, n, env_id=0):
    obs = rng.normal(size=(n, 4))
    done = np.zeros(n, dtype=bool)
    done[-1] = True  # closes the episode: every step's n-step transition is emitted
    return dict(obs=obs, actions=rng.integers(0, 2, n), rewards=np.ones(n), next_obs=obs + 0.1, done=done,
                env_ids=np.full(n, env_id))


def test_step_batches_are_acknowledged_and_inserted(start_daemon):
    d = start_daemon(IDLE_CONFIG)
    rng = np.random.default_rng(0)
    with ActorClient(d.grpc, batch_size=50) as c:
        for _ in range(4):
            c.add_steps(**good_steps(rng, 25))
        c.flush()
        stats = c.stats
    assert stats.sent_transitions == 100
    assert stats.acked_batches == stats.sent_batches == 2
    assert stats.accepted_transitions == 100  # each episode ended: nothing waits in a window
    st = d.status()
    assert st.transitions_ingested == 100
    assert st.replay_size == 100


def poke(tensor, index, value):
    """Sets element `index` (row-major) of a Tensor column."""
    a = to_numpy(tensor).copy()
    a.flat[index] = value
    tensor.data = a.tobytes()


@pytest.mark.parametrize(
    "field, corrupt",
    [
        ("rewards", lambda b: poke(b.rewards, 3, float("nan"))),
        ("obs", lambda b: setattr(b.obs, "data", b.obs.data[:-4])),  # one float short
        ("actions", lambda b: poke(b.actions, 0, 2)),
        ("actions", lambda b: poke(b.actions, 1, -1)),
    ],
)
def test_bad_batch_raises_batch_rejected_naming_field(start_daemon, field, corrupt):
    d = start_daemon(IDLE_CONFIG)
    rng = np.random.default_rng(1)
    with ActorClient(d.grpc) as c:
        bad = step_batch(**good_steps(rng, 10))
        corrupt(bad)
        c.send(bad)
        with pytest.raises(BatchRejected) as e:
            c.flush()
        assert e.value.field == field
        assert field in str(e.value)
        assert e.value.message
        # The stream keeps working after a rejected batch.
        c.send(step_batch(**good_steps(rng, 10)))
        c.flush()
        assert c.stats.accepted_transitions == 10
    st = d.status()
    assert st.transitions_ingested == 10
    assert st.batches_rejected >= 1


def test_rejection_surfaces_on_next_send(start_daemon):
    d = start_daemon(IDLE_CONFIG)
    rng = np.random.default_rng(2)
    c = ActorClient(d.grpc, max_in_flight=1)
    bad = step_batch(**good_steps(rng, 5))
    poke(bad.rewards, 0, float("inf"))
    c.send(bad)
    # With one batch in flight, the next send waits for the error ack and raises.
    with pytest.raises(BatchRejected) as e:
        c.send(step_batch(**good_steps(rng, 5)))
    assert e.value.field == "rewards"
    c.close()


def test_killed_client_loses_nothing_acknowledged(start_daemon):
    d = start_daemon(IDLE_CONFIG)
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("client_child.py")), d.grpc, "4"],
        stdout=subprocess.PIPE,
        text=True,
    )
    acked = sent = 0
    try:
        for line in child.stdout:
            kind, value = line.split()
            if kind == "ACKED":
                acked = max(acked, int(value))
            else:
                sent = max(sent, int(value))
            if acked >= 5000:
                break
        child.send_signal(signal.SIGKILL)
        # Lines the child flushed before dying are still in the pipe.
        for line in child.stdout:
            kind, value = line.split()
            if kind == "ACKED":
                acked = max(acked, int(value))
            else:
                sent = max(sent, int(value))
    finally:
        child.kill()
        child.wait()
    assert acked >= 5000

    # Wait until the daemon has settled what the dead stream delivered.
    previous = -1
    for _ in range(100):
        st = d.status()
        if st.transitions_ingested == previous and st.actor_streams == 0:
            break
        previous = st.transitions_ingested
        time.sleep(0.2)
    ingested = st.transitions_ingested
    print(f"killed client: acked={acked} ingested={ingested} sent={sent}")
    assert acked <= ingested <= sent
    assert ingested % 100 == 0  # batches are inserted whole or not at all
    assert st.replay_size == ingested


def send_across_cuts(start_daemon, open_client, count, cuts, send):
    """A client (open_client(address) -> ActorClient or Writer) reaches an
    idle daemon through a proxy; send(client, i) for i < count, the
    connection cut before each i in `cuts`. Checks that it reconnected at
    every cut and that each batch was sent and acknowledged once; returns
    (the daemon's status, flush()'s count)."""
    d = start_daemon(IDLE_CONFIG)
    proxy = TcpProxy(d.grpc)
    try:
        with open_client(proxy.address) as c:
            for i in range(count):
                if i in cuts:
                    assert proxy.cut() > 0
                send(c, i)
            acked = c.flush(timeout=60)
            stats = c.stats
    finally:
        proxy.close()
    assert stats.reconnects >= len(cuts)
    assert stats.acked_batches == stats.sent_batches == count
    return d.status(), acked


def test_reconnect_resends_unacknowledged_without_duplicates(start_daemon):
    """Connections cut twice mid-stream: the client reconnects, resends what
    was not acknowledged under the same stream_id/sequence, and the replay
    ends up with every transition exactly once."""
    rng = np.random.default_rng(3)
    batches, per_batch = 120, 50

    def send(c, i):
        obs = rng.normal(size=(per_batch, 4))
        c.send(nstep_batch(obs, rng.integers(0, 2, per_batch), np.ones(per_batch), np.full(per_batch, 0.9), obs))

    st, _ = send_across_cuts(start_daemon, lambda address: ActorClient(address, max_in_flight=8, max_backoff_s=0.5),
                             batches, (40, 80), send)
    assert st.transitions_ingested == batches * per_batch
    assert st.replay_size == batches * per_batch


def test_whole_batch_appends_across_cut_connections_insert_every_step_once(start_daemon):
    """Writer.append of whole batches (sent from the caller's arrays, not the
    buffer) over connections cut twice mid-stream, from 8 envs: every
    acknowledged step is in the replay exactly once."""
    rng = np.random.default_rng(5)
    appends, envs, steps_per_env = 90, 8, 8  # 64 rows per append = one batch
    n = envs * steps_per_env

    def send(w, i):
        obs = rng.normal(size=(n, 4))
        done = np.zeros(n, bool)
        done[-envs:] = True  # each env's last step ends its episode: all its steps are emitted
        w.append(obs, rng.integers(0, 2, n), np.ones(n), done, np.zeros(n, bool), next_obs=obs + 0.1,
                 env_ids=np.tile(np.arange(envs), steps_per_env))

    st, acked = send_across_cuts(
        start_daemon, lambda address: Writer(address, obs_dim=4, num_branches=1, max_batch=n, max_delay=None,
                                             max_in_flight=8, max_backoff_s=0.5), appends, (30, 60), send)
    assert st.transitions_ingested == st.replay_size == appends * n
    # A resend whose first ack the cut lost is acknowledged as a duplicate
    # that carries its first insert's count (Ack.accepted_before): the
    # Writer's count is exactly what is in the replay.
    assert acked == st.transitions_ingested


def test_concurrent_writers_across_cuts_insert_exactly_the_sent_steps(start_daemon, tmp_path):
    """Four Writers at once (the SDK's default stream: the native one under
    ctest), each through its own proxy cut twice mid-stream, each appending
    whole batches from 8 envs with every step tagged: the replay, read back
    from a checkpoint, holds every sent step exactly once and nothing else."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    ckpt = tmp_path / "ckpt"
    d = start_daemon(IDLE_CONFIG, f"--checkpoint_dir={ckpt}")
    writers, appends, envs, steps_per_env = 4, 40, 8, 8
    n = envs * steps_per_env
    done = np.zeros(n, bool)
    done[-envs:] = True  # each env's last step ends its episode: all its steps are emitted
    env_ids = np.tile(np.arange(envs), steps_per_env)
    failures, reconnects = [], []

    def run(k):
        proxy = TcpProxy(d.grpc)
        try:
            with Writer(proxy.address, obs_dim=4, num_branches=1, max_batch=n, max_delay=None, max_in_flight=8,
                        max_backoff_s=0.5) as w:
                for i in range(appends):
                    if i in (13, 27):
                        proxy.cut()
                    obs = np.zeros((n, 4))
                    obs[:, 0] = (k * appends + i) * n + np.arange(n)  # the tag: unique per step
                    w.append(obs, np.zeros(n, int), np.ones(n), done, np.zeros(n, bool), next_obs=obs,
                             env_ids=env_ids)
                w.flush(timeout=60)
                reconnects.append(w.stats.reconnects)
        except BaseException as e:  # raised in the test's thread below
            failures.append(e)
        finally:
            proxy.close()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    assert len(reconnects) == writers and min(reconnects) >= 2
    total = writers * appends * n
    assert d.status().transitions_ingested == total
    with AdminClient(d.grpc) as admin:
        name = admin.checkpoint("multiset", timeout=60).name
    replay = safetensors_numpy.load_file(str(ckpt / name / "replay.safetensors"))
    tags = np.sort(replay["obs"][:, 0])
    np.testing.assert_array_equal(tags, np.arange(total, dtype=np.float32))


def test_close_returns_when_the_daemon_is_gone(start_daemon):
    d = start_daemon(IDLE_CONFIG)
    rng = np.random.default_rng(4)
    c = ActorClient(d.grpc, reconnect_timeout_s=600)
    c.send(step_batch(**good_steps(rng, 5)))
    c.flush(timeout=30)
    assert d.stop() == 0
    c.send(step_batch(**good_steps(rng, 5)))  # never acknowledged
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        c.close(timeout=1)
    assert time.monotonic() - start < 10
    assert c.stats.acked_batches == 1
