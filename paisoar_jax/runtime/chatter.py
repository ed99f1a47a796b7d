"""Keeps the CPU collectives' connection chatter out of a rank's log when no launcher does.

On CPU, jax's collectives (gloo) print `[Gloo] Rank N is connected to M peer ranks. Expected
number of connected peer ranks is : M` per device group and process, from C++ threads,
straight to file descriptor 1 and in pieces that interleave: eight lines or more per rank
for a small job, in every SLURM or mpirun log. `python -m paisoar_jax.launch` drops them
itself (tools/launch/rank_output.py); started by srun or mpirun (whose ranks may write to a
pseudo-terminal that ends in a file), a rank runs its stdout through a pipe instead, and a
thread forwards all but the chatter, line by line (the progress bar, on stderr, is left
alone). Each gloo line end flushes whole lines, so the user's lines arrive intact; only a
blank line or a lone number printed while the collectives connect may be taken for theirs.

`restore()` puts the real stdout back and forwards what is left: at exit, and before any
`os._exit` (a failing rank's last lines must not be lost in the pipe).
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading

# gloo composes its message in pieces that threads print in turn, so another thread's
# piece or line end can fall between any two of them: each piece is matched on its own,
# with its number when that came with it.
PIECES = re.compile(
    rb"\[Gloo\] Rank(?: (\d+))?"
    rb"| ?is connected to(?: (\d+))?"
    rb"| ?peer ranks\. ?"
    rb"|Expected number of connected peer ranks is : ?(\d+)?"
)
MESSAGE_START = b"[Gloo] Rank"
NUMBERS_PER_MESSAGE = 3
NUMBER = re.compile(rb"\d+")
ONLY_NUMBERS = re.compile(rb"\s*\d+(?:\s+\d+)*\s*")
QUIET_LINES = 20
PEER, GLOO = b"peer ranks", b"[Gloo]"
STDOUT = 1
_lock = threading.Lock()
_active: tuple[int, threading.Thread] | None = None  # (the real stdout, the forwarder)


class ChatterFilter:
    """Takes the chatter out of one stream's lines, in order.

    It counts what the pieces it removed still owe: the numbers printed apart from their
    piece (a line of digits alone), and each message's line end (a line left empty).
    """

    def __init__(self):
        self.numbers_owed = 0
        self.line_ends_owed = 0
        self.quiet_lines = 0  # lines since the last piece

    def line(self, line: bytes) -> bytes | None:
        """The line without the chatter; None when nothing else was on it."""
        owed = self.numbers_owed or self.line_ends_owed
        pieces = list(PIECES.finditer(line)) if PEER in line or GLOO in line or owed else []
        if not pieces:
            if not owed:
                return line  # the common case, cheaply
            return self._owed(line)
        self.quiet_lines = 0
        messages = line.count(MESSAGE_START)
        self.line_ends_owed += messages
        self.numbers_owed += NUMBERS_PER_MESSAGE * messages
        for match in pieces:
            self.numbers_owed -= sum(group is not None for group in match.groups())
        kept = PIECES.sub(b"", line)
        if ONLY_NUMBERS.fullmatch(kept):  # numbers of other threads' pieces
            self.numbers_owed = max(self.numbers_owed - len(NUMBER.findall(kept)), 0)
        elif kept.strip():
            return kept  # the user's own text (gloo flushes whole lines: it should not be)
        self.line_ends_owed = max(self.line_ends_owed - 1, 0)  # this line's end was one
        return None

    def _owed(self, line: bytes) -> bytes | None:
        """A line without pieces while some are owed: a lone number, a line end, or theirs.

        Debts are forgotten QUIET_LINES lines after the last piece, so a miscount never
        eats the user's lines for long.
        """
        self.quiet_lines += 1
        if self.quiet_lines > QUIET_LINES:
            self.numbers_owed = self.line_ends_owed = 0
            return line
        lone_number = bool(self.numbers_owed and ONLY_NUMBERS.fullmatch(line))
        lone_line_end = bool(self.line_ends_owed and not line.strip())
        if not (lone_number or lone_line_end):
            return line
        if lone_number:
            self.numbers_owed -= min(len(NUMBER.findall(line)), self.numbers_owed)
        self.line_ends_owed = max(self.line_ends_owed - 1, 0)
        return None


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
    """Copies whole lines to the real stdout, without the chatter; the rest at EOF.

    It never stops reading: were the real stdout gone (srun's I/O closed, `| head`), a
    full pipe would block every print of the process. What cannot be written is dropped.
    """
    pending, chatter, writable = b"", ChatterFilter(), True
    while chunk := os.read(read_end, 1 << 16):
        *lines, pending = (pending + chunk).split(b"\n")
        kept = [chatter.line(line) for line in lines]
        text = b"".join(line + b"\n" for line in kept if line is not None)
        writable = writable and _write_all(real, text)
    if pending and writable:
        _write_all(real, pending)
    os.close(read_end)
    os.close(real)


def _write_all(descriptor: int, data: bytes) -> bool:
    """Writes all of `data`; False once the descriptor fails."""
    try:
        while data:
            data = data[os.write(descriptor, data) :]
    except OSError:
        return False
    return True


def restore() -> None:
    """Flushes stdout and stderr; the real stdout back on descriptor 1, forwarded to.

    Waits briefly for the forwarder to finish what the pipe still holds.
    """
    global _active
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    with _lock:
        if _active is None:
            return
        real, thread = _active
        _active = None
        os.dup2(real, STDOUT)  # the pipe's last writer closes: the forwarder reads to its end
    thread.join(timeout=2)  # (a worker process that inherited the pipe may keep it open)
