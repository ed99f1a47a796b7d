"""The collectives' connection chatter kept out of a rank's stdout (runtime/chatter.py)."""

import random
import subprocess

from conftest import PYTHON, subprocess_env

from paisoar_jax.runtime.chatter import ChatterFilter

ONE = b"[Gloo] Rank 1 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7"


def without_chatter(line):
    return ChatterFilter().line(line)


def test_whole_and_interleaved_pieces_are_chatter_and_the_rest_is_kept():
    assert without_chatter(ONE) is None
    # Two threads' messages cut into each other, as gloo prints them.
    interleaved = b"[Gloo] Rank 2 is connected to 7 peer ranks. " + ONE
    assert without_chatter(interleaved) is None
    assert without_chatter(b"Expected number of connected peer ranks is : 1") is None
    assert without_chatter(b"paisoar_jax: done: 4 steps") == b"paisoar_jax: done: 4 steps"
    assert without_chatter(b"loss 3.1 " + ONE) == b"loss 3.1 "


def gloo_and_the_user(seed: int, threads: int = 8) -> bytes:
    """A stream as a rank writes it: gloo's threads put the pieces of their messages into
    one C buffer, in any order, which each line end (std::endl) flushes; Python writes the
    user's lines whole, between two flushes."""
    rng = random.Random(seed)
    messages = [
        [b"[Gloo] Rank ", b"%d" % rank, b" is connected to ", b"7", b" peer ranks. "]
        + [b"Expected number of connected peer ranks is : ", b"7", b"\n"]
        for rank in range(threads)
    ]
    users = [line + b"\n" for line in USER_LINES]
    stream, buffer = b"", b""
    while users or any(messages):
        queue = rng.choice([*filter(None, messages), *([users] if users else [])])
        if queue is users:
            stream += users.pop(0)
            continue
        buffer += queue.pop(0)
        if buffer.endswith(b"\n"):
            stream, buffer = stream + buffer, b""
    return stream


USER_LINES = [b"paisoar_jax: 2 processes (SLURM); 8 devices, 4 per process", b"step 10: loss 3.41"]


def test_every_interleaving_of_eight_threads_leaves_the_users_lines_and_nothing_else():
    for seed in range(300):
        chatter = ChatterFilter()
        lines = gloo_and_the_user(seed).split(b"\n")[:-1]
        kept = [line for line in map(chatter.line, lines) if line is not None]
        assert kept == USER_LINES, (seed, kept)


FILTERED_PROCESS = """
import os, sys
from paisoar_jax.runtime import chatter
chatter.filter_stdout()
os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. ")  # from C++, in pieces
print("paisoar_jax: compiled", flush=True)
os.write(1, b"Expected number of connected peer ranks is : 1\\n")
print("the last line before os._exit", flush=True)
chatter.restore()
os._exit(3)
"""


def test_a_rank_drops_the_chatter_and_loses_no_line_at_os_exit():
    result = subprocess.run(
        [PYTHON, "-c", FILTERED_PROCESS], env=subprocess_env(), capture_output=True, timeout=60
    )
    assert result.returncode == 3, result.stderr
    assert result.stdout == b"paisoar_jax: compiled\nthe last line before os._exit\n"
