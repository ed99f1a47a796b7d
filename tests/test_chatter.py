"""The collectives' connection chatter kept out of a rank's stdout (paisoar_jax/chatter.py)."""

import subprocess

from conftest import PYTHON, subprocess_env

from paisoar_jax.chatter import ChatterFilter, without_chatter

ONE = b"[Gloo] Rank 1 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7"


def test_whole_and_interleaved_pieces_are_chatter_and_the_rest_is_kept():
    assert without_chatter(ONE) is None
    # Two threads' messages cut into each other, as gloo prints them.
    interleaved = b"[Gloo] Rank 2 is connected to 7 peer ranks. " + ONE
    assert without_chatter(interleaved) is None
    assert without_chatter(b"Expected number of connected peer ranks is : 1") is None
    assert without_chatter(b"paisoar_jax: done: 4 steps") == b"paisoar_jax: done: 4 steps"
    assert without_chatter(b"loss 3.1 " + ONE) == b"loss 3.1 "


def test_a_count_cut_off_onto_a_line_of_its_own_goes_too():
    """Seen under srun: `...is : ` then another thread's line end, then `7` and its own."""
    chatter = ChatterFilter()
    lines = [b"Expected number of connected peer ranks is : ", b"7", b"7", b"train: 50%"]
    assert [chatter.line(line) for line in lines] == [None, None, b"7", b"train: 50%"]


FILTERED_PROCESS = """
import os, sys
from paisoar_jax import chatter
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
