"""The slow tier beside tests/runtime/test_run_lock.py: longer runs, more settings.

One run per run directory: a second start stops, a dead holder does not block the next.
"""

import contextlib
import os
import pathlib
import signal
import subprocess

import pytest
from conftest import PYTHON, run_module, subprocess_env
from test_run_lock import newest_step, train_arguments, wait_until

from paisoar_jax.runtime.run_lock import RunLock


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
