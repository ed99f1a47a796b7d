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

import json
import os
import pathlib
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


progress = Progress()
_started = threading.Event()


def start(environ: Mapping[str, str] | None = None) -> None:
    """Starts the beating thread once, when the launcher asked for beats."""
    path = (os.environ if environ is None else environ).get(HEARTBEAT_FILE)
    if not path or _started.is_set():
        return
    _started.set()
    threading.Thread(
        target=_beat, args=(pathlib.Path(path),), name="heartbeat", daemon=True
    ).start()


def _beat(path: pathlib.Path) -> None:
    """Rewrites the heartbeat file every INTERVAL_S (atomically: a reader never sees half)."""
    partial = path.with_suffix(".partial")
    while True:
        record = {
            "time": time.time(),
            "pid": os.getpid(),
            "step": progress.step,
            "run_dir": progress.run_dir,
            "checkpoint_dir": progress.checkpoint_dir,
        }
        try:
            partial.write_text(json.dumps(record))
            os.replace(partial, path)
        except OSError:
            pass  # the launcher's folder is gone: it has stopped watching
        time.sleep(INTERVAL_S)


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
