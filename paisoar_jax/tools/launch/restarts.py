"""`launch --max-restarts N`: a failed job starts again from its newest complete checkpoint.

The launcher runs the whole job (every rank) as one attempt. An attempt that ends with a
crash, a killed rank, a stalled rank or the hang watchdog's status 3 is followed, after a
short back-off (doubling, at most MAX_BACKOFF_S), by a fresh attempt: new processes that
resume from the newest complete checkpoint, as any rerun of the same command does
(checkpoint.resume=auto). A user error (status 2: a bad setting, a missing file, a full
disk) would fail the same way again and is never retried, nor a divergence (it resumes
exactly and diverges again), nor a job the launcher was sent SIGINT or SIGTERM.

Each restart is one line on screen and a record in <run.dir>/events.jsonl, as is the
giving up: {"time", "event", "cause", "rank", "exit_status", "attempt", "max_restarts",
"resume_step"}.
"""

from __future__ import annotations

import json
import pathlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from paisoar_jax import output
from paisoar_jax.runtime import heartbeat

PROGRAM = "paisoar_jax.launch"
MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class Ending:
    """How one attempt of the job ended, as the launcher saw it."""

    status: int  # the launcher's exit status for it
    cause: str = ""  # "rank 1 was killed by SIGKILL"; empty when the job finished
    rank: int | None = None  # the rank at fault, when one is
    retry: bool = False  # whether another attempt could help
    run_dir: str | None = None  # from the ranks' heartbeats, once they said
    checkpoint_dir: str | None = None


def run_with_restarts(
    attempt: Callable[[SignalLog], Ending], max_restarts: int, backoff_s: float
) -> int:
    """Runs attempts until one ends without a retryable failure, or none are left.

    SIGINT and SIGTERM are recorded for the whole series (each attempt passes them on to
    its processes); once one came, no attempt follows.
    """
    with SignalLog() as signals:
        return _attempts(attempt, signals, max_restarts, backoff_s)


def _attempts(attempt, signals: SignalLog, max_restarts: int, backoff_s: float) -> int:
    restarts, run_dir = 0, None
    while True:
        ending = attempt(signals)
        if signals.received:  # the user (or the scheduler) wants the job to end
            ending = replace(ending, retry=False)
        run_dir = ending.run_dir or run_dir
        if ending.status == 0 or not ending.retry:
            if ending.status != 0 and restarts:
                _record(run_dir, "not_retried", ending, restarts, max_restarts)
            return ending.status
        if restarts >= max_restarts:
            if max_restarts:
                say(f"giving up after {restarts} restart(s): {ending.cause}", "error")
                _record(run_dir, "gave_up", ending, restarts, max_restarts)
            return ending.status
        restarts += 1
        delay = min(backoff_s * 2 ** (restarts - 1), MAX_BACKOFF_S)
        resume = heartbeat.newest_checkpoint(ending.checkpoint_dir)
        where = f"resuming from step {resume}" if resume is not None else "from the start"
        say(f"restart {restarts} of {max_restarts} in {delay:g} s, {where}: {ending.cause}")
        _record(run_dir, "restart", ending, restarts, max_restarts, resume)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and not signals.received:
            time.sleep(0.05)
        if signals.received:
            name = signal.Signals(signals.received[0]).name
            say(f"{name} during the back-off: not restarting", "error")
            return 128 + signals.received[0]


def _record(
    run_dir: str | None,
    event: str,
    ending: Ending,
    attempt: int,
    max_restarts: int,
    resume_step: int | None = None,
) -> None:
    """Appends one line to <run.dir>/events.jsonl (nowhere before the run dir is known)."""
    if run_dir is None:
        return
    record = {
        "time": time.time(),
        "event": event,
        "cause": ending.cause,
        "rank": ending.rank,
        "exit_status": ending.status,
        "attempt": attempt,
        "max_restarts": max_restarts,
        "resume_step": resume_step,
    }
    try:
        with (pathlib.Path(run_dir) / "events.jsonl").open("a") as events:
            events.write(json.dumps(record) + "\n")
    except OSError as error:  # a full disk must not stop the restart itself
        say(f"could not write {run_dir}/events.jsonl ({error.strerror})", "error")


class SignalLog:
    """Records SIGINT/SIGTERM for the supervising loop, which forwards them."""

    def __init__(self):
        self.received: list[int] = []
        self.times: list[float] = []  # time.monotonic() of each, to tell presses apart
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalLog:
        for number in (signal.SIGINT, signal.SIGTERM):
            self._previous[number] = signal.signal(number, self._record)
        return self

    def __exit__(self, *exc_info) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _record(self, number: int, frame) -> None:
        self.times.append(time.monotonic())
        self.received.append(number)


def say(message: str, level: str = "note") -> None:
    """A line of the launcher's own on stderr: a note, a failure report or an error."""
    if level == "note":
        output.note(message, program=PROGRAM, stderr=True)
    elif level == "failure":  # a warning to a log collector; the text reads as before
        output.warning(message, program=PROGRAM, labelled=False)
    else:
        output.error(message, program=PROGRAM)
