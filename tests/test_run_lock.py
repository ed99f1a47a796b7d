"""One run per run directory: a second start stops, a dead holder does not block the next."""

import contextlib
import errno
import os
import pathlib
import signal
import subprocess
import time

import pytest
from conftest import PYTHON, TINY, run_module, subprocess_env

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


@pytest.mark.slow
def test_a_second_start_stops_and_a_killed_holder_does_not_block(tmp_path):
    run_dir = tmp_path / "run"
    metrics, checkpoints = run_dir / "metrics.jsonl", run_dir / "checkpoints"
    first = subprocess.Popen(
        [PYTHON, "-m", "paisoar_jax.train"]
        + train_arguments(run_dir, "train.steps=100000", "run.progress=false"),
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: checkpoints.is_dir() and "2" in os.listdir(checkpoints), first)
        before, newest = metrics.read_text(), newest_step(checkpoints)
        second = run_module(
            "train", *train_arguments(run_dir, "train.steps=4"), cwd=tmp_path, timeout=120
        )
        assert second.returncode == 2, second.stderr[-3000:]
        line = second.stderr.strip().splitlines()[-1]
        assert line.startswith(f"paisoar_jax.train: error: run.dir {run_dir} is in use by ")
        assert f"pid {first.pid}, since" in line
        assert metrics.read_text().startswith(before)  # the first run's metrics go on untouched
        assert newest_step(checkpoints) >= newest  # its saves go on (the oldest rotate out)
        assert not (run_dir / "checkpoints-superseded").exists()
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    saved = newest_step(checkpoints)
    third = run_module(
        "train", *train_arguments(run_dir, f"train.steps={saved + 2}"), cwd=tmp_path, timeout=180
    )
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"resumed from step {saved}" in third.stdout


@pytest.mark.slow
@pytest.mark.parametrize("why", ["held", "unwritable"])
def test_every_process_of_a_launch_stops_when_process_0_cannot_take_the_directory(tmp_path, why):
    run_dir = tmp_path / "run" if why == "held" else pathlib.Path("/dev/null/run")
    expected = "is in use by another run" if why == "held" else "is not writable"
    with contextlib.ExitStack() as hold:
        if why == "held":
            run_dir.mkdir()
            hold.enter_context(RunLock(run_dir))
        result = run_module(
            "launch",
            *("--nproc", "2", "--devices-per-proc", "4", "--"),
            *train_arguments(run_dir, "train.steps=2"),
            cwd=tmp_path,
            timeout=180,
        )
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"[rank 0] paisoar_jax.train: error: run.dir {run_dir} {expected}" in result.stderr
    assert "[rank 1] paisoar_jax.train: error: process 0 could not take run.dir" in (
        result.stderr
    )  # both stop at once: neither waits in a collective for the other
    assert "Traceback" not in result.stderr
    if why == "held":
        assert not (run_dir / "metrics.jsonl").exists()
