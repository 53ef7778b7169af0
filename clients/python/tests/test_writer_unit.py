"""qstream.Writer against an in-process fake ExperienceService (no qstreamd):
what batches it sends, when, and how it holds back and fails."""

import socket
import threading
import time

import grpc
import numpy as np
import pytest
from conftest import require_native
from fake_daemon import FakeDaemon

from qstream import Backpressure, BatchRejected, StreamError, Writer, nstep_batch
from qstream.batch import Tensor, to_numpy

OBS_DIM = 3


@pytest.fixture(params=["aio", "native", "sync"])
def fake(request):
    """The fake daemon, and `target` and `kw` for the Writers of a test: its
    address with transport "aio" (the grpc.aio stream) or "native" (the gRPC
    C++ one of libqstream_native: skipped where it is not built), or a ready
    channel (the synchronous stream)."""
    if request.param == "native":
        require_native()
    d = FakeDaemon()
    channel = grpc.insecure_channel(d.address) if request.param == "sync" else None
    d.target = channel or d.address
    d.kw = {} if channel is not None else {"transport": request.param}
    yield d
    d.stop()
    if channel is not None:
        channel.close()


def writer(fake, **kw):
    kw.setdefault("max_delay", None)
    return Writer(fake.target, obs_dim=OBS_DIM, num_branches=1, **fake.kw, **kw)


def col(batch, name):
    return to_numpy(getattr(batch, name))


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def terminal_steps(w, values, env_ids=None):
    """One terminal step per value: obs = value, next_obs = value + 0.5."""
    v = np.asarray(values, np.float32)
    n = v.size
    w.append(np.repeat(v[:, None], OBS_DIM, 1), np.zeros(n), v, np.ones(n, bool), np.zeros(n, bool),
             next_obs=np.repeat(v[:, None] + 0.5, OBS_DIM, 1), env_ids=env_ids)


def test_flush_by_size_sends_batches_of_exactly_max_batch(fake):
    w = writer(fake, max_batch=4)
    for i in range(10):
        terminal_steps(w, [i])
    batches = fake.wait_batches(2)
    assert [b.count for b in batches] == [4, 4]
    assert w.buffered == 2
    np.testing.assert_array_equal(col(batches[1], "rewards"), [4, 5, 6, 7])
    assert w.close() == 10
    assert [b.count for b in fake.batches] == [4, 4, 2]
    assert [b.sequence for b in fake.batches] == [1, 2, 3]


def test_one_append_larger_than_max_batch_is_split_in_order(fake):
    w = writer(fake, max_batch=3)
    terminal_steps(w, np.arange(8))
    assert w.flush(timeout=10) == 8
    assert [b.count for b in fake.batches] == [3, 3, 2]
    np.testing.assert_array_equal(np.concatenate([col(b, "rewards") for b in fake.batches]), np.arange(8))
    w.close()


def test_flush_by_time_sends_a_partial_batch_once_the_oldest_row_is_max_delay_old(fake):
    w = writer(fake, max_batch=100, max_delay=0.05)
    start = time.monotonic()
    terminal_steps(w, [1, 2, 3])
    (batch,) = fake.wait_batches(1, timeout=5)  # sent by the sender thread: no further append
    assert time.monotonic() - start >= 0.05
    assert batch.count == 3
    assert w.buffered == 0
    w.close()


def test_no_time_flush_without_max_delay(fake):
    w = writer(fake, max_batch=100, max_delay=None)
    terminal_steps(w, [1, 2, 3])
    with pytest.raises(TimeoutError):
        fake.wait_batches(1, timeout=0.3)
    assert w.buffered == 3
    w.close()
    assert [b.count for b in fake.batches] == [3]


def test_close_sends_the_rest_and_returns_the_acknowledged_count(fake):
    w = writer(fake, max_batch=64)
    terminal_steps(w, np.arange(5))
    assert w.close() == 5
    assert [b.count for b in fake.batches] == [5]


def test_flush_returns_the_sum_of_accepted_and_a_rejected_batch_counts_nothing(fake):
    fake.reject[2] = ("rewards", "rewards[0] is nan")
    fake.hold()  # no ack before the last append: it would raise the rejection
    w = writer(fake, max_batch=2)
    terminal_steps(w, [1, 2])  # batch 1: accepted
    terminal_steps(w, [3, 4])  # batch 2: rejected
    terminal_steps(w, [5])
    fake.release()
    with pytest.raises(BatchRejected) as e:
        w.flush(timeout=10)
    assert (e.value.sequence, e.value.field, e.value.code) == (2, "rewards", "INVALID_FIELD")
    assert "rewards" in str(e.value)
    assert w.flush(timeout=10) == 3  # batches 1 and 3
    assert w.stats.acked_batches == 3
    w.close()


def test_error_ack_raises_batch_rejected_from_the_next_append_without_adding_it(fake):
    fake.reject[1] = ("obs", "obs: shape [1, 3], expected [1, 4]")
    w = writer(fake, max_batch=1, max_in_flight=1)
    terminal_steps(w, [1])
    wait_until(lambda: w.stats.acked_batches == 1)
    with pytest.raises(BatchRejected) as e:
        terminal_steps(w, [2])
    assert e.value.field == "obs"
    assert w.buffered == 0
    terminal_steps(w, [3])  # the stream carries on
    assert w.close() == 1
    np.testing.assert_array_equal(col(fake.batches[-1], "rewards"), [3])


def test_sent_tensors_round_trip_dtype_shape_and_bytes(fake):
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(4, OBS_DIM)).astype(np.float32)
    nxt = rng.normal(size=(4, OBS_DIM)).astype(np.float32)
    w = Writer(fake.target, max_batch=4, max_delay=None, **fake.kw)  # obs_dim and num_branches from the first append
    w.append(obs, [[0, 1], [1, 0], [2, 2], [0, 0]], [0.5, 1, 1.5, 2], [0, 1, 0, 0], [0, 0, 1, 0],
             next_obs=nxt, env_ids=[3, 1, 2, 0], policy_version=7)  # sent by size: the step-stream form
    w.append(obs[:2], [[1, 1], [2, 0]], [3, 4], [0, 0], [0, 0], next_obs=nxt[:2], env_ids=[3, 1])
    w.close()  # close sends the rest in the full form
    b, c = fake.batches
    assert b.kind == b.KIND_STEP and b.count == 4 and b.policy_version == 7 and b.stream_id == w.stream_id
    expect = {
        "obs": (Tensor.DTYPE_FLOAT32, obs),
        "final_obs": (Tensor.DTYPE_FLOAT32, nxt[[1, 2]]),  # the rows that end (done, truncated), in row order
        "actions": (Tensor.DTYPE_INT32, np.array([[0, 1], [1, 0], [2, 2], [0, 0]], np.int32)),
        "rewards": (Tensor.DTYPE_FLOAT32, np.array([0.5, 1, 1.5, 2], np.float32)),
        "done": (Tensor.DTYPE_BOOL, np.array([0, 1, 0, 0], bool)),
        "truncated": (Tensor.DTYPE_BOOL, np.array([0, 0, 1, 0], bool)),
        "env_ids": (Tensor.DTYPE_UINT32, np.array([3, 1, 2, 0], np.uint32)),
    }
    for name, (dtype, want) in expect.items():
        t = getattr(b, name)
        assert t.dtype == dtype, name
        assert list(t.shape) == list(want.shape), name
        assert t.data == want.tobytes(), name
    assert not b.HasField("discounts")
    assert not b.HasField("next_obs")  # the step-stream form
    assert c.count == 2 and not c.HasField("final_obs")
    assert c.next_obs.dtype == Tensor.DTYPE_FLOAT32 and list(c.next_obs.shape) == [2, OBS_DIM]
    assert c.next_obs.data == nxt[:2].tobytes()


def test_vector_env_steps_go_out_in_the_step_stream_form(fake):
    """Three envs appended without next_obs: every row goes out as appended
    (no next_obs on the wire: the daemon chains each env's next obs), env 1
    terminates at t=2 (its final_obs: its own obs stands in), env 2 is left
    out at t=3 (env_ids)."""
    w = writer(fake, max_batch=100)

    def obs_at(t, envs=(0, 1, 2)):
        return np.array([[10 * e + t] * OBS_DIM for e in envs], np.float32)

    for t in range(3):
        w.append(obs_at(t), [0, 1, 0], [t, t, t], [False, t == 2, False], [False] * 3, policy_version=t)
    assert w.buffered == 9
    w.append(obs_at(3, (0, 1)), [0, 0], [3, 3], [False, False], [False, False], env_ids=[0, 1])
    assert w.buffered == 11
    w.flush(timeout=10)
    (b,) = fake.batches
    assert not b.HasField("next_obs")
    np.testing.assert_array_equal(col(b, "env_ids"), [0, 1, 2] * 3 + [0, 1])
    np.testing.assert_array_equal(col(b, "obs")[:, 0], [0, 10, 20, 1, 11, 21, 2, 12, 22, 3, 13])
    np.testing.assert_array_equal(col(b, "done"), [False] * 7 + [True] + [False] * 3)
    np.testing.assert_array_equal(col(b, "final_obs"), [[12] * OBS_DIM])
    assert b.policy_version == 0
    w.close()


def test_next_obs_is_sent_only_for_the_steps_that_end(fake):
    """A step that does not end: its next_obs row is the env's next obs and
    is not sent; a truncated step's next_obs is its final_obs."""
    w = writer(fake, max_batch=4)  # the 4 rows go out by size, in the step-stream form
    w.append([1.0] * OBS_DIM, 0, 1.0, False, False, next_obs=[2.0] * OBS_DIM)  # single env, unbatched
    w.append([2.0] * OBS_DIM, 0, 2.0, False, True, next_obs=[2.5] * OBS_DIM)  # truncated, final obs given
    w.append(np.full((2, OBS_DIM), 3.0), [0, 0], [3, 3], [True, False], [False, False],
             next_obs=np.array([[3.5] * OBS_DIM, [4.0] * OBS_DIM]), env_ids=[0, 5])
    w.close()
    (b,) = fake.batches
    np.testing.assert_array_equal(col(b, "obs")[:, 0], [1, 2, 3, 3])
    np.testing.assert_array_equal(col(b, "env_ids"), [0, 0, 0, 5])
    np.testing.assert_array_equal(col(b, "truncated"), [False, True, False, False])
    np.testing.assert_array_equal(col(b, "done"), [False, False, True, False])
    np.testing.assert_array_equal(col(b, "final_obs")[:, 0], [2.5, 3.5])


def test_final_obs_rows_follow_their_rows_across_batches(fake):
    """Rows that end in an append split over several batches: each batch
    sent by size carries the final_obs of its own ended rows."""
    w = writer(fake, max_batch=3)
    n = 8
    obs = np.repeat(np.arange(n, dtype=np.float32)[:, None], OBS_DIM, 1)
    ends = np.array([1, 0, 1, 1, 0, 0, 0, 1], bool)
    w.append(obs, np.zeros(n), np.ones(n), ends & (np.arange(n) % 2 == 0), ends & (np.arange(n) % 2 == 1),
             next_obs=obs + 100, env_ids=np.arange(n))
    w.close()
    assert [b.count for b in fake.batches] == [3, 3, 2]
    got = [list(col(b, "final_obs")[:, 0]) if b.HasField("final_obs") else [] for b in fake.batches[:2]]
    assert got == [[100, 102], [103]]
    last = fake.batches[2]  # sent by close(): the full form
    assert not last.HasField("final_obs")
    np.testing.assert_array_equal(col(last, "next_obs")[:, 0], [106, 107])


@pytest.mark.parametrize("step_stream", [True, False])
def test_whole_batches_sent_from_the_callers_arrays_equal_those_sent_from_the_buffer(fake, step_stream):
    """An append of whole batches into an empty buffer goes out from the
    caller's arrays (no copy into the buffer); its batches equal, field for
    field, those of the same rows appended one at a time through the
    buffer, strided arrays, episode ends and a waiting report included."""
    rng = np.random.default_rng(3)
    n, max_batch, branches = 3 * 5 + 2, 5, 2
    wide = rng.normal(size=(n, 2 * OBS_DIM)).astype(np.float32)
    obs, nxt = wide[:, ::2], wide[:, 1::2]  # strided views of the caller's array
    actions = rng.integers(0, 4, size=(n, branches)).astype(np.int64)
    rewards = rng.normal(size=n)
    done, truncated = rng.random(n) < 0.3, rng.random(n) < 0.3
    env_ids = rng.permutation(n)
    sent = []
    for one_by_one in (False, True):
        w = Writer(fake.target, obs_dim=OBS_DIM, num_branches=branches, max_batch=max_batch, max_delay=None, **fake.kw,
                   step_stream=step_stream, env="Env-v0", stream_id="same")
        w.report_episode(2.5, 7)
        rows = [slice(i, i + 1) for i in range(n)] if one_by_one else [slice(0, n)]
        for r in rows:
            w.append(obs[r], actions[r], rewards[r], done[r], truncated[r], next_obs=nxt[r], env_ids=env_ids[r],
                     policy_version=4)
        w.close()
        sent.append(list(fake.batches))
        fake.batches.clear()
    direct, buffered = sent
    assert [b.count for b in direct] == [5, 5, 5, 2]
    assert direct == buffered
    assert direct[0].episodes[0].length == 7 and direct[0].env == "Env-v0"
    ends = done | truncated
    for i, b in enumerate(direct[:3]):
        r = slice(i * max_batch, (i + 1) * max_batch)
        np.testing.assert_array_equal(col(b, "obs"), obs[r])
        if step_stream:
            want = nxt[r][ends[r]]
            assert b.HasField("final_obs") == bool(want.size)
            if want.size:
                np.testing.assert_array_equal(col(b, "final_obs"), want)
        else:
            np.testing.assert_array_equal(col(b, "next_obs"), nxt[r])


def test_truncated_without_next_obs_raises_naming_it_and_adds_nothing(fake):
    w = writer(fake, max_batch=100)
    w.append(np.zeros((2, OBS_DIM)), [0, 0], [1, 1], [False, False], [False, False])
    with pytest.raises(ValueError, match="truncated.*next_obs"):
        w.append(np.ones((2, OBS_DIM)), [0, 0], [1, 1], [False, False], [False, True])
    assert w.buffered == 2  # the first append only
    w.close()


def test_terminated_and_truncated_together_is_terminated(fake):
    w = writer(fake, max_batch=100)
    w.append([0.0] * OBS_DIM, 0, 1.0, True, True)  # no next_obs needed: terminal wins
    w.close()
    (b,) = fake.batches
    np.testing.assert_array_equal(col(b, "done"), [True])
    np.testing.assert_array_equal(col(b, "truncated"), [False])
    np.testing.assert_array_equal(col(b, "final_obs"), [[0.0] * OBS_DIM])  # its own obs stands in


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(obs=np.zeros((2, 4))), "obs"),
        (dict(action=np.zeros(3)), "action"),
        (dict(reward=np.zeros(3)), "reward"),
        (dict(terminated=[True]), "terminated"),
        (dict(env_ids=[0, 1, 2]), "env_ids"),
        (dict(next_obs=np.zeros((2, 2))), "next_obs"),
    ],
)
def test_bad_shapes_raise_value_error_naming_the_argument(fake, kwargs, match):
    w = writer(fake)
    args = dict(obs=np.zeros((2, OBS_DIM)), action=[0, 0], reward=[0, 0], terminated=[False, False],
                truncated=[False, False])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        w.append(**args)
    assert w.buffered == 0
    w.close()


def test_constructor_checks(fake):
    for kw in (dict(max_batch=0), dict(max_in_flight=0), dict(max_delay=-1), dict(obs_dim=0)):
        with pytest.raises(ValueError):
            Writer(fake.address, **kw)


def test_backpressure_raises_when_the_window_is_full_and_applies_nothing(fake):
    fake.hold()  # no acks
    w = writer(fake, max_batch=2, max_in_flight=2, block=False)
    terminal_steps(w, [1, 2])  # batch 1
    terminal_steps(w, [3, 4])  # batch 2: the window is full
    terminal_steps(w, [5, 6])  # fits the buffer; not sent
    assert w.buffered == 2
    with pytest.raises(Backpressure):
        terminal_steps(w, [7])
    with pytest.raises(Backpressure):
        w.flush()
    assert w.buffered == 2  # nothing of the refused calls was applied
    fake.release()
    # The sender thread sends the full buffer as soon as an ack frees a slot.
    wait_until(lambda: w.stats.acked_batches == 3)
    assert w.buffered == 0
    assert w.flush(timeout=10) == 6
    terminal_steps(w, [7])
    assert w.close() == 7
    np.testing.assert_array_equal(np.concatenate([col(b, "rewards") for b in fake.batches]), np.arange(1, 8))


def test_blocking_append_waits_for_a_free_slot(fake):
    fake.hold()
    w = writer(fake, max_batch=1, max_in_flight=1)
    terminal_steps(w, [1])  # in flight: the window is full
    done = threading.Event()

    def second():
        terminal_steps(w, [2])  # fills the buffer, which must wait for a slot
        done.set()

    t = threading.Thread(target=second)
    t.start()
    assert not done.wait(0.3)  # blocked on the window
    fake.release()
    assert done.wait(10)
    t.join()
    assert w.close() == 2


def test_a_whole_batch_waits_for_a_slot_then_goes_out_from_the_callers_arrays(fake):
    """block=True, the window full: an append of a whole batch into the
    empty buffer waits for a slot and then sends its rows as they are
    (the buffer stays untouched); with block=False it is buffered and
    goes out, by the sender thread, once a slot frees."""
    for block in (True, False):
        fake.hold()
        w = writer(fake, max_batch=2, max_in_flight=1, block=block)
        terminal_steps(w, [1, 2])  # in flight: the window is full
        done = threading.Event()

        def second():
            terminal_steps(w, [3, 4])
            done.set()

        t = threading.Thread(target=second)
        t.start()
        if block:
            assert not done.wait(0.3)  # blocked on the window
            assert w.buffered == 0
        else:
            assert done.wait(10)
            assert w.buffered == 2
        fake.release()
        assert done.wait(10)
        t.join()
        assert w.close() == 4
        assert np.count_nonzero(w._buf.obs) == (0 if block else 2 * OBS_DIM)
        got = [list(col(b, "obs")[:, 0]) for b in fake.batches]
        assert got == [[1, 2], [3, 4]]
        if block:  # sent by size: the step-stream form (the sender thread and close() race otherwise)
            np.testing.assert_array_equal(col(fake.batches[1], "final_obs")[:, 0], [3.5, 4.5])
        fake.batches.clear()


def test_throttled_acks_halve_the_window_once_per_window_and_plain_acks_grow_it_back(fake):
    fake.throttle = {1, 2, 3, 4, 5}
    w = writer(fake, max_batch=1, max_in_flight=8)
    assert w.stats.window == 8
    for v in range(1, 6):  # one at a time: each ack is in before the next batch
        terminal_steps(w, [v])
        w.flush(timeout=10)
    s = w.stats
    assert s.throttled_acks == 5
    # Ack 1 cuts 8 -> 4; the next cut needs 4 more acks (ack 5): 4 -> 2.
    assert s.window == 2
    assert s.throttle
    for v in range(6, 9):
        terminal_steps(w, [v])
        w.flush(timeout=10)
    assert w.stats.window == 5  # +1 per unthrottled ack
    assert not w.stats.throttle
    assert w.close() == 8


def test_send_goes_out_after_the_buffered_rows(fake):
    w = writer(fake, max_batch=100)
    terminal_steps(w, [1, 2])
    obs = np.zeros((3, OBS_DIM))
    seq = w.send(nstep_batch(obs, np.zeros(3), np.ones(3), np.full(3, 0.9), obs))
    assert seq == 2
    assert w.close() == 5
    assert [(b.sequence, b.kind, b.count) for b in fake.batches] == [(1, 2, 2), (2, 1, 3)]


def test_policy_version_of_a_batch_is_its_oldest_row(fake):
    w = writer(fake, max_batch=3)
    for v in (5, 3, 4):
        w.append([float(v)] * OBS_DIM, 0, 0.0, True, False, policy_version=v)
    w.close()
    assert [b.policy_version for b in fake.batches] == [3]


def test_close_sends_the_buffer_despite_an_earlier_rejection_then_raises_it(fake):
    fake.reject[1] = ("rewards", "rewards[0] is nan")
    fake.hold()  # the error ack comes only once [3] is buffered
    w = writer(fake, max_batch=2)
    terminal_steps(w, [1, 2])  # batch 1: rejected
    terminal_steps(w, [3])
    fake.release()
    wait_until(lambda: w.stats.acked_batches == 1)
    with pytest.raises(BatchRejected):
        w.close()
    assert [b.count for b in fake.batches] == [2, 1]
    assert w.acked == 1


def test_append_after_close_raises_stream_error(fake):
    w = writer(fake)
    w.close()
    with pytest.raises(StreamError):
        terminal_steps(w, [1])


def test_episode_reports_ride_on_the_next_batch_with_the_env_label(fake):
    w = writer(fake, max_batch=4, env="CartPole-v1")
    terminal_steps(w, [1, 2])
    w.report_episode(1.5, 1, policy_version=3)
    w.report_episode(-2, 7)
    assert w.pending_episodes == 2
    terminal_steps(w, [3, 4])  # fills the buffer: the reports go with it
    (batch,) = fake.wait_batches(1)
    assert batch.count == 4
    assert batch.env == "CartPole-v1"
    assert [(e.episode_return, e.length, e.policy_version) for e in batch.episodes] == [(1.5, 1, 3), (-2, 7, 0)]
    assert w.pending_episodes == 0
    terminal_steps(w, [5])
    assert w.close() == 5
    assert len(fake.batches) == 2 and not fake.batches[1].episodes  # nothing reported twice


def test_episode_reports_without_rows_go_alone_at_flush(fake):
    w = writer(fake, max_batch=4)
    # Sent at once (by size): nothing left to carry the report.
    w.append(np.zeros((4, OBS_DIM)), [0] * 4, [1] * 4, [True] * 4, [False] * 4, policy_version=9)
    fake.wait_batches(1)
    w.report_episode(4.0, 4)  # default version: the latest append's
    assert w.flush(timeout=10) == 4
    batch = fake.batches[1]
    assert batch.count == 0
    assert not any(batch.HasField(c) for c in ("obs", "next_obs", "actions", "rewards", "done", "env_ids"))
    assert batch.env == ""  # no env: the daemon labels it "unnamed"
    assert [(e.episode_return, e.length, e.policy_version) for e in batch.episodes] == [(4.0, 4, 9)]
    assert batch.policy_version == 9
    w.report_episode(5.0, 5, policy_version=2)
    w.close()  # close sends them too
    assert [b.count for b in fake.batches] == [4, 0, 0]
    assert fake.batches[2].episodes[0].episode_return == 5.0


def test_at_most_4096_episode_reports_per_batch(fake):
    w = writer(fake)
    for i in range(4097):
        w.report_episode(i, 1)
    (batch,) = fake.wait_batches(1)  # the 4097th sent the first 4096
    assert len(batch.episodes) == 4096
    w.close()
    assert [len(b.episodes) for b in fake.batches] == [4096, 1]
    assert fake.batches[1].episodes[0].episode_return == 4096


@pytest.mark.parametrize("args,field", [
    ((float("nan"), 3), "episode_return"), ((float("inf"), 3), "episode_return"), ((2e12, 3), "episode_return"),
    ((1.0, 0), "length"), ((1.0, 1_000_000_001), "length"), ((1.0, 3, -1), "policy_version"),
])
def test_bad_episode_reports_raise_naming_the_argument(fake, args, field):
    w = writer(fake)
    with pytest.raises(ValueError, match=field):
        w.report_episode(*args)
    assert w.pending_episodes == 0
    w.close()
    assert fake.batches == []


@pytest.mark.parametrize("env", ["Cart Pole", "x" * 65, "env@host", "é"])
def test_bad_env_label_raises(fake, env):
    with pytest.raises(ValueError, match="env"):
        writer(fake, env=env)


def test_flush_sends_the_full_form_only_when_every_row_has_next_obs(fake):
    w = writer(fake, max_batch=100)
    w.append(np.ones((2, OBS_DIM)), [0, 0], [1, 1], [False, False], [False, False], next_obs=np.full((2, OBS_DIM), 2))
    w.append(np.full((2, OBS_DIM), 2), [0, 0], [1, 1], [False, False], [False, False])  # no next_obs
    w.flush(timeout=10)
    w.append(np.full((2, OBS_DIM), 3), [0, 0], [1, 1], [False, False], [False, False],
             next_obs=np.full((2, OBS_DIM), 4))
    w.close()
    a, b = fake.batches
    assert not a.HasField("next_obs") and not a.HasField("final_obs")  # step-stream: a row had no next_obs
    np.testing.assert_array_equal(col(b, "next_obs")[:, 0], [4, 4])


def test_without_step_stream_every_batch_is_full_and_needs_next_obs(fake):
    w = writer(fake, max_batch=2, step_stream=False)
    with pytest.raises(ValueError, match="next_obs"):
        w.append(np.zeros((2, OBS_DIM)), [0, 0], [1, 1], [False, False], [False, False])
    assert w.buffered == 0
    w.append(np.zeros((2, OBS_DIM)), [0, 0], [1, 1], [False, True], [False, False], next_obs=np.ones((2, OBS_DIM)))
    (b,) = fake.wait_batches(1)  # sent by size, in the full form
    assert not b.HasField("final_obs")
    np.testing.assert_array_equal(col(b, "next_obs"), np.ones((2, OBS_DIM)))
    w.close()


@pytest.mark.parametrize("transport", ["aio", "native"])
def test_abort_while_reconnecting_returns_at_once_and_ends_the_stream_thread(transport):
    """No daemon at the address: the stream sits in its reconnect backoff
    (grown to ~1 s), and abort() cuts it short instead of sleeping it out."""
    if transport == "native":
        require_native()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens
    w = Writer(address, obs_dim=OBS_DIM, num_branches=1, max_delay=None, max_backoff_s=30, transport=transport)
    w.send(nstep_batch(np.ones((1, OBS_DIM)), [0], [1.0], [0.0], np.ones((1, OBS_DIM))))
    wait_until(lambda: w.stats.reconnects >= 3)
    start = time.monotonic()
    w.abort()
    assert time.monotonic() - start < 0.5
    assert not w._stream._reader.is_alive()
