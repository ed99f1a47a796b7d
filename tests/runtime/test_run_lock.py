"""One run per run directory: a second start stops, a dead holder does not block the next."""

import errno
import os
import time

import pytest
from conftest import TINY

from paisoar_jax.errors import UserError
from paisoar_jax.runtime import run_lock
from paisoar_jax.runtime.run_lock import RunLock


def test_a_held_run_directory_names_its_holder_and_frees_on_exit(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(UserError) as held:
            with RunLock(tmp_path):
                pass
        message = str(held.value)
        assert message.startswith(f"run.dir {tmp_path} is in use by another run (host ")
        assert f"pid {os.getpid()}, since " in message and "\n" not in message
    with RunLock(tmp_path):  # released with the first one
        pass


def test_a_removed_run_directory_is_still_held_and_its_lock_is_taken_again(tmp_path):
    """A second start of the same command beside a run whose directory was removed (a
    cleanup script) is refused; the run takes its lock again when it makes the directory."""
    import shutil

    run_dir = tmp_path / "run"
    with RunLock(run_dir) as held:
        shutil.rmtree(run_dir)
        with pytest.raises(UserError, match=f"run.dir {run_dir} is in use by another run"):
            with RunLock(run_dir):
                pass
        run_dir.mkdir()  # what the run does when it finds its directory gone
        held.take_again()
        assert (run_dir / run_lock.LOCK_NAME).read_text().startswith("host ")
        with pytest.raises(UserError, match="is in use by another run"):
            with RunLock(run_dir):
                pass
    with RunLock(run_dir):  # both released on exit
        pass


def test_a_refused_start_lets_go_of_everything_it_took(tmp_path):
    """Refused by the directory's lock alone (a holder on another host sees only that one):
    the lock named by the path is let go too, so a later start in this process goes on."""
    import fcntl

    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / run_lock.LOCK_NAME, "a+") as other_host:
        fcntl.flock(other_host, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UserError, match="is in use by another run"):
            with RunLock(tmp_path):
                pass
    with RunLock(tmp_path):  # the holder is gone: nothing of the refused start is left
        pass


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    def no_locks(*args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    with RunLock(tmp_path):
        pass
    warning = capsys.readouterr().err
    assert f"warning: run.dir {tmp_path} does not support file locks" in warning


def wait_until(condition, process, timeout=180):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.stderr.read()[-3000:] if process.stderr else ""
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def newest_step(checkpoints):
    return max(int(name) for name in os.listdir(checkpoints) if name.isdigit())


def train_arguments(run_dir, *overrides):
    overrides = [*TINY, "train.log_every=1", "checkpoint.every=2", "train.eval_every=0", *overrides]
    return [*overrides, f"run.dir={run_dir}"]
