"""Device prefetch: host batches become global jax.Arrays, a few in flight ahead of the step.

A background thread pulls per-process numpy batches (an array, or a dict of arrays such as
images and labels), assembles each into global arrays sharded over the batch axes
(`jax.make_array_from_process_local_data`, which works across processes) and queues it, so
the training loop only waits when input is truly behind.

The host iterator runs ahead of the step by up to `depth` batches, so its own get_state()
is not where a resumed run must start: each queued batch carries the iterator state taken
right after it was read, and `consumed_state()` returns the one of the last batch handed out.

With `check_finite` the thread also looks for nan and inf in each batch's floating arrays (a
pass over the host copy, off the step's path): `first_nonfinite` is the first such batch
handed out, so a loss that turns non-finite can be blamed on the data, not the learning rate.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

_DONE = object()


def global_batch(sharding: NamedSharding, host_batch):
    """One process's batch (an array or a dict of arrays) -> global arrays split by `sharding`."""
    return jax.tree.map(
        lambda rows: jax.make_array_from_process_local_data(sharding, rows), host_batch
    )


def nonfinite_values(host_batch: Any) -> str | None:
    """What the floating arrays of a batch hold that is not finite (`batch['x']: 3 nan`)."""
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(host_batch):
        values = np.asarray(leaf)
        if not jnp.issubdtype(values.dtype, jnp.floating) or np.isfinite(values).all():
            continue
        nan = int(np.isnan(values).sum())
        inf = int(np.isinf(values).sum())
        counts = ", ".join(f"{n} {kind}" for n, kind in ((nan, "nan"), (inf, "inf")) if n)
        found.append(f"batch{jax.tree_util.keystr(path)}: {counts}")
    return "; ".join(found) or None


class DevicePrefetcher:
    """Iterates global device arrays built from a host iterator, `depth` batches ahead."""

    def __init__(
        self,
        host_batches: Iterator[np.ndarray],
        sharding: NamedSharding,
        depth: int,
        check_finite: bool = False,
    ):
        self._host_batches = host_batches
        self._check_finite = check_finite
        self._sharding = sharding
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        get_state = getattr(host_batches, "get_state", None)
        self._consumed_state = get_state() if get_state else None
        self.handed_out = 0  # batches handed out so far
        # (its number among those handed out, from 1; what it holds) of the first batch
        # with nan or inf, or None
        self.first_nonfinite: tuple[int, str] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="device-prefetch", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        """Producer: host batch -> global array -> queue, until stopped or exhausted."""
        get_state = getattr(self._host_batches, "get_state", None)
        try:
            for host_batch in self._host_batches:
                array = global_batch(self._sharding, host_batch)
                state = get_state() if get_state else None
                nonfinite = nonfinite_values(host_batch) if self._check_finite else None
                if not self._put((array, state, nonfinite)):
                    return
            self._put(_DONE)
        except BaseException as error:  # re-raised in the consumer's thread
            self._put(error)

    def _put(self, item: object) -> bool:
        """Queues `item` unless stopped first; never blocks past close()."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self):
        item = self._queue.get()
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        array, self._consumed_state, nonfinite = item
        self.handed_out += 1
        if nonfinite and self.first_nonfinite is None:
            self.first_nonfinite = (self.handed_out, nonfinite)
        return array

    def examples_of(self, batches_back: int) -> list[int] | None:
        """The source indices of the examples of a batch handed out; None when unknown.

        `batches_back`: how many batches before the last one handed out (0: the last). None
        when the input cannot say (ready batches, a mixture).
        """
        state = self._consumed_state or {}
        indices = getattr(self._host_batches, "source_indices", None)
        if indices is None or "examples" not in state:
            return None
        position = state["examples"] - (batches_back + 1) * self._host_batches.global_batch
        return [int(index) for index in indices(position)] if position >= 0 else None

    def consumed_state(self) -> dict | None:
        """The host iterator's state right after the last batch handed out (for checkpoints)."""
        return self._consumed_state

    def close(self) -> None:
        """Stops the producer thread, drops queued batches and closes the host iterator."""
        self._stop.set()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._thread.join(timeout=5)
        close_host = getattr(self._host_batches, "close", None)
        if close_host is not None and not self._thread.is_alive():
            close_host()  # grain's worker processes and their shared memory
