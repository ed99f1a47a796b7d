"""One run per run directory: an OS file lock on <run.dir>/run.lock, held for the whole run.

A second start of the same command (a scheduler retry, a second terminal) would otherwise
write over the first run's checkpoints and metrics. The lock is `fcntl.flock` on an open
file, which the kernel drops when its holder exits in any way (kill -9 and a lost node
included), so a dead holder never blocks the next start. Process 0 takes the lock and writes
who holds it (host, pid) into the file; in a multi-process run every process learns the
outcome through one small collective, so all stop together or none does. A filesystem
without locks (some network mounts) gets a warning and the run goes on unguarded.

A run directory removed under a running run takes its lock file with it, so process 0 also
holds a second lock, in the temporary directory and named by the run directory's absolute
path: a second start of the same command on that host is refused even then. When the run
makes its directory again (run/saving.py), it takes the lock there again (`take_again`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import pathlib
import socket
import tempfile
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
        self._host_file = None  # the lock named by the path, in the temporary directory

    def __enter__(self) -> RunLock:
        refusal = self._acquire() if jax.process_index() == 0 else None
        refused = refusal is not None
        if jax.process_count() > 1:  # every process takes part, so none waits on a lone one
            flags = multihost_utils.process_allgather(np.array(refused))
            refused = bool(np.any(flags))
        if refused:
            raise UserError(refusal or f"process 0 could not take run.dir {self.path.parent}")
        return self

    def take_again(self) -> None:
        """The lock of a run directory made again after it vanished (process 0; no collective)."""
        if jax.process_index() != 0:
            return
        if self._file is not None:
            self._file.close()
            self._file = None
        refusal = self._lock(self.path)
        if refusal is not None:
            output.warning(f"{refusal} (found when making it again)")

    def _acquire(self) -> str | None:
        """Creates the run directory and takes its locks; None when taken, else the refusal."""
        host_path = host_lock_path(self.path.parent)
        try:
            host_path.parent.mkdir(parents=True, exist_ok=True)
            self._host_file = open(host_path, "a+")  # noqa: SIM115 - held for the whole run
            fcntl.flock(self._host_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._host_file.seek(0)
            holder = self._host_file.read().strip() or "a process that has not said who it is"
            self._host_file.close()
            self._host_file = None
            return in_use(self.path.parent, holder)
        except OSError:  # no temporary directory to lock in: the run directory's lock alone
            if self._host_file is not None:
                self._host_file.close()
            self._host_file = None
        refusal = self._lock(self.path)
        if self._host_file is not None:
            try:
                if refusal is not None:  # (another host holds the directory)
                    raise OSError("refused")
                self._host_file.truncate(0)
                self._host_file.write(self._file_text())
                self._host_file.flush()
            except OSError:  # refused, or a full temporary directory: that lock let go
                self._host_file.close()
                self._host_file = None
        return refusal

    def _file_text(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        return f"host {socket.gethostname()}, pid {os.getpid()}, since {started}\n"

    def _lock(self, path: pathlib.Path) -> str | None:
        """Creates the run directory and takes `path`'s lock; None when taken, else the refusal."""
        run_dir = path.parent
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock_file = open(path, "a+")  # noqa: SIM115 - held open for the whole run
        except OSError as error:
            return f"run.dir {run_dir} is not writable ({error})"
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "a process that has not said who it is"
            lock_file.close()
            return in_use(run_dir, holder)
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
            lock_file.write(self._file_text())
            lock_file.flush()
        except OSError as error:  # held, but unable to say by whom (a full disk)
            lock_file.close()
            return f"run.dir {run_dir} is not writable ({error})"
        self._file = lock_file
        return None

    def __exit__(self, *exc_info) -> None:
        for held in (self._file, self._host_file):
            if held is not None:
                held.close()  # closing the last descriptor releases the lock
        self._file = self._host_file = None


def host_lock_path(run_dir: pathlib.Path) -> pathlib.Path:
    """The second lock of `run_dir`, in the temporary directory, named by its absolute path."""
    digest = hashlib.sha256(str(pathlib.Path(run_dir).absolute()).encode()).hexdigest()[:20]
    return pathlib.Path(tempfile.gettempdir()) / "paisoar_jax-run-locks" / f"{digest}.lock"


def in_use(run_dir: pathlib.Path, holder: str) -> str:
    """The refusal of a second run in `run_dir`, naming who holds it."""
    return (
        f"run.dir {run_dir} is in use by another run ({holder}): wait for it to finish, "
        f"stop it, or use another run.dir"
    )
