"""SIGTERM / SIGINT: finish the current step, save, exit 0.

Clusters announce a preemption with SIGTERM a little before they kill; Ctrl-C sends
SIGINT. Either one only raises a flag here; the training loop checks it after every step,
saves a checkpoint, waits for the write to commit and returns. A second signal restores
the default behaviour, so pressing Ctrl-C twice still stops a run that hangs.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Context manager that turns SIGTERM and SIGINT into a flag the loop polls."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        # Signal handlers can only be set from the main thread (tests may call train elsewhere).
        if threading.current_thread() is threading.main_thread():
            for number in SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, number: int, frame: FrameType | None) -> None:
        """First signal: raise the flag. Second: back to the default handler."""
        self.signal_name = signal.Signals(number).name
        signal.signal(number, self._previous.get(number, signal.SIG_DFL))

    def request(self, name: str) -> None:
        """Raises the flag from code (the hang watchdog), unless a signal raised it first."""
        self.signal_name = self.signal_name or name

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived."""
        return self.signal_name is not None
