"""Progress heartbeats between a launched rank and `python -m paisoar_jax.launch`.

Under the launcher (PAISOAR_HEARTBEAT_FILE set) each rank runs a daemon thread that rewrites
a small JSON file every second: the step it last finished, its run directory and where its
checkpoints go. The thread beats on while the main thread waits in a collective, so beats
that stop mean the process itself stopped (SIGSTOP, a frozen node, a hung driver). The
launcher then names that rank, not the healthy peer that jax's coordination service would
abort a little later with a screen of stack traces.

The loop's only cost is one attribute store per step (`progress.step = step`); the file is
written by the thread, off the step's path.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

HEARTBEAT_FILE = "PAISOAR_HEARTBEAT_FILE"
INTERVAL_S = 1.0


class Progress:
    """What the beats report; the training loop updates it."""

    step: int = 0  # the last step this process finished
    run_dir: str | None = None
    checkpoint_dir: str | None = None
    error: str | None = None  # the one line of the error this process is failing with
    failed_at: float | None = None  # when it caught it (the launcher names the first)
    retryable: bool = True  # whether `launch --max-restarts` may run the job again


progress = Progress()
_started = threading.Event()
_exiting = threading.Event()
_writing = threading.Lock()


def start(environ: Mapping[str, str] | None = None) -> None:
    """Starts the beating thread once, when the launcher asked for beats."""
    path = (os.environ if environ is None else environ).get(HEARTBEAT_FILE)
    if not path or _started.is_set():
        return
    _started.set()
    path = pathlib.Path(path)
    _record_uncaught()
    threading.Thread(target=_beat, args=(path,), name="heartbeat", daemon=True).start()
    # An exiting process stops beating (its daemon thread ends) while it tears down, which
    # can take seconds: it says so first, so the launcher does not take it for stalled.
    atexit.register(_last_beat, path)


def record_failure(
    message: str, environ: Mapping[str, str] | None = None, retryable: bool = True
) -> None:
    """Writes a beat now that carries this process's error line and the time.

    A rank that fails first makes its peers fail after it (their collectives abort), and
    the peers may even exit first; the launcher names the rank whose error is oldest.
    Written whether or not the beating thread runs (an error before joining); the first
    failure recorded stays. `retryable=False`: a restart would fail the same way (a
    divergence, which resumes exactly and diverges again).
    """
    if progress.failed_at is not None:
        return
    progress.error, progress.failed_at, progress.retryable = message, time.time(), retryable
    path = (os.environ if environ is None else environ).get(HEARTBEAT_FILE)
    if path:
        with _writing:
            _write(pathlib.Path(path), exiting=_exiting.is_set())


def one_line(error: BaseException) -> str:
    """`FileNotFoundError: ...`: the last line of its traceback, as a beat records it."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1]}" if text else type(error).__name__


def _record_uncaught() -> None:
    """A script's uncaught exception is recorded as its failure too (then printed as ever)."""
    previous = sys.excepthook

    def hook(kind, error, trace):
        record_failure(one_line(error))
        previous(kind, error, trace)

    sys.excepthook = hook


def _beat(path: pathlib.Path) -> None:
    """Rewrites the heartbeat file every INTERVAL_S, until the process exits."""
    while not _exiting.is_set():
        with _writing:
            if not _exiting.is_set():
                _write(path)
        time.sleep(INTERVAL_S)


def _last_beat(path: pathlib.Path) -> None:
    """At exit: stops the beats, then writes one that says the process is exiting."""
    with _writing:  # a beat in flight finishes first; none comes after
        _exiting.set()
        _write(path, exiting=True)


def _write(path: pathlib.Path, exiting: bool = False) -> None:
    """One beat, written atomically (a reader never sees half of it)."""
    record = {
        "time": time.time(),
        "pid": os.getpid(),
        "step": progress.step,
        "run_dir": progress.run_dir,
        "checkpoint_dir": progress.checkpoint_dir,
        "exiting": exiting,
        "error": progress.error,
        "failed_at": progress.failed_at,
        "retryable": progress.retryable,
    }
    partial = path.with_suffix(f".{threading.get_ident()}.partial")
    try:
        partial.write_text(json.dumps(record))
        os.replace(partial, path)
    except OSError:
        pass  # the launcher's folder is gone: it has stopped watching


def read(path: pathlib.Path) -> dict[str, Any] | None:
    """The last beat written to `path`, or None before the first."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def newest_checkpoint(checkpoint_dir: str | None) -> int | None:
    """The newest complete checkpoint step in a directory (Orbax names them by step)."""
    try:
        steps = [
            int(entry.name) for entry in os.scandir(checkpoint_dir or "") if entry.name.isdigit()
        ]
    except OSError:
        return None
    return max(steps, default=None)
