"""A user's data: each kind fit accepts becomes per-process batches of the right shape."""

import grain
import numpy as np
import pytest

from paisoar_jax.data.user_data import BatchData, ExampleData, open_user_data
from paisoar_jax.errors import UserError

ARRAYS = {"x": np.arange(40, dtype=np.float32).reshape(20, 2), "y": np.arange(20, dtype=np.int64)}


class RandomAccess:
    """A source with __len__ and __getitem__, like grain's ArrayRecordDataSource."""

    def __len__(self):
        return 20

    def __getitem__(self, index):
        return {"x": ARRAYS["x"][index], "y": ARRAYS["y"][index]}


class Reiterable:
    """Batches from an object with __iter__, as a hand-written loader would give them."""

    def __iter__(self):
        for start in range(0, 20, 4):
            yield {"x": ARRAYS["x"][start : start + 4], "y": ARRAYS["y"][start : start + 4]}


@pytest.mark.parametrize(
    "data",
    [ARRAYS, grain.MapDataset.source(RandomAccess()), RandomAccess()],
    ids=["arrays", "map-dataset", "random-access"],
)
def test_examples_are_shuffled_and_batched_and_resume(data):
    source = open_user_data(data, "data")
    assert isinstance(source, ExampleData) and len(source) == 20
    spec = source.batch_spec(8)
    assert spec["x"].shape == (8, 2) and spec["y"].dtype == np.int32  # int64 -> device int32
    iterator = iter(source.batches(4, seed=0, shuffle=True, workers=0))
    first = [next(iterator) for _ in range(3)]
    state = iterator.get_state()
    following = [next(iterator) for _ in range(6)]  # across the epoch boundary
    seen = np.concatenate([batch["y"] for batch in first + following[:2]])
    assert sorted(seen) == list(range(20))  # one epoch holds every example once
    resumed = iter(source.batches(4, seed=0, shuffle=True, workers=0))
    resumed.set_state(state)
    for want in following:
        np.testing.assert_array_equal(next(resumed)["x"], want["x"])


@pytest.mark.parametrize("kind", ["list", "reiterable", "iter-dataset"])
def test_batches_repeat_each_epoch(kind):
    batches = list(Reiterable())
    data = {
        "list": batches,
        "reiterable": Reiterable(),
        "iter-dataset": grain.MapDataset.source(batches).to_iter_dataset(),
    }[kind]
    source = open_user_data(data, "data")
    assert isinstance(source, BatchData)
    assert source.batch_spec(4)["x"].shape == (4, 2)
    iterator = source.batches(4, seed=0, shuffle=True, workers=0)
    taken = [next(iterator)["y"][0] for _ in range(7)]
    assert taken == [0, 4, 8, 12, 16, 0, 4]  # five batches an epoch, then again
    assert hasattr(iterator, "get_state") == (kind == "iter-dataset")
    if kind == "iter-dataset":
        state = iterator.get_state()
        again = source.batches(4, seed=0, shuffle=True, workers=0)
        again.set_state(state)
        assert [next(again)["y"][0] for _ in range(4)] == [8, 12, 16, 0]


def test_bad_data_is_one_clear_line():
    with pytest.raises(UserError, match="one-shot iterator"):
        open_user_data(iter(Reiterable()), "data")
    with pytest.raises(UserError, match="differ in length"):
        open_user_data({"x": np.zeros((3, 2)), "y": np.zeros(4)}, "data")
    with pytest.raises(UserError, match="must be a grain dataset"):
        open_user_data(42, "data")
    with pytest.raises(UserError, match="set train.global_batch=4"):
        open_user_data(list(Reiterable()), "data").batch_spec(16)
    ragged = list(Reiterable()) + [{"x": np.zeros((3, 2)), "y": np.zeros(3)}]
    iterator = open_user_data(ragged, "data").batches(4, seed=0, shuffle=False, workers=0)
    with pytest.raises(UserError, match="batch 6 of epoch 0 has 3 rows, not 4"):
        [next(iterator) for _ in range(6)]
