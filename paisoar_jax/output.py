"""The one path for the lines a user reads: notes, warnings, errors and a tool's result.

Every user-facing line of the core and the tools goes through `note`, `warning` or `error`,
so one switch, the environment variable PAISOAR_OUTPUT, changes all of them:

    text   (default) `paisoar_jax: ...` lines; notes on stdout, warnings and errors on stderr
    quiet  warnings and errors only (and the progress bar off)
    json   each line one JSON object on the same stream:
           {"level": "note" | "warning" | "error", "program": ..., "message": ...}

A tool's product (plan's table, doctor's findings, bench's JSON line) is its `result`: it is
written as it is in every mode, since that is what the user asked the tool for. Callers
decide which process speaks (process 0, as a rule): this module never touches jax, so it
can speak before `jax.distributed.initialize`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence

from tqdm import tqdm

PROGRAM = "paisoar_jax"
MODES = ("text", "quiet", "json")


def mode() -> str:
    """The output mode PAISOAR_OUTPUT asks for (an unknown value reads as text)."""
    value = os.environ.get("PAISOAR_OUTPUT", "text").strip().lower()
    return value if value in MODES else "text"


def shows_progress() -> bool:
    """Whether a progress bar may be drawn (text mode only: quiet is quiet, json is parsed)."""
    return mode() == "text"


def progress_bar(**settings) -> tqdm:
    """A tqdm bar on stderr, or off (`disable`) outside text mode.

    On a terminal it redraws in place every second; into a file or a pipe (a launcher's log,
    nohup, a scheduler's output) every 30 seconds, each time on a line of its own, where
    carriage-return redraws would join into one endless line. A task srun started writes
    to the job's log whatever its stderr looks like (srun --pty excepted): lines too.
    """
    under_srun = "SLURM_STEP_ID" in os.environ and "SLURM_PTY_PORT" not in os.environ
    if sys.stderr.isatty() and not under_srun:
        return tqdm(mininterval=1.0, **settings)
    return tqdm(file=_LinePerRedraw(sys.stderr), mininterval=30.0, ascii=True, **settings)


def file_progress(items: Sequence, description: str, enabled: bool = True) -> Iterator:
    """`items` (files) under a tqdm bar on stderr.

    Drawn only on a terminal, in text mode and when enabled (convert's --no-progress).
    """
    return tqdm(
        items,
        desc=description,
        unit="file",
        file=sys.stderr,
        disable=None if enabled and shows_progress() else True,
    )


class _LinePerRedraw:
    """A stream for tqdm that writes each redraw as one line (no carriage returns)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def note(
    message: str, *, program: str = PROGRAM, stderr: bool = False, prefixed: bool = True
) -> None:
    """Something the user should know; on stderr where stdout carries a tool's result.

    `prefixed=False`: the text-mode line is the message alone (an eval line, the sample).
    """
    stream = sys.stderr if stderr else sys.stdout
    _write("note", message, program if prefixed else "", stream)


def warning(message: str, *, program: str = PROGRAM, labelled: bool = True) -> None:
    """Something that may be wrong, on stderr; `labelled=False` leaves out `warning: `."""
    _write("warning" if labelled else "report", message, program, sys.stderr)


def error(message: str, *, program: str = PROGRAM) -> None:
    """The one line that says why a command stops (exit status 2 or 1 follows), on stderr."""
    _write("error", message, program, sys.stderr)


def result(text: str) -> None:
    """A tool's product, on stdout, as it is in every mode."""
    print(text, flush=True)


def printable(text: str) -> str:
    r"""Model-written text safe for a terminal or a log: control characters escaped (\x0c).

    Lines and tabs stay as they are. A sample of a little-trained byte model holds NUL, form
    feeds and escapes: raw, they disturb terminals and make grep call the log binary.
    """
    return "".join(
        char if char.isprintable() or char in "\n\t" else char.encode("unicode_escape").decode()
        for char in text
    )


def describe_params(count: int) -> str:
    """A parameter count as a run reports it: `0.12M params`, or `8,386 params` when small."""
    return f"{count:,} params" if count < 10_000 else f"{count / 1e6:.2f}M params"


def format_count(number: float) -> str:
    """A count as 842K, 124M or 1.31B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if number >= scale:
            return f"{number / scale:.3g}{unit}"
    return f"{number:.0f}"


def _write(level: str, message: str, program: str, stream) -> None:
    current = mode()
    if current == "quiet" and level == "note":
        return
    if current == "json":
        level = "warning" if level == "report" else level
        line = json.dumps({"level": level, "program": program or PROGRAM, "message": message})
    else:
        label = f"{level}: " if level in ("warning", "error") else ""
        line = f"{program}: {label}{message}" if program else message
    tqdm.write(line, file=stream)  # above a progress bar, when one is drawn
    stream.flush()
