"""The slow tier beside tests/end_to_end/test_restarts.py: longer runs, more settings.

`launch --max-restarts`: real 2-process jobs on 127.0.0.1 that lose a rank and heal.
"""

import os
import re
import signal
import subprocess

from conftest import subprocess_env
from test_restarts import (
    FAILING_SCRIPT,
    LAUNCH,
    STEPS,
    events,
    finish,
    rank_one_after_checkpoint,
    run_losses,
    start,
    uninterrupted,  # noqa: F401 (fixtures)
)


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
    assert run_losses(run_dir) == uninterrupted  # bit for bit
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
    assert run_losses(run_dir) == uninterrupted
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
