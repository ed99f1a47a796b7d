"""The global sampler: one input order for every topology, read by grain.

The examples of global batch s depend on (train.seed, s, dataset size) alone:

    stream     source.shuffle(seed).repeat()   grain's index shuffle of the whole dataset,
                                               a new permutation each epoch, endless
    batch s    stream[s*B : (s+1)*B]           B = train.global_batch, no example dropped
                                               (an epoch ends inside a batch when B does
                                               not divide the size)
    process p  rows [p*B/P, (p+1)*B/P) of it   its own slice, nothing read twice

So the process count, the device count, data.workers and data.prefetch change how fast the
batches come, never which examples a step sees. Grain does the reading, the shuffle, the
per-example transforms and the workers; this module adds only the index arithmetic of the
process slices (`stream.batch(B/P)[first + p :: P]`). A source that reads many examples at
once (`read_batch(indices)`: in-memory windows, a user's numpy arrays) takes the same order
through `WholeBatchReads`, one grain element per batch of rows instead of one per example.

The position of a run in its input is one number, the examples it consumed (`GlobalBatches
.get_state`), with the dataset's identity (size and a fingerprint of sampled examples) and
the seed: a resume on any process, device or worker count continues with exactly the batches
the uninterrupted run would have seen, and a resume onto other data is caught.
"""

from __future__ import annotations

import functools
import hashlib
import signal
from collections.abc import Sequence
from typing import Any

import grain
import jax
import numpy as np
from jax.experimental import multihost_utils

from paisoar_jax.data.worker_processes import check_main_guard
from paisoar_jax.errors import UserError
from paisoar_jax.parallel.sharding import input_slot

FINGERPRINT_SAMPLES = 16  # examples read (evenly spaced) to tell one dataset from another


def ignore_interrupts(worker_index: int, worker_count: int) -> None:
    """In grain workers: Ctrl-C is for the trainer, which stops them cleanly after saving."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def as_map_dataset(source: Any) -> grain.MapDataset:
    """A grain MapDataset of a random-access source (`__len__` and `__getitem__`)."""
    return source if isinstance(source, grain.MapDataset) else grain.MapDataset.source(source)


def example_stream(source: Any, seed: int, shuffle: bool) -> grain.MapDataset:
    """The endless stream of a source's examples: reshuffled each epoch, or in order."""
    dataset = as_map_dataset(source)
    return (dataset.shuffle(seed=seed % 2**32) if shuffle else dataset).repeat(None)


def dataset_identity(source: Any) -> dict[str, Any]:
    """{"size", "fingerprint"} of a source: its length and a hash of sampled examples.

    A source may name itself with a `fingerprint` attribute (a string); otherwise up to
    FINGERPRINT_SAMPLES evenly spaced examples are read and hashed, so the same data at
    another path matches and changed or resized data does not.
    """
    size = len(source)
    own = getattr(source, "fingerprint", None)
    if isinstance(own, str):
        return {"size": size, "fingerprint": own}
    digest = hashlib.blake2b(digest_size=8)
    for index in sorted({i * size // FINGERPRINT_SAMPLES for i in range(FINGERPRINT_SAMPLES)}):
        for leaf in jax.tree.leaves(source[index]):
            digest.update(leaf if isinstance(leaf, bytes) else np.asarray(leaf).tobytes())
    return {"size": size, "fingerprint": digest.hexdigest()}


def check_same_everywhere(source: Any, name: str) -> None:
    """Refuses processes given different datasets: each reads its own rows of the same one.

    Two processes handed different files or arrays would each train on their rows of their
    own data, silently; their identities (`dataset_identity`) are compared at start.
    """
    if jax.process_count() == 1 or not hasattr(source, "__len__"):
        return
    identity = dataset_identity(source)
    # int32: jax gathers without x64 (a size past 2**31 compares modulo that)
    digest = hashlib.blake2b(identity["fingerprint"].encode(), digest_size=3).digest()
    mine = np.array([identity["size"] % 2**31, int.from_bytes(digest, "little")], np.int32)
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    other = next(
        (p for p, seen in enumerate(everyone) if not np.array_equal(seen, everyone[0])), None
    )
    if other is not None:
        raise UserError(
            f"the processes were given different {name}: process {other}'s has "
            f"{everyone[other][0]} examples (fingerprint {everyone[other][1]:x}), process 0's "
            f"{everyone[0][0]} ({everyone[0][1]:x}); give every process the same dataset "
            f"(each reads its own rows of it)"
        )


class PerExampleReads:
    """The global sampler over a grain stream of examples (any source, per-example maps)."""

    def __init__(self, stream: grain.MapDataset):
        self.stream = stream

    def batches(self, start: int, rows: int, process_index: int, process_count: int):
        """The batches of rows this process reads from example `start` on (a MapDataset)."""
        # Start at a whole batch of rows where the position allows (a per-example slice is
        # one more grain level on every read); else (another global batch since the save)
        # cut the stream itself.
        stream, first = self.stream, start // rows
        if start % rows:
            stream, first = self.stream[start:], 0
        batches = stream.batch(rows, drop_remainder=True)
        return batches[first + process_index :: process_count]


class WholeBatchReads:
    """The global sampler for a source that reads many examples at once (`read_batch`).

    The same order as `example_stream` (grain's `index_shuffle` with the seed plus the
    epoch, as grain's shuffle draws it; tests/data/test_data.py checks the two agree), but grain
    handles one element per batch of rows, not one per example: for in-memory windows the
    per-example bookkeeping of a grain chain costs more than the read itself.
    """

    def __init__(self, source: Any, seed: int, shuffle: bool):
        self.source, self.seed, self.shuffle = source, seed % 2**32, shuffle

    def batches(self, start: int, rows: int, process_index: int, process_count: int):
        """The batches of rows this process reads from example `start` on (a MapDataset)."""
        first, stride = start + process_index * rows, rows * process_count
        read = ReadRows(self.source, self.seed, self.shuffle, first, stride, rows)
        return grain.MapDataset.range(ENDLESS).map(read)


ENDLESS = 2**62  # batches in an endless stream (a grain range needs an end)
# Batches a reader (this process, or each grain worker) reads ahead of the step. Grain's own
# default, 500, counts elements, and ours are whole batches: 500 batches of 256 images is
# 19 GB per worker (the shipped resnet50 config was killed for it on the H200 machine).
READ_AHEAD_BATCHES = 4


class ReadRows(grain.transforms.Map):
    """Batch number j -> the rows of the stream from `first + j * stride`, read at once.

    A module-level class: grain workers receive it pickled.
    """

    def __init__(self, source, seed: int, shuffle: bool, first: int, stride: int, rows: int):
        self.source, self.seed, self.shuffle = source, seed, shuffle
        self.first, self.stride, self.rows = first, stride, rows

    def map(self, batch_number: int) -> Any:
        """The rows of one batch, read at once."""
        start = self.first + batch_number * self.stride
        positions = np.arange(start, start + self.rows)
        return self.source.read_batch(
            stream_indices(positions, len(self.source), self.seed, self.shuffle)
        )


def stream_indices(positions: np.ndarray, size: int, seed: int, shuffle: bool) -> np.ndarray:
    """The source indices at `positions` of its endless stream (`example_stream`'s order).

    Grain's `index_shuffle` with the seed plus the epoch, as grain's shuffle draws it.
    """
    epochs, offsets = np.divmod(np.asarray(positions, dtype=np.int64), size)
    if not shuffle:
        return offsets
    return np.fromiter(
        (
            grain.experimental.index_shuffle(
                int(offset), max_index=size - 1, seed=int((seed + epoch) % 2**32), rounds=4
            )
            for epoch, offset in zip(epochs, offsets, strict=True)
        ),
        dtype=np.int64,
        count=len(offsets),
    )


class GlobalBatches:
    """The rows of a source's global batches that this process reads, from a position on.

    An iterator of per-process batches, read through `reads` (PerExampleReads or
    WholeBatchReads); `get_state()` is the position after the last batch read (the
    examples consumed, the epoch, the dataset's identity and the seed) and `set_state()`
    moves to a saved position, on any topology.
    """

    def __init__(
        self,
        reads: PerExampleReads | WholeBatchReads,
        *,
        source: Any,
        global_batch: int,
        seed: int,
        shuffle: bool = True,
        workers: int = 0,
        in_memory: bool = False,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        # Default: this process's share of the run's mesh (pipeline stages across hosts read
        # the same rows), or its own process slot outside a mesh.
        slot, slots = input_slot()
        self.process_index = slot if process_index is None else process_index
        self.process_count = slots if process_count is None else process_count
        if global_batch % self.process_count:
            raise UserError(
                f"train.global_batch={global_batch} does not split evenly over "
                f"{self.process_count} processes"
            )
        if len(source) == 0:
            raise UserError("the data has no examples")
        check_main_guard(workers)  # before a worker imports a script that would train again
        self.reads, self.source = reads, source
        self.global_batch, self.seed, self.shuffle = global_batch, seed, shuffle
        self.workers, self.in_memory = workers, in_memory
        self.examples = 0
        self._iterator = None

    def _open(self):
        """Grain's iterator over this process's slices, from `self.examples` on."""
        rows = self.global_batch // self.process_count
        mine = self.reads.batches(self.examples, rows, self.process_index, self.process_count)
        # In-memory sources (embedded, synthetic, numpy arrays) read on the prefetch thread
        # alone: grain's pool of reader threads (for files) would only contend for the
        # interpreter lock with the step.
        ahead = 0 if self.in_memory else READ_AHEAD_BATCHES
        read = grain.ReadOptions(num_threads=ahead, prefetch_buffer_size=ahead)
        iterable = mine.to_iter_dataset(read)
        if self.workers > 0:
            iterable = iterable.mp_prefetch(
                grain.MultiprocessingOptions(num_workers=self.workers),
                worker_init_fn=ignore_interrupts,
            )
        return iter(iterable)

    @functools.cached_property
    def identity(self) -> dict[str, Any]:
        """The dataset's size and fingerprint, read once, when first asked for.

        Eval batches are never saved, so they skip the reads.
        """
        return dataset_identity(self.source)

    def __iter__(self) -> GlobalBatches:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = self._open()
        batch = next(self._iterator)
        self.examples += self.global_batch
        if self.workers > 0:
            # Out of the workers' shared memory at once: jax may keep a view of the host
            # array (a CPU device_put does not copy), and a segment still viewed cannot be
            # unlinked when grain drops it, so it leaked (the resource tracker's warning).
            batch = jax.tree.map(np.array, batch)
        return batch

    def get_state(self) -> dict[str, Any]:
        """The position after the last batch read: the same on every process."""
        return {
            "sampler": "global",
            "examples": self.examples,
            "epoch": self.examples // self.identity["size"],
            "seed": self.seed,
            **self.identity,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues after `state["examples"]` examples (the identity is checked by the caller)."""
        self.close()
        self.examples = int(state["examples"])

    def source_indices(self, position: int) -> np.ndarray:
        """The indices in the source of the global batch at stream `position` (its examples)."""
        positions = np.arange(position, position + self.global_batch)
        return stream_indices(positions, len(self.source), self.seed, self.shuffle)

    def close(self) -> None:
        """Stops grain's worker processes, if any."""
        close = getattr(self._iterator, "close", None)
        if close is not None:
            close()
        self._iterator = None


def batch_dataset(
    source: Any,
    *,
    global_batch: int,
    seed: int,
    shuffle: bool = True,
    workers: int = 0,
    process_index: int | None = None,
    process_count: int | None = None,
    in_memory: bool = False,
    stream: grain.MapDataset | None = None,
) -> GlobalBatches:
    """The slices of a source's global batches that this process reads (see above).

    `stream`: the source's example stream with per-example transforms already mapped on
    (images: decode, crop, flip); by default the plain `example_stream`, or for a source
    with `read_batch` one read per batch of rows.
    """
    if stream is not None:
        reads = PerExampleReads(stream)
    elif hasattr(source, "read_batch"):  # in-memory windows and arrays: a read per batch
        reads = WholeBatchReads(source, seed, shuffle)
    else:
        reads = PerExampleReads(example_stream(source, seed, shuffle))
    return GlobalBatches(
        reads,
        source=source,
        global_batch=global_batch,
        seed=seed,
        shuffle=shuffle,
        workers=workers,
        in_memory=in_memory,
        process_index=process_index,
        process_count=process_count,
    )


def saved_identity(saved: dict[str, Any]) -> dict[str, Any]:
    """{"size", "fingerprint"} of a saved position or a mixture's saved source.

    As `dataset_identity` gives them, to compare with the data a resume reads.
    """
    return {key: saved.get(key) for key in ("size", "fingerprint")}


def changed_data(change: str, on_change: str, instead: str = "resume on the same data") -> str:
    """The line to print for data that changed since a checkpoint, under data.on_change.

    Refused in one line (UserError) unless `on_change` is "restart": the new data then
    starts from its first example.
    """
    if on_change != "restart":
        raise UserError(
            f"{change}: {instead}, or set data.on_change=restart to train on the new data "
            f"from its first example"
        )
    return f"{change}: data.on_change=restart, so the new data starts from its start"


def resume_position(
    saved: dict[str, Any] | None,
    batches: GlobalBatches,
    step: int,
    saved_batch: int,
    on_change: str,
) -> tuple[int, str | None]:
    """(examples to skip, a line to print or None) for a run resumed after `step`.

    `saved`: the position in the checkpoint (None for one written before the global
    sampler: its step times `saved_batch` examples are taken as consumed; a mixture's: the
    source of the same identity goes on). A dataset whose size or fingerprint changed is
    refused, unless `on_change` is "restart".
    """
    if saved is not None and saved.get("sampler") == "mixture":
        for name, identity in saved["sources"].items():
            if saved_identity(identity) == batches.identity:
                examples = int(saved["positions"][name])
                return examples, (
                    f"checkpoint step {step} read a mixture; data.source is its {name}, "
                    f"which goes on from example {examples}"
                )
        change = (
            f"checkpoint step {step} read a mixture ({', '.join(saved['sources'])}), and "
            f"data.source is none of its sources"
        )
        return 0, changed_data(change, on_change, "resume with that data.mixture")
    if saved is None or saved.get("sampler") != "global":
        return step * saved_batch, (
            f"checkpoint step {step} holds a per-process input position (written before the "
            f"global sampler), which cannot be continued exactly: the input goes on from "
            f"example {step * saved_batch} of the global order"
        )
    old = saved_identity(saved)
    if old != batches.identity:
        change = (
            f"checkpoint step {step} was trained on data of {old['size']} examples "
            f"(fingerprint {old['fingerprint']}); the data now has "
            f"{batches.identity['size']} (fingerprint {batches.identity['fingerprint']})"
        )
        return 0, changed_data(change, on_change)
    if saved.get("seed") != batches.seed:
        return int(saved["examples"]), (
            f"train.seed changed since checkpoint step {step} ({saved.get('seed')} -> "
            f"{batches.seed}): the input goes on at example {saved['examples']} in the new "
            f"seed's order"
        )
    return int(saved["examples"]), None


def check_splits(task: Any, train_source: Any, eval_sets: Sequence[Any], batch: int) -> None:
    """Train holds a global batch, each eval set an example; every process has the same data.

    (Sources of known length; ready batches are the user's own per process. `eval_sets`:
    evaluation.EvalSets; one never evaluated is not checked. `batch`: train.global_batch.)
    """
    splits = [("train", train_source)]
    splits += [(f"eval {one.name}".strip(), one.source) for one in eval_sets if one.every]
    for split, source in splits:
        check_same_everywhere(source, f"{split} data")
        size = len(source) if hasattr(source, "__len__") else None
        if size == 0:
            raise UserError(f"the {split} split has no {task.unit_of_data}")
        if split == "train" and size is not None and size < batch:
            raise UserError(
                f"the train split has {size} {task.unit_of_data}, fewer than one global batch "
                f"(train.global_batch={batch}): each step would repeat some of them; set "
                f"train.global_batch to {size} or less"
            )
