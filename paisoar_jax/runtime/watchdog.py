"""The hang watchdog: a rank whose steps stop finishing says so and exits with status 3.

A collective that never completes (a peer frozen or dead, a hung driver) blocks the loop
for as long as jax's coordination service or NCCL care to wait, up to half an hour. Under
`srun` or `mpirun` nothing else notices. So a daemon thread watches the loop's progress
marks: when none comes within `train.hang_timeout_s` it prints one line (the process, its
last finished step, the phase it waits in: data, step, log, save), asks the loop to save
and stop (which it does if the hang clears), and if no progress follows within another
timeout it ends the process with HANG_EXIT_CODE, which `launch --max-restarts` restarts.

The first step and every compile are not timed: the watchdog arms at the first finished
step, and `paused()` covers a recompile and an eval (whose first call compiles).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from paisoar_jax import output
from paisoar_jax.errors import HANG_EXIT_CODE
from paisoar_jax.runtime import chatter, heartbeat

AUTO = -1.0  # train.hang_timeout_s's default: on for several processes, off for one
AUTO_TIMEOUT_S = 600.0
CHECK_EVERY_S = 0.25


def timeout_for(setting: float, process_count: int) -> float:
    """The timeout in seconds train.hang_timeout_s asks for; 0 is off."""
    if setting == AUTO:
        return AUTO_TIMEOUT_S if process_count > 1 else 0.0
    return setting


class Watchdog:
    """Watches the loop's progress marks from a daemon thread (a no-op when timeout_s is 0)."""

    def __init__(self, timeout_s: float, who: str, request_stop: Callable[[], None]):
        self.timeout_s = timeout_s
        self.who = who  # "process 1 of 2": the start of its one line
        self.phase = "compile"  # what the loop waits on now: data, step, log, save
        self.step = 0
        self.fired = False
        self._request_stop = request_stop
        self._last: float | None = None  # None: not armed (before the first step, paused)
        self._done = threading.Event()

    def __enter__(self) -> Watchdog:
        if self.timeout_s > 0:
            threading.Thread(target=self._watch, name="hang-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()

    def progressed(self, step: int) -> None:
        """A step (or a save, an eval) finished: the clock starts again."""
        self.step = step
        self._last = time.monotonic()

    @contextlib.contextmanager
    def waiting_in(self, phase: str, untimed: bool = False) -> Iterator[None]:
        """The loop works in `phase` (data, step, log, save) inside; the line names it.

        `untimed`: not timed either (paused: a first save or eval compiles).
        """
        self.phase = phase
        with self.paused() if untimed else contextlib.nullcontext():
            yield

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """What runs inside is not timed (a compile); the clock restarts after it."""
        last, self._last = self._last, None
        try:
            yield
        finally:
            if last is not None:
                self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._done.wait(CHECK_EVERY_S):
            last = self._last
            if last is None or time.monotonic() - last <= self.timeout_s:
                continue
            if self.fired:  # no progress since the line and the stop request either
                sys.stdout.flush()
                chatter.restore()  # (flushes stdout and stderr)
                os._exit(HANG_EXIT_CODE)  # the main thread is blocked: no clean exit
            self.fired = True
            summary = (
                f"{self.who}: no step finished in {self.timeout_s:g} s "
                f"(train.hang_timeout_s); last step {self.step}, waiting in: {self.phase}"
            )
            output.error(
                f"{summary}; asking for a save, exiting with status {HANG_EXIT_CODE} if none "
                f"comes within another {self.timeout_s:g} s"
            )
            heartbeat.record_failure(summary)  # the launcher names it, not a peer it aborts
            self._request_stop()
            self._last = time.monotonic()
