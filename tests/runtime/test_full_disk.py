"""A full disk (paisoar_jax/runtime/full_disk.py): a real run on a 24 MB tmpfs, then room again.

Mounting needs root, which CI has (as the SLURM tests do); elsewhere the run test is
skipped, saying why. The error-chain check runs everywhere.
"""

import errno
import os
import subprocess

import pytest
from conftest import PYTHON, TINY, subprocess_env

from paisoar_jax.runtime import full_disk

# 1.65M params: a save writes about 19 MB (params and Adam's two moments), so the first
# fits on 24 MB and the second does not.
RUN = [
    *TINY,
    "model.width=256",
    "train.eval_every=0",
    "checkpoint.every=2",
    "checkpoint.keep=5",
]


def test_a_full_disk_is_found_in_the_chain_of_errors():
    assert full_disk.caused_by(OSError(errno.ENOSPC, "No space left on device"))
    try:
        try:
            raise ValueError("RESOURCE_EXHAUSTED: Error writing ... [os_error_code='28']")
        except ValueError:
            raise RuntimeError("the save finalize thread failed") from None
    except RuntimeError as error:
        assert full_disk.caused_by(error)  # from its context
    assert not full_disk.caused_by(OSError(errno.EACCES, "Permission denied"))
    assert not full_disk.caused_by(ValueError("RESOURCE_EXHAUSTED: out of memory"))


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MB tmpfs; yields its path and a function that gives it 96 MB."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], check=True)

    def grow():
        subprocess.run(["mount", "-o", "remount,size=96m", str(mount)], check=True)

    try:
        yield mount, grow
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def train(run_dir, *overrides):
    return subprocess.run(
        [PYTHON, "-m", "paisoar_jax.train", *RUN, f"run.dir={run_dir}", *overrides],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
