"""The grain pipeline: shard by process, shuffle by seed (reshuffled each epoch), batch.

Each process reads only its own slice of the windows (process i takes windows i, i + n,
...), shuffles it with the run's seed, repeats it forever with a new order per epoch and
batches it to the per-process batch. Workers (data.workers > 0) read ahead in separate
processes. The iterator's get_state()/set_state() resume it exactly.
"""

from __future__ import annotations

import grain
import jax


def batch_dataset(
    source,
    *,
    batch_per_process: int,
    seed: int,
    shuffle: bool = True,
    workers: int = 0,
    process_index: int | None = None,
    process_count: int | None = None,
) -> grain.IterDataset:
    """An endless iterable of (batch_per_process, seq_len + 1) int32 token batches."""
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    dataset = grain.MapDataset.source(source)[process_index::process_count]
    if shuffle:
        dataset = dataset.shuffle(seed=seed)
    dataset = dataset.repeat(None).batch(batch_per_process, drop_remainder=True)
    iterable = dataset.to_iter_dataset()
    if workers > 0:
        iterable = iterable.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return iterable
