"""One run per run directory: an OS file lock on <run.dir>/run.lock, held for the whole run.

A second start of the same command (a scheduler retry, a second terminal) would otherwise
write over the first run's checkpoints and metrics. The lock is `fcntl.flock` on an open
file, which the kernel drops when its holder exits in any way (kill -9 and a lost node
included), so a dead holder never blocks the next start. Process 0 takes the lock and writes
who holds it (host, pid) into the file; in a multi-process run every process learns the
outcome through one small collective, so all stop together or none does. A filesystem
without locks (some network mounts) gets a warning and the run goes on unguarded.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pathlib
import socket
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from paisoar_jax import output
from paisoar_jax.errors import UserError

LOCK_NAME = "run.lock"
UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


class RunLock:
    """The lock of one run directory, which process 0 creates (a context manager).

    Whatever stops process 0 (the lock held, an unwritable directory) reaches every process
    through the same collective, so all raise the UserError together.
    """

    def __init__(self, run_dir: pathlib.Path):
        self.path = pathlib.Path(run_dir) / LOCK_NAME
        self._file = None

    def __enter__(self) -> RunLock:
        refusal = self._acquire() if jax.process_index() == 0 else None
        refused = refusal is not None
        if jax.process_count() > 1:  # every process takes part, so none waits on a lone one
            flags = multihost_utils.process_allgather(np.array(refused))
            refused = bool(np.any(flags))
        if refused:
            raise UserError(refusal or f"process 0 could not take run.dir {self.path.parent}")
        return self

    def _acquire(self) -> str | None:
        """Creates the run directory and takes its lock; None when taken, else the refusal."""
        run_dir = self.path.parent
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock_file = open(self.path, "a+")  # noqa: SIM115 - held open for the whole run
        except OSError as error:
            return f"run.dir {run_dir} is not writable ({error})"
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "a process that has not said who it is"
            lock_file.close()
            return (
                f"run.dir {run_dir} is in use by another run ({holder}): wait for it to finish, "
                f"stop it, or use another run.dir"
            )
        except OSError as error:
            lock_file.close()
            if error.errno not in UNSUPPORTED:
                return f"run.dir {run_dir} cannot be locked ({os.strerror(error.errno)})"
            output.warning(
                f"run.dir {run_dir} does not support file locks "
                f"({os.strerror(error.errno)}): a second run started in it would not be stopped"
            )
            return None
        try:
            lock_file.truncate(0)
            started = time.strftime("%Y-%m-%d %H:%M:%S")
            lock_file.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {started}\n")
            lock_file.flush()
        except OSError as error:  # held, but unable to say by whom (a full disk)
            lock_file.close()
            return f"run.dir {run_dir} is not writable ({error})"
        self._file = lock_file
        return None

    def __exit__(self, *exc_info) -> None:
        if self._file is not None:
            self._file.close()  # closing the last descriptor releases the lock
            self._file = None
