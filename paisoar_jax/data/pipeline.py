"""The grain pipeline: shard by process, shuffle by seed (reshuffled each epoch), batch.

Each process reads only its own slice of the windows (process i takes windows i, i + n,
...), shuffles it with the run's seed, repeats it forever with a new order per epoch and
batches it to the per-process batch. Workers (data.workers > 0) read ahead in separate
processes. The iterator's get_state()/set_state() resume it exactly.
"""

from __future__ import annotations

import signal

import grain
import jax

from paisoar_jax.errors import UserError


def ignore_interrupts(worker_index: int, worker_count: int) -> None:
    """In grain workers: Ctrl-C is for the trainer, which stops them cleanly after saving."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def batch_dataset(
    source,
    *,
    batch_per_process: int,
    seed: int,
    shuffle: bool = True,
    workers: int = 0,
    process_index: int | None = None,
    process_count: int | None = None,
    in_memory: bool = False,
) -> grain.IterDataset:
    """An endless iterable of (batch_per_process, seq_len + 1) int32 token batches.

    `in_memory`: the source reads from memory (embedded, synthetic, numpy arrays), so the
    main-process pipeline reads on the prefetch thread alone; grain's default pool of
    reader threads (for files) would only contend for the interpreter lock with the step.
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if not isinstance(source, grain.MapDataset):
        source = grain.MapDataset.source(source)
    dataset = source[process_index::process_count]
    if len(dataset) == 0:
        raise UserError(
            f"the data has {len(source)} windows: too few for process {process_index} of "
            f"{process_count} to get one (use more data or a shorter model.seq_len)"
        )
    if shuffle:
        dataset = dataset.shuffle(seed=seed)
    dataset = dataset.repeat(None).batch(batch_per_process, drop_remainder=True)
    read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0) if in_memory else None
    iterable = dataset.to_iter_dataset(read)
    if workers > 0:
        iterable = iterable.mp_prefetch(
            grain.MultiprocessingOptions(num_workers=workers), worker_init_fn=ignore_interrupts
        )
    return iterable
