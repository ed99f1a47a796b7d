"""Keeps the CPU collectives' connection chatter out of a rank's log when no launcher does.

On CPU, jax's collectives (gloo) print `[Gloo] Rank N is connected to M peer ranks. Expected
number of connected peer ranks is : M` per device group and process, from C++ threads,
straight to file descriptor 1 and in pieces that interleave: eight lines or more per rank
for a small job, in every SLURM or mpirun log. `python -m paisoar_jax.launch` drops them
itself (tools/rank_output.py); started by srun or mpirun (whose ranks may write to a
pseudo-terminal that ends in a file), a rank runs its stdout through a pipe instead, and a
thread forwards all but the chatter, line by line (the progress bar, on stderr, is left
alone).

`restore()` puts the real stdout back and forwards what is left: at exit, and before any
`os._exit` (a failing rank's last lines must not be lost in the pipe).
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading

# The pieces of the message, wherever the threads' interleaving put them: the expected
# count may even come on a line of its own, after another thread's line end.
CONNECTED = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. ?")
EXPECTED = re.compile(rb"Expected number of connected peer ranks is : ?(\d+)?")
COUNT_ALONE = re.compile(rb"\s*\d+\s*")
STDOUT = 1
_lock = threading.Lock()
_active: tuple[int, threading.Thread] | None = None  # (the real stdout, the forwarder)


class ChatterFilter:
    """Takes the chatter out of one stream's lines, in order (it remembers a count owed)."""

    def __init__(self):
        self.owed = 0  # expected counts cut off from their message, still to come

    def line(self, line: bytes) -> bytes | None:
        """The line without the chatter; None when nothing else was on it."""
        if self.owed and COUNT_ALONE.fullmatch(line):
            self.owed -= 1
            return None
        if b"peer ranks" not in line:  # the common case, cheaply
            return line
        kept = CONNECTED.sub(b"", line)
        for match in EXPECTED.finditer(kept):
            self.owed += match.group(1) is None
        kept = EXPECTED.sub(b"", kept)
        return kept if kept.strip() else None


def without_chatter(line: bytes) -> bytes | None:
    """One line without the chatter, on its own (no memory of earlier lines)."""
    return ChatterFilter().line(line)


def filter_stdout() -> None:
    """Routes file descriptor 1 through the filter, once."""
    global _active
    with _lock:
        if _active is not None:
            return
        sys.stdout.flush()
        real = os.dup(STDOUT)
        read_end, write_end = os.pipe()
        os.dup2(write_end, STDOUT)
        os.close(write_end)
        thread = threading.Thread(target=_forward, args=(read_end, real), daemon=True)
        thread.start()
        _active = (real, thread)
    atexit.register(restore)


def _forward(read_end: int, real: int) -> None:
    """Copies whole lines to the real stdout, without the chatter; the rest at EOF."""
    pending, chatter = b"", ChatterFilter()
    while chunk := os.read(read_end, 1 << 16):
        *lines, pending = (pending + chunk).split(b"\n")
        kept = [chatter.line(line) for line in lines]
        text = b"".join(line + b"\n" for line in kept if line is not None)
        if text:
            os.write(real, text)
    if pending:
        os.write(real, pending)
    os.close(read_end)
    os.close(real)


def restore() -> None:
    """The real stdout back on descriptor 1; waits briefly for the forwarder to finish."""
    global _active
    with _lock:
        if _active is None:
            return
        real, thread = _active
        _active = None
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(real, STDOUT)  # the pipe's last writer closes: the forwarder reads to its end
    thread.join(timeout=2)  # (a worker process that inherited the pipe may keep it open)
