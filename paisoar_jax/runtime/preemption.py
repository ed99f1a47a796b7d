"""SIGTERM / SIGINT: finish the current step, save it once, stop (exit 0, or 130 for Ctrl-C).

Clusters announce a preemption with SIGTERM a little before they kill, and often twice (the
scheduler and a launcher both forward it); Ctrl-C sends SIGINT. What a signal does depends
on where the run is:

- before the first step has finished (imports done, state built, restored, compiling):
  nothing new exists to save, so the process ends within a second with its signal's status
  (128 + the signal: 143, 130), however long the compile or the restore would still take;
- from the first step on: a flag the loop reads after each step; it saves the step reached
  (once, whatever number of signals came), waits for the write to commit and returns;
- a third Ctrl-C, pressed as a person presses (each at least PRESS_GAP_S after the last),
  aborts at once and says which step was last saved. Repeated SIGTERMs never abort: the
  hang watchdog, not a signal, is the answer to a run that hangs.

The main thread may sit in a compile or a device wait for minutes, and Python runs signal
handlers only between bytecodes of the main thread. So the C-level handler's wakeup byte
(signal.set_wakeup_fd) is read by a watcher thread, which acts at once.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from paisoar_jax import output
from paisoar_jax.runtime import heartbeat

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SAVED_STOP: list[str] = []  # the signal whose stop this process has saved (then: any more end it)
PRESS_GAP_S = 0.5  # SIGINTs closer than this are one press (a terminal's group + a launcher)
ABORT_PRESSES = 3  # the Ctrl-C press that aborts without waiting for the save


def newest_saved() -> str:
    """What a signal's line says of the saved checkpoints: the newest, which a start resumes.

    Read from the directory the starting run named (heartbeat.progress.checkpoint_dir,
    set by run/startup.py as soon as the config is known): a signal during a resume names
    the checkpoint it resumes from, which the signal leaves as it was.
    """
    directory = heartbeat.progress.checkpoint_dir
    newest = heartbeat.newest_checkpoint(directory)
    if newest is None:
        return "no checkpoint saved"
    return f"the newest checkpoint, step {newest} in {directory}, is untouched: a start resumes it"


def exit_status(signal_name: str) -> int:
    """The status of a process a signal ended: 128 + its number (SIGTERM 143, SIGINT 130)."""
    return 128 + int(signal.Signals[signal_name])


class StopRequest:
    """Context manager that turns SIGTERM and SIGINT into a flag the loop polls.

    `last_saved`: a function naming the newest saved checkpoint, for the line an early exit
    or an abort prints. `speaks`: whether this process prints what a signal will do.
    """

    def __init__(self, last_saved: Callable[[], str] | None = None, speaks: bool = True):
        self.signal_name: str | None = None
        self.speaks = speaks  # whether this process says what a signal does (process 0)
        self.stepping = False  # True once the first step has finished: a signal then saves
        self.last_saved = last_saved or newest_saved
        self._previous: dict[int, object] = {}
        self._previous_wakeup_fd: int | None = None
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._presses = 0
        self._told = False  # whether the line saying what happens next was printed
        self._last_interrupt = -float("inf")

    def __enter__(self) -> StopRequest:
        # Signal handlers can only be set from the main thread (tests may call train elsewhere).
        if threading.current_thread() is not threading.main_thread():
            return self
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._sockets = (reader, writer)
        for number in SIGNALS:
            self._previous[number] = signal.signal(number, self._handle)
        self._previous_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(reader,), daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        if _SAVED_STOP:  # a stop was saved: a signal from here to the exit only ends it sooner
            return
        if self._previous_wakeup_fd is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            self._previous_wakeup_fd = None
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()
        if self._sockets is not None:
            self._sockets[1].close()  # the watcher's recv returns empty and it ends
            self._sockets = None

    def _handle(self, number: int, frame: FrameType | None) -> None:
        """The Python-level handler: nothing; the watcher thread acts on each signal's byte.

        (Installed so the signal writes its wakeup byte instead of killing the process.) The
        flag is raised by the watcher alone: were it raised here too, the loop could save and
        call `stop_saved` before the watcher read that same signal's byte, which it would
        then take for a second signal.
        """

    def _watch(self, reader: socket.socket) -> None:
        """Reads each signal's wakeup byte as it comes and acts on it (see the module)."""
        with reader:
            while True:
                try:
                    received = reader.recv(64)
                except OSError:
                    return
                if not received:
                    return
                for number in received:
                    if number in SIGNALS:
                        self.arrived(signal.Signals(number))

    def arrived(self, number: signal.Signals) -> None:
        """What one SIGTERM or SIGINT does now (the watcher calls it; tests may too)."""
        if _SAVED_STOP:  # the run saved for a stop and is ending: end now, as it would
            first = _SAVED_STOP[0]
            self._end(
                f"{number.name}: the run already saved for {first}; exiting",
                0 if first == "SIGTERM" else exit_status("SIGINT"),
            )
        self.signal_name = self.signal_name or number.name
        if not self.stepping:
            self._end(
                f"{number.name} before the first step finished: nothing new to save "
                f"({self.last_saved()}); exiting",
                exit_status(number.name),
            )
        if number == signal.SIGINT:
            now = time.monotonic()
            if now - self._last_interrupt >= PRESS_GAP_S:
                self._presses += 1
            self._last_interrupt = now
            if self._presses >= ABORT_PRESSES:
                self._end(
                    f"Ctrl-C pressed {ABORT_PRESSES} times: aborting without saving this step "
                    f"({self.last_saved()})",
                    exit_status("SIGINT"),
                )
        if not self._told:
            self._told = True
            more = " (Ctrl-C twice more aborts)" if number == signal.SIGINT else ""
            if self.speaks:
                output.note(f"{number.name}: saving after this step, then the run ends{more}")

    def _end(self, line: str, status: int) -> None:
        """Says `line` and ends the process now (the main thread may be deep in XLA)."""
        output.note(line)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    def request(self, name: str) -> None:
        """Raises the flag from code (the hang watchdog), unless a signal raised it first."""
        self.signal_name = self.signal_name or name

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived."""
        return self.signal_name is not None


def stop_saved(signal_name: str) -> None:
    """Marks the stop a signal asked for as saved: further signals end the process at once.

    With the status that stop ends it with (0 after SIGTERM, 130 after SIGINT), never by a
    default handler half-way through the exit (a scheduler and a launcher both repeat it).
    """
    if signal_name in ("SIGTERM", "SIGINT") and not _SAVED_STOP:
        _SAVED_STOP.append(signal_name)
