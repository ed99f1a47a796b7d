"""`launch --max-restarts`: real 2-process jobs on 127.0.0.1 that lose a rank and heal.

A rank killed (SIGKILL) or frozen (SIGSTOP) part-way through a 40-step run; the job comes
back from its newest checkpoint and ends with the losses of a run that was never cut,
bit for bit. The uninterrupted run is made once and shared.
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest
from conftest import PYTHON, RESUMABLE, losses, subprocess_env

from paisoar_jax.tools.launch import command as launch
from paisoar_jax.tools.launch import restarts
from paisoar_jax.tools.launch.rank_output import Output

STEPS = 40
RUN = [*RESUMABLE, "checkpoint.keep=3", "mesh.dcn_data=2", f"train.steps={STEPS}"]
LAUNCH = [PYTHON, "-m", "paisoar_jax.launch", "--nproc", "2", "--devices-per-proc", "4"]
RESTARTING = [*LAUNCH, "--grace", "5", "--max-restarts", "2", "--restart-backoff", "0.5"]


def run_losses(run_dir):
    """{step: loss} of the run's metrics.jsonl (one record per step after any resume)."""
    return losses(run_dir, STEPS)


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The losses of the same 2-process job, never cut."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = subprocess.run(
        [*LAUNCH, "--", *RUN, f"run.dir={run_dir}"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run_losses(run_dir)


def start(log, *arguments):
    with log.open("w") as output:
        return subprocess.Popen(
            [*RESTARTING, "--", *RUN, *arguments],
            env=subprocess_env(),
            stdout=output,
            stderr=subprocess.STDOUT,
        )


def rank_one_after_checkpoint(log, run_dir, process, step=4):
    """Rank 1's pid, once the checkpoint of `step` is complete."""
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / str(step)).is_dir():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    return int(re.search(r"rank 1: (\d+)", log.read_text()).group(1))


def finish(process, timeout=300):
    try:
        return process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_user_error_is_never_retried(tmp_path):
    """Status 2 (here a bad setting each rank finds) would fail again: no restart."""
    result = subprocess.run(
        [*RESTARTING, "--", *RUN, "train.steps=0", f"run.dir={tmp_path / 'run'}"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "train.steps must be >= 1" in result.stderr
    assert "restart" not in result.stderr


FAILING_SCRIPT = """
import os, time
import paisoar_jax

paisoar_jax.initialize()
if os.environ["PAISOAR_PROCESS_ID"] == "1":
    open("/no/such/shard-00001.arrayrecord")  # the cause
time.sleep(1.5)  # rank 0 fails after it, with an error of its own, and exits first
raise RuntimeError("a collective aborted: a peer is gone")
"""


def test_a_signal_to_the_launcher_ends_the_series_without_a_restart(capsys):
    """A preemption's SIGTERM that also killed a rank is the user's stop, not a failure."""
    attempts = []

    def attempt(signals):
        attempts.append(1)
        os.kill(os.getpid(), signal.SIGTERM)  # recorded by the series' SignalLog
        deadline = time.monotonic() + 5
        while not signals.received and time.monotonic() < deadline:
            time.sleep(0.01)
        return restarts.Ending(128 + signal.SIGKILL, "rank 1 was killed by SIGKILL", 1, True)

    assert restarts.run_with_restarts(attempt, max_restarts=3, backoff_s=0) == 137
    assert attempts == [1]
    assert "restart" not in capsys.readouterr().err


def test_a_divergence_is_named_first_and_not_retried(tmp_path):
    """Rank 1 recorded a divergence (not retryable); rank 0 failed after it."""

    def child(rank, beat):
        path = tmp_path / f"rank-{rank}.json"
        path.write_text(json.dumps({"time": time.time(), "step": 3, **beat}))
        return launch.Child(rank, subprocess.Popen(["sh", "-c", f"exit {1 + rank}"]), path)

    diverged = {"error": "the loss is nan at step 3", "failed_at": 100.0, "retryable": False}
    children = [child(0, {"error": "a collective aborted", "failed_at": 101.0}), child(1, diverged)]
    for each in children:
        each.process.wait()
    ending = launch._fail(children[0], children, grace=1, screen=Output())
    assert ending.rank == 1 and ending.cause == "rank 1 failed first: the loss is nan at step 3"
    assert not ending.retry
