"""The launched ranks' output: prefixed lines on the screen (until muted) and a log per rank.

Each rank's whole output is kept in memory until its run directory is known (from its
heartbeat), then written to <run.dir>/logs/rank-N.log and appended to as it comes. The
screen is muted once the launcher has named a stalled rank: the stack traces the healthy
ranks print when they are stopped belong in the logs.
"""

from __future__ import annotations

import collections
import pathlib
import re
import threading

from paisoar_jax import output as user_output
from paisoar_jax.runtime.chatter import ChatterFilter

LINE_END = re.compile(rb"(\r\n|\n|\r)")
PENDING_BYTES = 8 << 20  # output kept per rank before its log file opens
# Lines every rank prints alike when the run ends early (a bad setting, a signal before the
# first step): shown once, from the first rank to say it; the others' go to their logs.
SAID_ONCE = (b": error: ", b"before the first step finished")


class RankLog:
    """A rank's whole output, kept in memory until its run directory is known, then a file."""

    def __init__(self):
        self.pending: collections.deque[bytes] = collections.deque()
        self.pending_bytes = 0
        self.file = None
        self.failed = False

    def write(self, data: bytes) -> None:
        """Appends output (called under the launcher's output lock)."""
        if self.failed:
            return
        if self.file is None:  # no run directory (yet): keep the newest PENDING_BYTES
            self.pending.append(data)
            self.pending_bytes += len(data)
            while self.pending_bytes > PENDING_BYTES:
                self.pending_bytes -= len(self.pending.popleft())
            return
        try:
            self.file.write(data)
            self.file.flush()
        except OSError:  # a full disk: stop logging, keep the rank's output flowing
            self.close()
            self.failed = True

    def open(self, path: pathlib.Path) -> None:
        """Starts the file with what came so far (called under the output lock)."""
        if self.file is not None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("ab")
            self.file.write(b"".join(self.pending))
            self.file.flush()
        except OSError:
            self.close()  # keep it in memory: the screen still has it
            return
        self.pending.clear()

    def close(self) -> None:
        """Closes the file, if one is open."""
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
            self.file = None


class Output:
    """Where the ranks' lines go: the screen (until muted) and each rank's log."""

    def __init__(self):
        self.lock = threading.Lock()
        self.muted = False
        # Error lines on the screen already: the same line from another rank (a bad key,
        # which every rank finds) goes to that rank's log only, so it is said once.
        self.shown_errors: set[str] = set()

    def first_time(self, line: bytes) -> bool:
        """Whether an error line is new to the screen (remembered as shown once shown)."""
        text = line.decode(errors="replace").strip()
        with self.lock:
            if text in self.shown_errors:
                return False
            if not self.muted:  # (a muted screen shows nothing: not said yet)
                self.shown_errors.add(text)
            return True

    def write(self, sink, log: RankLog, data: bytes, screen: bool = True) -> None:
        """One whole line at a time; a closed sink only drops output (the child must not block).

        `screen=False`: to the log only.
        """
        with self.lock:
            log.write(data)  # never raises: a failing log file is dropped (the pipe must drain)
            if self.muted or not screen:
                return
            try:
                sink.write(data)
                sink.flush()
            except OSError:
                pass


def copy_lines(
    stream, sink, prefix: bytes, log: RankLog, tail: collections.deque, output: Output
) -> None:
    """Copies a child's stream line by line with its rank prefix; keeps the last lines.

    The collectives' connection chatter goes to the rank's log only, and so does an error
    line another rank has shown already (`Output.first_time`).

    Under PAISOAR_OUTPUT=json a JSON line of the child gets its rank as a key instead, so
    the launcher's output stays one JSON object a line.
    """
    pending, chatter_filter = b"", ChatterFilter()
    json_mode = user_output.mode() == "json"
    while chunk := stream.read1(1 << 16):
        pieces = LINE_END.split(pending + chunk)
        pending = pieces.pop()
        for text, end in zip(pieces[0::2], pieces[1::2], strict=True):
            if json_mode and text.startswith(b"{") and text.rstrip().endswith(b"}"):
                rank = prefix.decode().strip().removeprefix("[rank ").removesuffix("]")
                output.write(sink, log, b'{"rank": %s, ' % rank.encode() + text[1:] + end)
                continue
            # The CPU collectives' connection chatter: for the log, not the screen or the
            # last lines of a failed rank (paisoar_jax/runtime/chatter.py).
            kept = chatter_filter.line(text)
            if kept is None:
                output.write(sink, log, prefix + text + end, screen=False)
                continue
            once = not any(mark in kept for mark in SAID_ONCE) or output.first_time(kept)
            output.write(sink, log, prefix + kept + end, screen=once)
            if end != b"\r" and kept.strip():  # a progress bar's redraws are not lines
                tail.append(kept.decode(errors="replace"))
    if pending:
        output.write(sink, log, prefix + pending + b"\n")
        tail.append(pending.decode(errors="replace"))
