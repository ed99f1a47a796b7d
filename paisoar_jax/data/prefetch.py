"""Device prefetch: host batches become global jax.Arrays, a few in flight ahead of the step.

A background thread pulls per-process numpy batches (an array, or a dict of arrays such as
images and labels), assembles each into global arrays sharded over the batch axes
(`jax.make_array_from_process_local_data`, which works across processes) and queues it, so
the training loop only waits when input is truly behind.

The host iterator runs ahead of the step by up to `depth` batches, so its own get_state()
is not where a resumed run must start: each queued batch carries the iterator state taken
right after it was read, and `consumed_state()` returns the one of the last batch handed out.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding

_DONE = object()


def global_batch(sharding: NamedSharding, host_batch):
    """One process's batch (an array or a dict of arrays) -> global arrays split by `sharding`."""
    return jax.tree.map(
        lambda rows: jax.make_array_from_process_local_data(sharding, rows), host_batch
    )


class DevicePrefetcher:
    """Iterates global device arrays built from a host iterator, `depth` batches ahead."""

    def __init__(self, host_batches: Iterator[np.ndarray], sharding: NamedSharding, depth: int):
        self._host_batches = host_batches
        self._sharding = sharding
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        get_state = getattr(host_batches, "get_state", None)
        self._consumed_state = get_state() if get_state else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="device-prefetch", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        """Producer: host batch -> global array -> queue, until stopped or exhausted."""
        get_state = getattr(self._host_batches, "get_state", None)
        try:
            for host_batch in self._host_batches:
                array = global_batch(self._sharding, host_batch)
                if not self._put((array, get_state() if get_state else None)):
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
        array, self._consumed_state = item
        return array

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
