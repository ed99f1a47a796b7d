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
from conftest import PYTHON, RESUMABLE, subprocess_env

from paisoar_jax.tools.launch import command as launch
from paisoar_jax.tools.launch import restarts
from paisoar_jax.tools.launch.rank_output import Output

STEPS = 40
RUN = [*RESUMABLE, "checkpoint.keep=3", "mesh.dcn_data=2", f"train.steps={STEPS}"]
LAUNCH = [PYTHON, "-m", "paisoar_jax.launch", "--nproc", "2", "--devices-per-proc", "4"]
RESTARTING = [*LAUNCH, "--grace", "5", "--max-restarts", "2", "--restart-backoff", "0.5"]


def losses(run_dir):
    """{step: loss} of the run's metrics.jsonl (one record per step after any resume)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    return {record["step"]: record["loss"] for record in records}


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
    return losses(run_dir)


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


@pytest.mark.slow
def test_a_killed_rank_restarts_the_job_which_ends_as_if_uninterrupted(tmp_path, uninterrupted):
    """SIGKILL on rank 1 after step 4 was saved: one restart, the same 40 losses.

    Also how the job reads where no terminal is: the progress bar draws lines (run.progress
    on, output into a file), and the collectives' connection chatter stays in the logs.
    """
    log, run_dir = tmp_path / "launcher.log", tmp_path / "run"
    process = start(log, f"run.dir={run_dir}", "run.progress=true")
    os.kill(rank_one_after_checkpoint(log, run_dir, process), signal.SIGKILL)
    status = finish(process)
    text = log.read_text()
    assert status == 0, text[-3000:]
    assert losses(run_dir) == uninterrupted  # bit for bit
    [event] = events(run_dir)
    assert event["event"] == "restart" and event["cause"] == "rank 1 was killed by SIGKILL"
    assert event["rank"] == 1 and event["exit_status"] == 128 + signal.SIGKILL
    assert event["attempt"] == 1 and event["max_restarts"] == 2 and event["resume_step"] >= 4
    restart = re.findall(r"^paisoar_jax.launch: restart .*$", text, re.MULTILINE)
    assert restart == [
        f"paisoar_jax.launch: restart 1 of 2 in 0.5 s, resuming from step "
        f"{event['resume_step']}: rank 1 was killed by SIGKILL"
    ]
    assert f"resumed from step {event['resume_step']}" in text
    # Not a terminal: no carriage returns, the bar's lines carry the step and the loss.
    assert "\r" not in text
    assert re.search(rf"\[rank 0\] train: .*\| *\d+/{STEPS} \[.*loss=", text), text[-3000:]
    assert "[Gloo]" not in text
    assert "[Gloo] Rank" in (run_dir / "logs" / "rank-0.log").read_text()


@pytest.mark.slow
def test_a_frozen_rank_is_caught_by_the_watchdog_and_the_job_restarts(tmp_path, uninterrupted):
    """SIGSTOP on rank 1: rank 0's steps stop finishing; its watchdog (8 s) says so, asks
    for a save it cannot get (the peer is frozen) and exits with status 3; the launcher
    names the frozen rank and restarts the job, which ends with the uninterrupted losses."""
    log, run_dir = tmp_path / "launcher.log", tmp_path / "run"
    process = start(log, f"run.dir={run_dir}", "train.hang_timeout_s=8")
    rank_one = rank_one_after_checkpoint(log, run_dir, process)
    os.kill(rank_one, signal.SIGSTOP)
    status = finish(process)
    text = log.read_text()
    assert status == 0, text[-3000:]
    assert losses(run_dir) == uninterrupted
    rank_zero = (run_dir / "logs" / "rank-0.log").read_text()
    said = re.search(
        r"\[rank 0\] paisoar_jax: error: process 0 of 2: no step finished in 8 s "
        r"\(train.hang_timeout_s\); last step (\d+), waiting in: (\w+); asking for a save, "
        r"exiting with status 3 if none comes within another 8 s",
        rank_zero,
    )
    assert said, rank_zero[-3000:]
    [event] = events(run_dir)
    assert event["event"] == "restart" and event["rank"] == 1, event
    assert event["cause"].startswith("rank 1 stopped making progress (last step"), event


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


@pytest.mark.slow
def test_the_rank_that_failed_first_is_named_and_exhausted_restarts_end_with_the_cause(
    tmp_path,
):
    """Rank 1 raises after joining; rank 0 fails after it. Each attempt names rank 1 with
    its own error; after the one restart allowed, the launcher gives up with that cause."""
    script = tmp_path / "job.py"
    script.write_text(FAILING_SCRIPT)
    result = subprocess.run(
        [*LAUNCH, "--grace", "2", "--max-restarts", "1", "--restart-backoff", "0"]
        + ["--", "python", str(script)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    text = result.stderr
    assert result.returncode == 1, text[-3000:]
    cause = "FileNotFoundError: [Errno 2] No such file or directory: '/no/such/shard-00001"
    named = re.findall(
        r"^paisoar_jax.launch: rank (\d) (?:failed first|exited .*?): (.*);", text, re.M
    )
    assert len(named) == 2 and all(rank == "1" and cause in line for rank, line in named), text
    assert "paisoar_jax.launch: restart 1 of 1 in 0 s, from the start: rank 1" in text
    gave_up = re.search(
        r"^paisoar_jax.launch: error: giving up after 1 restart\(s\): (.*)$", text, re.M
    )
    assert gave_up and cause in gave_up.group(1), text[-3000:]
    assert "last lines of rank 0" not in text


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
