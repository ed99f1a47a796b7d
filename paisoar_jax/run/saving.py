"""A run's checkpoints as one object: when to save, the asynchronous wait, retries, the end.

The loop asks `saver.is_due(step, stop_now)` after every step and `saver.save(step, state)`
when it is, then `saver.finish(step, state)` once at the end; `Prepared.save` and
`Prepared.close` ask the same.
What happens in between is the Saver's: the cadence (every checkpoint.every steps, the last
step, a stop), waiting for the save in flight before the next (what it writes takes room
too), saving again when its directory vanished under it, making a vanished run directory
again (run_directory.py), the room check of a nearly full disk, and at the end the commit of
the last save, rescued to the temporary directory when the run's own cannot be written.
A step already saved is not saved twice.
"""

from __future__ import annotations

import time

import jax

from paisoar_jax import output
from paisoar_jax.checkpointing.checkpoint import Checkpointer
from paisoar_jax.checkpointing.orbax_errors import describe_failure
from paisoar_jax.data.prefetch import DevicePrefetcher
from paisoar_jax.engine.state import TrainState
from paisoar_jax.errors import DivergenceError, UserError
from paisoar_jax.run import run_directory
from paisoar_jax.run.resume import save
from paisoar_jax.run.run_records import Instruments
from paisoar_jax.run.setup import Setup
from paisoar_jax.runtime import full_disk
from paisoar_jax.runtime.run_lock import RunLock


def config_text(run: Setup) -> str:
    """What the run writes to <run.dir>/config.yaml: the task's note, then the config."""
    return run.task.config_note + run.config_yaml


class Saver:
    """Saves a run's state with its input's position (see the module docstring).

    `checkpointer`: None when checkpointing is off (then nothing is saved, and a vanished
    run directory is still made again). `batches`: the input, whose position each save
    keeps. `instruments`: the loop's: its metrics file is reopened when its directory is
    made again, and the time the loop blocks on a save counts as save time, not step time.
    `lock`: the run directory's lock, taken again when the directory is made again.
    """

    def __init__(
        self,
        run: Setup,
        checkpointer: Checkpointer | None,
        batches: DevicePrefetcher | None,
        instruments: Instruments | None = None,
        lock: RunLock | None = None,
    ):
        self.run = run
        self.checkpointer = checkpointer
        self.batches = batches
        self.instruments = instruments
        self.lock = lock
        self.last_saved: int | None = None  # the step this saver saved last

    @property
    def has_saved(self) -> bool:
        """Whether this saver started a save yet (the first one compiles)."""
        return self.last_saved is not None

    def is_due(self, step: int, stop_now: bool = False) -> bool:
        """Every checkpoint.every steps, the last step (train.steps) and a stop."""
        if self.checkpointer is None:
            return False
        every = self.run.checkpoint.every
        return bool(every and step % every == 0) or step == self.run.train.steps or stop_now

    def save(self, step: int, state: TrainState) -> None:
        """Starts an async save of `step` once the one in flight is done; timed as save time.

        A step saved already (by this run or the one it resumed) is left as it is.
        """
        checkpointer = self._checkpointer()
        if step == self.last_saved or step in checkpointer.steps():
            return
        started = time.perf_counter()
        try:
            checkpointer.wait()  # the save in flight first: what it writes takes room too
        except Exception as error:  # its directory went away under it, most often
            self._say_failed(error, f"saving step {step} now instead")
            self._reopen(step, state)
        self.keep_directories(step, state)
        estimate_bytes = full_disk.tree_bytes(self.run.layout.abstract_state)
        full_disk.check_room(self.run.run_dir, checkpointer.directory, estimate_bytes)
        try:
            save(checkpointer, step, state, self.batches, self.run)
        except (UserError, DivergenceError):
            raise
        except Exception as error:  # the directory went away again while the save started
            self._say_failed(error, f"saving step {step} again")
            self._reopen(step, state)
            save(checkpointer, step, state, self.batches, self.run)
        self.last_saved = step
        if self.instruments is not None:
            blocked_s = time.perf_counter() - started
            self.instruments.timer.start_time += blocked_s
            self.instruments.timer.save_s += blocked_s

    def finish(self, step: int, state: TrainState) -> None:
        """Waits for the last save to be committed; one that failed is made again, or rescued."""
        if self.checkpointer is None:
            return
        try:
            self.checkpointer.wait()
            return
        except Exception as error:
            self._say_failed(error, f"saving step {step} again")
        self._reopen(step, state)
        try:
            save(self.checkpointer, step, state, self.batches, self.run)
            self.checkpointer.wait()
        except UserError:
            raise
        except Exception as error:
            why = describe_failure(error)
            run_directory.rescue(
                self.checkpointer, step, self._save_to(step, state), why, self.run.run_dir
            )

    def keep_directories(self, step: int, state: TrainState) -> None:
        """A vanished run or checkpoint directory is made again, and what writes there reopened.

        Its lock is taken again (a second start of the same command is refused there too).
        Where a directory cannot be made again, the step reached is rescued elsewhere and
        the run stops (run_directory.rescue).
        """
        run_dir, checkpointer = self.run.run_dir, self.checkpointer
        gone = run_directory.vanished(run_dir, checkpointer and checkpointer.directory)
        if not gone:
            return
        save_to = self._save_to(step, state)
        try:
            run_directory.restore_vanished(gone, run_dir, lambda: config_text(self.run), step)
        except OSError as error:
            run_directory.rescue(checkpointer, step, save_to, f"{error.strerror or error}", run_dir)
        if self.lock is not None and run_dir in gone:
            self.lock.take_again()
        if self.instruments is not None:
            self.instruments.writer.reopen()
        if checkpointer is not None:
            run_directory.reopen(checkpointer, step, save_to, run_dir)

    def _reopen(self, step: int, state: TrainState) -> None:
        """The directories made again, then a fresh manager over the checkpoint directory."""
        checkpointer = self._checkpointer()
        self.keep_directories(step, state)
        run_directory.reopen(checkpointer, step, self._save_to(step, state), self.run.run_dir)

    def _checkpointer(self) -> Checkpointer:
        if self.checkpointer is None:
            raise UserError("checkpoint.enabled=false: this run has nowhere to save")
        return self.checkpointer

    def _save_to(self, step: int, state: TrainState):
        """save_to(checkpointer): saves the step reached there (for a rescue)."""
        return lambda checkpointer: save(checkpointer, step, state, self.batches, self.run)

    def _say_failed(self, error: Exception, then: str) -> None:
        if jax.process_index() == 0:
            directory = self._checkpointer().directory
            output.warning(
                f"a checkpoint save in {directory} failed ({describe_failure(error)}); {then}"
            )
