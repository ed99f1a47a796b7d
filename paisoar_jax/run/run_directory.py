"""A run directory that vanishes mid-run (a cleanup script, a wrong `rm -rf`) costs no training.

The Saver (saving.py) asks at every log step and before every save. A run directory or
checkpoint directory that is gone is made again, with the run's config.yaml, and the loop
reopens metrics.jsonl and the checkpointer there, then says so in one line; the next
checkpoint goes there as planned. Where the directory cannot be written again (its parent
gone read-only, a quota), `rescue` saves the step reached in the temporary directory and
the run stops with one line saying where that checkpoint is.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
from collections.abc import Callable
from typing import Any, NoReturn

import jax
import numpy as np
from jax.experimental import multihost_utils

from paisoar_jax import output
from paisoar_jax.checkpointing.checkpoint import Checkpointer
from paisoar_jax.checkpointing.orbax_errors import describe_failure
from paisoar_jax.errors import UserError

CONFIG_NAME = "config.yaml"


def vanished(run_dir: pathlib.Path, checkpoint_dir: pathlib.Path | None) -> list[pathlib.Path]:
    """The run's directories that no longer exist (the run directory first).

    Several processes agree (one small collective): each must reopen its checkpointer at the
    same step, even one that looked after process 0 had already made the directory again.
    """
    candidates = [run_dir] + ([checkpoint_dir] if checkpoint_dir is not None else [])
    gone = [directory for directory in candidates if not directory.is_dir()]
    # A save in flight when the directory went makes its own path again (Orbax creates its
    # temporary directory with parents), so the run directory can be back without what the
    # run wrote there: process 0, which wrote config.yaml, also asks for that file.
    if run_dir not in gone and jax.process_index() == 0:
        if not (run_dir / CONFIG_NAME).exists():
            gone.insert(0, run_dir)
    if jax.process_count() > 1:
        flags = np.array([directory in gone for directory in candidates], np.int32)
        agreed = np.asarray(multihost_utils.process_allgather(flags)).max(axis=0)
        gone = [directory for directory, flag in zip(candidates, agreed, strict=True) if flag]
    return gone


def restore_vanished(
    gone: list[pathlib.Path], run_dir: pathlib.Path, config_text: Callable[[], str], step: int
) -> None:
    """Makes the vanished directories `gone` again, with config.yaml; says so in one line.

    Raises OSError when one cannot be made again (the caller rescues the state).
    """
    if jax.process_index() != 0:
        return
    for directory in gone:
        directory.mkdir(parents=True, exist_ok=True)
    if not (run_dir / CONFIG_NAME).exists():
        (run_dir / CONFIG_NAME).write_text(config_text())
    names = " and ".join(str(directory) for directory in gone)
    output.warning(
        f"{names} vanished during the run (found after step {step}): made again with "
        f"{CONFIG_NAME}; metrics.jsonl goes on from here and the next checkpoint is saved there "
        f"(what the directory held before is lost)"
    )


def rescue_directory(run_dir: pathlib.Path) -> pathlib.Path:
    """Where a checkpoint goes when the run's own directory cannot be written."""
    name = f"paisoar_jax-rescue-{run_dir.name or 'run'}-{os.getpid()}"
    return pathlib.Path(tempfile.gettempdir()) / name / "checkpoints"


def reopen(
    checkpointer: Any, step: int, save_to: Callable[[Any], None], run_dir: pathlib.Path
) -> None:
    """A fresh manager over the checkpoint directory, or the rescue where it is not writable."""
    try:
        checkpointer.reopen()
    except UserError as error:
        rescue(checkpointer, step, save_to, str(error).rpartition("(")[2].rstrip(")"), run_dir)


def rescue(
    checkpointer: Any, step: int, save_to: Callable[[Any], None], why: str, run_dir: pathlib.Path
) -> NoReturn:
    """Saves the step reached in the temporary directory, then stops the run in one line."""
    where = run_dir if checkpointer is None else checkpointer.directory
    if checkpointer is None:
        raise UserError(f"cannot write {where} ({why}), and checkpointing is off: nothing saved")
    spare_dir = rescue_directory(run_dir)
    try:
        spare = Checkpointer(spare_dir, keep=1, async_save=False)
        save_to(spare)
        spare.close()
        saved = (
            f"saved step {step} to {spare_dir} instead: move that directory's contents to "
            f"{where} and run again to resume"
        )
    except Exception as error:
        saved = f"step {step} could not be saved in {spare_dir} either ({describe_failure(error)})"
    raise UserError(f"cannot write {where} ({why}); {saved}")
