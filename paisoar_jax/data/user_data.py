"""A user's own data, as `paisoar_jax.fit(data=...)` takes it: examples or ready batches.

Two kinds, told apart by type:

    examples   a grain MapDataset, any random-access source (`__len__` + `__getitem__`,
               e.g. grain's ArrayRecordDataSource), a numpy array, or a dict or tuple
               of equally long numpy arrays (rows are examples; `(x, y)` as in Keras:
               the loss then gets an (x, y) tuple of batch arrays). They go through the
               global sampler (`pipeline`): the whole dataset shuffled by the run's seed,
               anew each epoch, cut into `train.global_batch` examples per step, each
               process reading its own rows; the same order on any topology.
    batches    a grain IterDataset or any re-iterable (a list, an object with __iter__, a
               tuple of dicts) of
               per-process batches: an array or a dict of arrays, each with
               global_batch / readers rows, where `paisoar_jax.input_slot()` gives
               (this process's slot, readers): one slot per process, except that the
               processes of one pipeline position (mesh.dcn_stage) share a slot and must
               yield the same rows. Re-iterated once it ends.

Resume: examples keep their exact place on any topology (the position is the examples
consumed); a grain IterDataset keeps its place on the same process count (grain's
per-process iterator state goes into checkpoints); a plain iterable has no position to
save, so a resumed run says in one line that its input restarts.
"""

from __future__ import annotations

import collections.abc
import pathlib
from collections.abc import Iterator
from typing import Any

import grain
import jax
import numpy as np

from paisoar_jax.data.pipeline import batch_dataset
from paisoar_jax.errors import UserError
from paisoar_jax.parallel.sharding import input_slot


class ExampleData:
    """Random-access examples: sampled into global batches, each process reading its rows."""

    kind = "examples"

    def __init__(self, source: Any, name: str):
        self.source = source
        self.name = name
        if len(source) == 0:
            raise UserError(f"{name} has no examples")
        first = source[0]
        self.example_spec = jax.tree.map(lambda x: (np.shape(x), _dtype(x)), first)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Any:
        return self.source[index]

    def batches(self, global_batch: int, seed: int, shuffle: bool, workers: int):
        """The rows of endless global batches this process reads (get_state/set_state).

        A source with an `example_stream(seed, shuffle)` (`source_examples`' images) gives
        its own endless stream: per-epoch augmentation drawn from the stream's positions.
        """
        own_stream = getattr(self.source, "example_stream", None)
        return batch_dataset(
            self.source,
            global_batch=global_batch,
            seed=seed,
            shuffle=shuffle,
            workers=workers,
            in_memory=isinstance(self.source, _Rows),  # numpy arrays; other sources may be files
            stream=own_stream(seed, shuffle) if own_stream else None,
        )

    def batch_spec(self, global_batch: int) -> Any:
        """The shape and dtype of one global batch."""
        return jax.tree.map(
            lambda spec: jax.ShapeDtypeStruct((global_batch, *spec[0]), spec[1]),
            self.example_spec,
            is_leaf=_is_spec,
        )


class BatchData:
    """Ready per-process batches from a re-iterable (a grain IterDataset or any iterable)."""

    kind = "batches"

    def __init__(self, source: Any, name: str):
        if iter(source) is source:
            raise UserError(
                f"{name} is a one-shot iterator (a generator?): give something that can be "
                f"iterated again each epoch (a list, a grain dataset, a class with __iter__)"
            )
        self.source = source
        self.name = name
        first = next(iter(source), None)
        if first is None:
            raise UserError(f"{name} yields no batches")
        self.rows = _rows(first, name)
        self.batch_leaf_specs = jax.tree.map(lambda x: (np.shape(x)[1:], _dtype(x)), first)

    def batches(self, global_batch: int, seed: int, shuffle: bool, workers: int):
        """Endless re-iteration of the source, each batch checked for its row count."""
        del seed, shuffle, workers  # the user's own pipeline decides its order and workers
        rows = global_batch // input_slot()[1]  # the processes that read distinct rows
        if isinstance(self.source, grain.IterDataset):
            return _ResumableBatches(self.source, rows, self.name)
        return _Batches(self.source, rows, self.name)

    def one_pass(self, global_batch: int) -> Iterator:
        """The source's batches once (an eval reads each batch once), rows checked."""
        rows = global_batch // input_slot()[1]
        for index, batch in enumerate(self.source, 1):
            yield _checked(batch, rows, self.name, index, epoch=0)

    def batch_spec(self, global_batch: int) -> Any:
        """The shape and dtype of one global batch; UserError when the rows do not add up."""
        processes = input_slot()[1]
        if self.rows * processes != global_batch:
            raise UserError(
                f"{self.name} gives batches of {self.rows} rows per process ({self.rows} x "
                f"{processes} processes that read distinct rows = {self.rows * processes}), "
                f"but train.global_batch={global_batch}: set train.global_batch="
                f"{self.rows * processes}"
            )
        return jax.tree.map(
            lambda spec: jax.ShapeDtypeStruct((global_batch, *spec[0]), spec[1]),
            self.batch_leaf_specs,
            is_leaf=_is_spec,
        )


class _Batches:
    """Iterates a re-iterable forever, one pass per epoch; no position to save."""

    def __init__(self, source: Any, rows: int, name: str):
        self.source, self.rows, self.name = source, rows, name
        self.epoch, self.index = 0, 0
        self.iterator = iter(source)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            batch = next(self.iterator)
        except StopIteration:
            self.epoch, self.index = self.epoch + 1, 0
            self.iterator = iter(self.source)
            batch = next(self.iterator)
        self.index += 1
        return _checked(batch, self.rows, self.name, self.index, self.epoch)


class _ResumableBatches(_Batches):
    """A grain IterDataset's batches: its iterator state and the epoch make the position."""

    def get_state(self) -> dict[str, Any]:
        """The position: the epoch and grain's state within it."""
        return {"epoch": self.epoch, "index": self.index, "inner": self.iterator.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from a saved position."""
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.iterator = iter(self.source)
        self.iterator.set_state(state["inner"])


class _Rows(collections.abc.Sequence):
    """An array, or a dict or tuple of equally long arrays, as a sequence of rows (examples)."""

    def __init__(self, arrays: Any, name: str):
        lengths = {len(array) for array in jax.tree.leaves(arrays)}
        if len(lengths) != 1:
            raise UserError(f"{name}: its arrays differ in length ({sorted(lengths)})")
        self.arrays, self.length = arrays, lengths.pop()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        return jax.tree.map(lambda array: array[index], self.arrays)

    def read_batch(self, indices: np.ndarray):
        """The rows at `indices`, stacked (one gather per array)."""
        return jax.tree.map(lambda array: array[indices], self.arrays)


def _checked(batch: Any, rows: int, name: str, index: int, epoch: int) -> Any:
    """`batch` itself, once it holds `rows` rows; else UserError naming it."""
    if _rows(batch, name) != rows:
        raise UserError(
            f"{name}: batch {index} of epoch {epoch} has {_rows(batch, name)} rows, not "
            f"{rows} (drop an incomplete last batch)"
        )
    return batch


def _dtype(x: Any) -> np.dtype:
    """The dtype an array of `x` has on the device (int64 is int32 unless x64 is on)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.asarray(x).dtype))


def _is_spec(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], np.dtype)


def _rows(batch: Any, name: str) -> int:
    """The leading dimension shared by every array of a batch."""
    leaves = jax.tree.leaves(batch)
    rows = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
    if not leaves or None in rows or len(rows) != 1:
        raise UserError(
            f"{name}: a batch must be an array or a dict of arrays with one leading batch "
            f"dimension, got {jax.tree.map(np.shape, batch)}"
        )
    return rows.pop()


def open_user_data(data: Any, name: str) -> ExampleData | BatchData:
    """Sorts `data` into examples or batches (see the module docstring)."""
    if isinstance(data, str | bytes | pathlib.PurePath):  # a path is not data (a str indexes)
        raise UserError(
            f"{name} must be a grain dataset, a numpy array or dict of arrays, a random-access "
            f"source or a re-iterable of batches, not a {type(data).__name__} ({str(data)[:60]!r}"
            f"): read the files into one of those first"
        )
    if isinstance(data, grain.MapDataset):
        return ExampleData(data, name)
    arrays = np.ndarray | jax.Array
    values = data.values() if isinstance(data, dict) else data if isinstance(data, tuple) else ()
    if isinstance(data, arrays) or (values and all(isinstance(v, arrays) for v in values)):
        return ExampleData(_Rows(jax.tree.map(np.asarray, data), name), name)
    if isinstance(data, grain.IterDataset) or (
        isinstance(data, collections.abc.Iterable) and isinstance(data, list | tuple)
    ):
        return BatchData(data, name)
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return ExampleData(data, name)
    if isinstance(data, collections.abc.Iterable):
        return BatchData(data, name)
    raise UserError(
        f"{name} must be a grain dataset, a numpy array or dict of arrays, a random-access "
        f"source or a re-iterable of batches; got {type(data).__name__}"
    )
