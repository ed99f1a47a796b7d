"""Device prefetch: host batches become global jax.Arrays, a few in flight ahead of the step.

A background thread pulls per-process numpy batches, assembles each into one global array
sharded over the batch axes (`jax.make_array_from_process_local_data`, which works across
processes) and queues it, so the training loop only waits when input is truly behind.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding

_DONE = object()


class DevicePrefetcher:
    """Iterates global device arrays built from a host iterator, `depth` batches ahead."""

    def __init__(self, host_batches: Iterator[np.ndarray], sharding: NamedSharding, depth: int):
        self._host_batches = host_batches
        self._sharding = sharding
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="device-prefetch", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        """Producer: host batch -> global array -> queue, until stopped or exhausted."""
        try:
            for host_batch in self._host_batches:
                array = jax.make_array_from_process_local_data(self._sharding, host_batch)
                while not self._stop.is_set():
                    try:
                        self._queue.put(array, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(_DONE)
        except BaseException as error:  # re-raised in the consumer's thread
            self._queue.put(error)

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> jax.Array:
        item = self._queue.get()
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stops the producer thread (batches already queued are dropped)."""
        self._stop.set()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._thread.join(timeout=5)
