"""The wire form of TransitionBatch columns, no daemon: step_batch and
nstep_batch fill every Tensor with the right dtype, shape and raw bytes, and
the Writer's direct encoding (StepColumns) is the same message."""

import numpy as np
import pytest

from qstream import nstep_batch, step_batch
from qstream.batch import F32, I32, U32, StepColumns, Tensor, TransitionBatch, step_message, to_numpy
from qstream.stream import serialize


def arrays(rng, n, obs_dim=5, branches=3):
    return dict(
        obs=rng.normal(size=(n, obs_dim)).astype(np.float32),
        next_obs=rng.normal(size=(n, obs_dim)).astype(np.float32),
        actions=rng.integers(0, 4, size=(n, branches)).astype(np.int32),
        rewards=rng.normal(size=n).astype(np.float32),
        done=rng.random(n) < 0.3,
        truncated=rng.random(n) < 0.1,
        env_ids=rng.integers(0, 7, size=n).astype(np.uint32),
    )


def assert_tensor(t, dtype, array):
    assert t.dtype == dtype
    assert list(t.shape) == list(array.shape)
    assert t.data == np.ascontiguousarray(array).tobytes()
    np.testing.assert_array_equal(to_numpy(t), array)


def test_step_batch_columns_have_wire_dtypes_shapes_and_bytes():
    a = arrays(np.random.default_rng(0), 6)
    b = TransitionBatch.FromString(step_batch(**a, policy_version=9).SerializeToString())
    assert b.kind == TransitionBatch.KIND_STEP and b.count == 6 and b.policy_version == 9
    assert_tensor(b.obs, Tensor.DTYPE_FLOAT32, a["obs"])
    assert_tensor(b.next_obs, Tensor.DTYPE_FLOAT32, a["next_obs"])
    assert_tensor(b.actions, Tensor.DTYPE_INT32, a["actions"])
    assert_tensor(b.rewards, Tensor.DTYPE_FLOAT32, a["rewards"])
    assert_tensor(b.done, Tensor.DTYPE_BOOL, a["done"])
    assert_tensor(b.truncated, Tensor.DTYPE_BOOL, a["truncated"])
    assert_tensor(b.env_ids, Tensor.DTYPE_UINT32, a["env_ids"])
    assert not b.HasField("discounts")
    assert set(b.done.data) <= {0, 1}  # one byte per flag


def test_step_batch_converts_inputs_and_leaves_optional_columns_unset():
    b = step_batch(obs=[[1, 2], [3, 4]], actions=[1, 0], rewards=[0.5, 1], next_obs=[[2, 3], [4, 5]],
                   done=[0, 1])
    assert_tensor(b.obs, Tensor.DTYPE_FLOAT32, np.array([[1, 2], [3, 4]], np.float32))
    # One branch: actions are still 2-D, [count, 1].
    assert_tensor(b.actions, Tensor.DTYPE_INT32, np.array([[1], [0]], np.int32))
    assert_tensor(b.done, Tensor.DTYPE_BOOL, np.array([False, True]))
    assert not b.HasField("truncated") and not b.HasField("env_ids")


def test_nstep_batch_columns():
    rng = np.random.default_rng(1)
    obs = rng.normal(size=(4, 3))
    b = nstep_batch(obs, rng.integers(0, 2, size=(4, 2)), np.arange(4), np.full(4, 0.9), obs + 1)
    assert b.kind == TransitionBatch.KIND_NSTEP and b.count == 4
    assert_tensor(b.obs, Tensor.DTYPE_FLOAT32, obs.astype(np.float32))
    assert_tensor(b.next_obs, Tensor.DTYPE_FLOAT32, (obs + 1).astype(np.float32))
    assert_tensor(b.rewards, Tensor.DTYPE_FLOAT32, np.arange(4, dtype=np.float32))
    assert_tensor(b.discounts, Tensor.DTYPE_FLOAT32, np.full(4, 0.9, np.float32))
    assert list(b.actions.shape) == [4, 2]
    for name in ("done", "truncated", "env_ids"):
        assert not b.HasField(name)


@pytest.mark.parametrize("n", [1, 3, 1024])  # 1024 rows: multi-byte length varints
@pytest.mark.parametrize("form", ["step_stream", "full"])
def test_step_columns_encode_the_same_message_as_step_message(n, form):
    a = arrays(np.random.default_rng(n), n, obs_dim=48, branches=4)
    a["truncated"] &= ~a["done"]
    want = step_message(a["obs"], a["next_obs"], a["actions"], a["rewards"], a["done"], a["truncated"],
                        a["env_ids"], policy_version=3)
    want.sequence, want.stream_id = 17, "py-test"
    cols = (a["obs"], a["actions"], a["rewards"], a["done"], a["truncated"], a["env_ids"])
    if form == "full":
        columns = StepColumns(48, 4).encode(*cols, next_obs=a["next_obs"])
    else:
        final = a["next_obs"][a["done"] | a["truncated"]]
        want.ClearField("next_obs")
        if final.shape[0]:
            want.final_obs.dtype = Tensor.DTYPE_FLOAT32
            want.final_obs.shape[:] = final.shape
            want.final_obs.data = final.tobytes()
        columns = StepColumns(48, 4).encode(*cols, final_obs=final)
    head = TransitionBatch(kind=TransitionBatch.KIND_STEP, count=n, policy_version=3, sequence=17,
                           stream_id="py-test")
    wire = serialize(head, columns)
    assert TransitionBatch.FromString(wire) == want
    assert len(wire) == want.ByteSize()


def test_step_columns_cache_prefixes_per_count():
    enc = StepColumns(2, 1)
    for n in (1, 2, 1, 2):
        cols = (np.zeros((n, 2), F32), np.zeros((n, 1), I32), np.zeros(n, F32), np.ones(n, bool), np.zeros(n, bool),
                np.arange(n, dtype=U32))
        b = TransitionBatch.FromString(b"".join(enc.encode(*cols, final_obs=np.full((n, 2), n, F32))))
        assert b.count == 0 and list(b.obs.shape) == [n, 2]  # count is the head's, not the columns'
        np.testing.assert_array_equal(to_numpy(b.env_ids), np.arange(n))
        np.testing.assert_array_equal(to_numpy(b.final_obs), np.full((n, 2), n))
