"""A full disk under the run directory: one line, no partial save left, nothing else lost.

Before each save, `check_room` compares the free space with the bytes the save writes
(the train state's, uncompressed) and stops the run with a UserError: exit status 2, never
retried by `launch --max-restarts` (it would fail again). The line names the directory,
the bytes needed and free, and the newest complete checkpoint, which a rerun resumes from
once there is room.

A disk that fills during a save anyway (another writer) surfaces later, as Orbax's
RESOURCE_EXHAUSTED ValueError (OCDBT) or an OSError (ENOSPC): `guard` turns it, wherever
in the run it is raised, into the same line, removing the failed save (Orbax leaves it
under a temporary name) and silencing the background threads' log records of it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import pathlib
import shutil
from collections.abc import Callable, Iterator

from paisoar_jax.errors import UserError
from paisoar_jax.runtime import heartbeat

SIGNS = ("No space left on device", "os_error_code='28'")


def caused_by(error: BaseException | None) -> bool:
    """Whether `error`, or one it was raised from or during, is a full disk."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if any(sign in str(error) for sign in SIGNS):
            return True
        error = error.__cause__ or error.__context__
    return False


class _QuietAboutIt(logging.Filter):
    """Drops the background threads' log records of the full disk (guard says it once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        return not any(sign in text for sign in SIGNS)


@contextlib.contextmanager
def guard(
    run_dir: pathlib.Path, checkpoint_dir: pathlib.Path | None, save_bytes: Callable[[], int]
) -> Iterator[None]:
    """Runs the body; a full disk raised in it becomes the one-line UserError.

    `save_bytes()`: what one save writes (the train state's bytes), asked only then.
    """
    quiet = _QuietAboutIt()
    loggers = [logging.getLogger(), logging.getLogger("absl")]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    except Exception as error:
        if not caused_by(error):
            raise
        raise UserError(_describe(run_dir, checkpoint_dir, save_bytes())) from None
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def check_room(run_dir: pathlib.Path, checkpoint_dir: pathlib.Path, estimate_bytes: int) -> None:
    """Before a save: the one line, if the disk has less room than the save needs.

    What a save needs is what the newest complete one took, else `estimate_bytes` (the
    state's bytes, uncompressed). Caught here, the save never starts: no partial files, no
    background tracebacks. Every process must agree (one that stops alone would leave the
    others in a collective).
    """
    newest = heartbeat.newest_checkpoint(str(checkpoint_dir))
    need_bytes = _bytes_under(checkpoint_dir / str(newest)) if newest is not None else 0
    need_bytes = need_bytes or estimate_bytes
    free = shutil.disk_usage(checkpoint_dir if checkpoint_dir.exists() else run_dir).free
    short = free < need_bytes
    import jax

    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        short = bool(np.any(multihost_utils.process_allgather(np.array(short))))
    if short:
        raise UserError(_describe(run_dir, checkpoint_dir, need_bytes))


def _bytes_under(directory: pathlib.Path) -> int:
    """The bytes of the files under a directory (a checkpoint: a few dozen files)."""
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _describe(run_dir: pathlib.Path, checkpoint_dir: pathlib.Path | None, save_bytes: int) -> str:
    """Removes the partial save; the line naming the directory, the sizes and what is kept."""
    if checkpoint_dir is None:
        return f"the disk is full under {run_dir} (the run's metrics and logs could not be written)"
    for partial in checkpoint_dir.glob("*.orbax-checkpoint-tmp*"):
        shutil.rmtree(partial, ignore_errors=True)
    free = shutil.disk_usage(checkpoint_dir).free if checkpoint_dir.exists() else 0
    newest = heartbeat.newest_checkpoint(str(checkpoint_dir))
    kept = (
        f"the newest complete checkpoint is step {newest}, which a rerun resumes from"
        if newest is not None
        else "no checkpoint was completed yet"
    )
    return (
        f"the disk is full under {checkpoint_dir}: a save needs about {_mb(save_bytes)} and "
        f"{_mb(free)} is free; nothing partial is left and {kept} once there is room "
        f"(or set checkpoint.dir on a larger disk, checkpoint.keep lower)"
    )


def tree_bytes(tree) -> int:
    """The bytes of a tree of (abstract) arrays, as a save writes them, before compression."""
    import jax
    import numpy as np

    def size(leaf) -> int:
        try:
            return int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        except TypeError:  # a typed rng key: a few words
            return 16

    return sum(size(leaf) for leaf in jax.tree.leaves(tree))


def _mb(count: int) -> str:
    return f"{count / 2**20:,.1f} MB"
