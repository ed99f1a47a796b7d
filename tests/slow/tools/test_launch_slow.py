"""The slow tier beside tests/tools/test_launch.py: longer runs, more settings.

`python -m paisoar_jax.launch` with real processes on 127.0.0.1 (CPU, gloo collectives).
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest
from conftest import PYTHON, losses, subprocess_env
from test_launch import (  # noqa: F401 (fixtures)
    RUN,
    TWO_PROCESSES,
    assert_same_losses,
    checkpoint_steps,
    cut_at_step_two,
    one_process_reference,
    one_process_run,
    run_launcher,
    start_launcher,
    stop_for_sure,
    train_one,
    train_two,
    two_process_run,
    wait_for_text,
)

from paisoar_jax.runtime.ports import free_port
from paisoar_jax.tools.plan import hlo


def test_arrayrecord_input_with_workers_is_the_same_on_two_processes(tmp_path, token_dataset):
    data = [f"data.source=arrayrecord:{token_dataset}", "train.steps=3", "checkpoint.enabled=false"]
    train_one(tmp_path / "one", *data, "data.workers=0")
    train_two(tmp_path / "two", *data, "data.workers=2")  # two grain workers per process
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert list(one) == list(two) == [1, 2, 3]
    np.testing.assert_allclose(list(two.values()), list(one.values()), rtol=1e-5)


def test_two_processes_skip_exactly_the_steps_one_process_skips(tmp_path, devices):
    # A scale at the edge of fp16 overflow: whether a step overflows depends on its data, and
    # every process must take the same decision from the gradients of the whole global batch.
    fp16 = [
        "precision.policy=fp16",
        "precision.initial_scale=1048576",
        "precision.growth_interval=2",
    ]
    run_dir = tmp_path / "run"
    train_two(run_dir, "train.steps=6", "checkpoint.enabled=false", *fp16)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reference = one_process_reference(devices, 6, fp16)
    trajectory = [(r["loss_scale"], r["skipped_steps"]) for r in records]
    assert trajectory == [(r["loss_scale"], int(r["skipped_steps"])) for r in reference]
    assert 0 < trajectory[-1][1] < 6  # some steps overflowed, some did not


def test_resume_with_the_same_process_count_continues_exactly(two_process_run, tmp_path):
    run_dir, _ = two_process_run
    resumed = cut_at_step_two(run_dir, tmp_path / "run")
    result = train_two(resumed, "train.steps=5")
    assert "resumed from step 2" in result.stdout
    assert losses(resumed) == losses(run_dir)  # bit for bit, the data order included


def test_checkpoint_of_one_process_resumes_in_two(one_process_run, tmp_path):
    resumed = cut_at_step_two(one_process_run, tmp_path / "run")
    result = train_two(resumed, "train.steps=5")
    assert "[rank 0] paisoar_jax: 0.12M params" in result.stdout
    assert "resumed from step 2" in result.stdout
    assert_same_losses(resumed, one_process_run)
    assert checkpoint_steps(resumed) == [2, 4, 5]


def test_a_killed_process_stops_the_launcher(tmp_path):
    log = tmp_path / "launcher.log"
    process = start_launcher(log, tmp_path / "run")
    try:
        rank_one = int(wait_for_text(log, r"rank 1: (\d+)", process).group(1))
        wait_for_text(log, r"\[rank 0\] paisoar_jax: .* compiled in", process)
        killed_at = time.monotonic()
        os.kill(rank_one, signal.SIGKILL)
        status = process.wait(timeout=60)
    finally:
        stop_for_sure(process)
    text = log.read_text()
    assert status == 128 + signal.SIGKILL, text[-3000:]
    assert time.monotonic() - killed_at < 30  # the grace (5 s) and some, not jax's 100 s
    assert "paisoar_jax.launch: rank 1 was killed by SIGKILL" in text
    assert "paisoar_jax.launch: last lines of rank 1:" in text
    # Its lines, or that it printed none (before: an empty block).
    after = text.split("paisoar_jax.launch: last lines of rank 1:\n", 1)[1].splitlines()
    assert after and after[0].startswith("  ") and after[0].strip(), text[-3000:]


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
def test_a_stop_signal_reaches_every_process_which_save_and_exit(tmp_path, signal_number):
    log, run_dir = tmp_path / "launcher.log", tmp_path / "run"
    process = start_launcher(log, run_dir)
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for_text(log, r"compiled in", process)
        while not (metrics.exists() and '"step": 2,' in metrics.read_text()):
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        process.send_signal(signal_number)
        status = process.wait(timeout=120)
    finally:
        stop_for_sure(process)
    text, name = log.read_text(), signal.Signals(signal_number).name
    # Ctrl-C ends the job with 130 (so `launch ... && export` stops), with no rank blamed.
    assert status == (130 if signal_number == signal.SIGINT else 0), text[-3000:]
    assert "stopping" not in text and "last lines of rank" not in text, text[-3000:]
    assert f"paisoar_jax.launch: {name}: passed on to the processes" in text
    stopped = re.search(rf"\[rank 0\] paisoar_jax: stopped by {name} after step (\d+); saved", text)
    assert stopped, text[-3000:]
    assert checkpoint_steps(run_dir) == [int(stopped.group(1))]


def test_a_stopped_rank_is_named_within_the_timeout_and_a_rerun_resumes(tmp_path):
    log, run_dir = tmp_path / "launcher.log", tmp_path / "run"
    timeout = 15
    with log.open("w") as output:
        process = subprocess.Popen(
            [PYTHON, "-m", "paisoar_jax.launch", *TWO_PROCESSES, "--timeout", str(timeout)]
            + ["--", *RUN, "mesh.dcn_data=2", "train.steps=100000", f"run.dir={run_dir}"],
            env=subprocess_env(),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    rank_one = None
    try:
        rank_one = int(wait_for_text(log, r"rank 1: (\d+)", process).group(1))
        while not ((run_dir / "checkpoints").is_dir() and checkpoint_steps(run_dir)):
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        os.kill(rank_one, signal.SIGSTOP)  # a frozen node or a hung driver looks the same
        stopped_at = time.monotonic()
        status = process.wait(timeout=180)
        elapsed = time.monotonic() - stopped_at
    finally:
        if rank_one is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank_one, signal.SIGKILL)
        stop_for_sure(process)
    text = log.read_text()
    assert status == 1, text[-3000:]
    assert elapsed < timeout + 20, elapsed  # the timeout, a beat, the 5 s grace and some
    named = re.search(
        r"paisoar_jax.launch: rank 1 \(pid \d+\) stopped making progress: no heartbeat for "
        r"\d+ s, last step (\d+); newest checkpoint: step (\d+) in (\S+) \(a rerun resumes "
        r"from it\); stopping every process; each rank's output is in (\S+)/logs$",
        text,
        re.MULTILINE,
    )
    assert named, text[-3000:]
    assert "rank 0 was killed" not in text and "Traceback" not in text  # the healthy rank
    assert text.rstrip().endswith(named.group(0))  # and nothing after it on the screen
    assert {path.name for path in (run_dir / "logs").iterdir()} == {"rank-0.log", "rank-1.log"}
    assert "[rank 0] paisoar_jax: 2 processes" in (run_dir / "logs" / "rank-0.log").read_text()
    newest = int(named.group(2))
    assert newest == max(checkpoint_steps(run_dir))
    result = train_two(run_dir, f"train.steps={newest + 2}")
    assert f"resumed from step {newest}" in result.stdout


def test_pipeline_stages_across_two_processes_equal_one_process(tmp_path):
    """mesh.dcn_stage=2: each process is one stage, both read the same rows of every batch
    (sharding.input_slot), and the stage-to-stage permutes cross the processes; the losses
    are the one-process pipeline's."""
    mesh = ["mesh.data=4", "model.layers=2", "train.steps=4"]
    result = run_launcher(
        *TWO_PROCESSES, "--", *RUN, *mesh, "mesh.dcn_stage=2", f"run.dir={tmp_path / 'two'}"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    train_one(tmp_path / "one", *mesh, "mesh.stage=2")
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(two) == [1, 2, 3, 4]
    assert two == pytest.approx(one, rel=1e-6)


def test_a_context_split_across_two_processes_equals_one_process(tmp_path):
    """mesh.dcn_context=2: each sequence's halves on the two processes, which read the same
    rows (sharding.input_slot); the ring's keys and values cross between them."""
    mesh = ["mesh.data=2", "mesh.context=2", "model.context_attention=ring", "train.steps=4"]
    result = run_launcher(
        *TWO_PROCESSES, "--", *RUN, *mesh, "mesh.dcn_context=2", f"run.dir={tmp_path / 'two'}"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    train_one(tmp_path / "one", "mesh.data=2", "mesh.context=4", *mesh[2:])
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(two) == [1, 2, 3, 4]
    assert two == pytest.approx(one, rel=1e-5)


def test_compressed_gradients_on_two_processes_equal_one_process(tmp_path):
    """mesh.grad_comm=int8 with error feedback: 2 processes x 4 devices (dcn_data=2) give
    the losses of the same compressed run on 1 process x 8 devices."""
    compressed = ["mesh.grad_comm=int8", "mesh.grad_comm_error_feedback=true", "train.steps=4"]
    train_two(tmp_path / "two", "mesh.data=4", *compressed)
    train_one(tmp_path / "one", "mesh.data=8", *compressed)
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(two) == [1, 2, 3, 4]
    assert two == pytest.approx(one, rel=1e-6)


def test_scope_dcn_keeps_the_exchange_inside_each_host_in_fp32(tmp_path):
    """grad_comm_scope=dcn on 2 processes: in the compiled train step the gradients are
    reduce-scattered and all-gathered in fp32 among each process's 4 devices, and only
    int8 crosses between the 2 processes; the losses stay within int8's rounding of fp32."""
    dump = tmp_path / "hlo"
    env = subprocess_env()
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"
    overrides = ["mesh.data=4", "mesh.dcn_data=2", "mesh.grad_comm=int8", "train.steps=3"]
    overrides += ["mesh.grad_comm_scope=dcn", f"run.dir={tmp_path / 'two'}"]
    result = subprocess.run(
        [PYTHON, "-m", "paisoar_jax.launch", *TWO_PROCESSES, "--", *RUN, *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (step_hlo, *_) = sorted(dump.glob("*jit_train_step*after_optimizations.txt"))
    found = {(op.kind, op.dtype, op.group_size) for op in hlo.collectives(step_hlo.read_text(), 8)}
    assert ("all-to-all", "s8", 2) in found and ("all-gather", "s8", 2) in found
    assert ("all-gather", "f32", 4) in found
    assert ("reduce-scatter", "f32", 4) in found or ("all-reduce", "f32", 4) in found
    assert not any(dtype == "s8" and size != 2 for _, dtype, size in found)
    train_one(tmp_path / "one", "mesh.data=8", "train.steps=3")
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert two == pytest.approx(one, rel=1e-3)


def test_two_launchers_given_skypilots_variables_train_like_one_process(one_process_run, tmp_path):
    """A SkyPilot task's `run:` on 2 nodes, here both on 127.0.0.1: the launcher takes
    --nnodes, --node-rank and the coordinator (the first node's address) from them."""
    port = free_port()
    run_dir = tmp_path / "run"
    launchers = []
    for rank in (0, 1):
        env = subprocess_env() | {
            "SKYPILOT_NODE_RANK": str(rank),
            "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
            "SKYPILOT_NUM_GPUS_PER_NODE": "0",
            "JAX_COORDINATOR_PORT": str(port),
        }
        command = [PYTHON, "-m", "paisoar_jax.launch", "--nproc", "1", "--devices-per-proc", "4"]
        command += ["--", *RUN, "mesh.dcn_data=2", "train.steps=5", f"run.dir={run_dir}"]
        launchers.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [launcher.communicate(timeout=300)[0] for launcher in launchers]
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs
    assert "2 processes (launcher), coordinator 127.0.0.1:" in outputs[0], outputs[0]
    assert_same_losses(run_dir, one_process_run)
