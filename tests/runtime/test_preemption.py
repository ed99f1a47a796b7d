"""Preemption with real processes: SIGTERM saves and exits 0, SIGINT (Ctrl-C) saves and exits
130, kill -9 loses nothing."""

import json
import signal
import subprocess
import time

import pytest
from conftest import PYTHON, TINY, subprocess_env

RUN = [
    *TINY,
    "train.steps=30",
    "train.log_every=5",
    "train.eval_every=0",
    "optim.warmup_steps=5",
]


def start(run_dir, *overrides):
    return subprocess.Popen(
        [PYTHON, "-m", "paisoar_jax.train", *RUN, f"run.dir={run_dir}", *overrides],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process, timeout=300, status=0):
    stdout, stderr = process.communicate(timeout=timeout)
    assert process.returncode == status, stderr[-3000:]
    return stdout


def losses(run_dir):
    """Per step: the loss, and the eval loss and loss-scale state where they are logged."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    fields = ("loss", "eval_loss", "loss_scale", "skipped_steps")
    return {
        record["step"]: tuple(record.get(field) for field in fields)
        for record in map(json.loads, lines)
    }


def wait_for(condition, process, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


# fp16 at the edge of overflow (some steps skipped), two micro-batches, eval: all must resume.
SCALED = [
    "precision.policy=fp16",
    "precision.initial_scale=1048576",
    "precision.growth_interval=4",
    "train.grad_accum=2",
    "train.eval_every=10",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Metrics of the uninterrupted run, per setting (computed once each)."""
    runs = {}

    def metrics(*overrides):
        if overrides not in runs:
            run_dir = tmp_path_factory.mktemp("reference") / "run"
            finish(start(run_dir, "checkpoint.enabled=false", *overrides))
            runs[overrides] = losses(run_dir)
        return runs[overrides]

    return metrics


def logged_step(run_dir, step):
    path = run_dir / "metrics.jsonl"
    return lambda: path.exists() and f'"step": {step},' in path.read_text()


@pytest.mark.parametrize(
    "signal_number, overrides",
    [
        pytest.param(signal.SIGTERM, ("data.workers=1",), marks=pytest.mark.slow),
        (signal.SIGINT, tuple(SCALED)),
    ],
    ids=["sigterm-workers", "sigint-fp16-accum-eval"],
)
def test_stop_signal_saves_and_resume_continues_exactly(
    reference, tmp_path, signal_number, overrides
):
    run_dir = tmp_path / "run"
    process = start(run_dir, "checkpoint.every=100", *overrides)
    wait_for(logged_step(run_dir, 10), process)
    process.send_signal(signal_number)
    # Ctrl-C is not a success: `train && export` must stop there (after the save).
    status = 130 if signal_number == signal.SIGINT else 0
    last_line = finish(process, status=status).strip().splitlines()[-2]  # then the summary line
    name = signal.Signals(signal_number).name
    assert last_line.startswith(f"paisoar_jax: stopped by {name} after step "), last_line
    stopped_at = int(last_line.split("after step ")[1].split(";")[0])
    assert f"saved step {stopped_at} to" in last_line and stopped_at < 30
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [stopped_at]

    resumed = finish(start(run_dir, "checkpoint.every=100", *overrides))
    assert f"resumed from step {stopped_at}" in resumed
    # The summary counts this process's steps apart from the checkpoint's.
    assert f"done: 30 steps ({30 - stopped_at} this run, resumed from {stopped_at}) in" in resumed
    assert losses(run_dir) == reference(*overrides)  # bit for bit, data order included
    if overrides == tuple(SCALED):  # the loss-scale state really had something to resume
        final = reference(*overrides)[30]
        assert final[1] is not None and final[3] > 0, final


# A process whose main thread sits in a call that never returns to Python (as in an XLA
# compile): only the StopRequest's watcher thread can act on a signal there.
STOP_SCRIPT = """
import signal, sys, time
from paisoar_jax.runtime.preemption import StopRequest

stepping = sys.argv[1] == "stepping"
with StopRequest(lambda: "last saved: step 7 in somewhere") as stop:
    stop.stepping = stepping
    print("ready", flush=True)
    if not stepping:
        time.sleep(120)  # the compile that will not be waited for
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not stop.requested:
        time.sleep(0.01)
    time.sleep(float(sys.argv[2]))  # the step and its save, while more signals come
    print("stopping for", stop.signal_name, flush=True)
"""


def start_stop_script(tmp_path, *arguments):
    (tmp_path / "stop.py").write_text(STOP_SCRIPT)
    process = subprocess.Popen(
        [PYTHON, str(tmp_path / "stop.py"), *arguments],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "ready\n", process.communicate()
    return process


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
def test_a_signal_before_the_first_step_ends_the_process_at_once(tmp_path, signal_number):
    process = start_stop_script(tmp_path, "starting", "0")
    sent = time.monotonic()
    process.send_signal(signal_number)
    stdout, stderr = process.communicate(timeout=30)
    assert time.monotonic() - sent < 5  # not the 120 s the main thread would still take
    assert process.returncode == 128 + signal_number, stderr
    name = signal.Signals(signal_number).name
    assert stdout.strip() == (
        f"paisoar_jax: {name} before the first step finished: nothing new to save "
        "(last saved: step 7 in somewhere); exiting"
    )


def test_any_number_of_sigterms_in_any_rhythm_stop_once(tmp_path):
    process = start_stop_script(tmp_path, "stepping", "1.5")
    for pause in (0.3, 0.0, 0.05, 0.6, 0.3):  # a scheduler, a launcher, a script's trap ...
        process.send_signal(signal.SIGTERM)
        time.sleep(pause)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert stdout.splitlines() == [
        "paisoar_jax: SIGTERM: saving after this step, then the run ends",
        "stopping for SIGTERM",
    ]


def test_two_ctrl_c_wait_for_the_save_and_a_third_aborts_naming_the_saved_step(tmp_path):
    process = start_stop_script(tmp_path, "stepping", "1.6")
    process.send_signal(signal.SIGINT)
    time.sleep(0.6)
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGINT)  # the same press (a terminal's group and a launcher)
    time.sleep(0.3)
    assert process.poll() is None  # two presses: it still saves
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert stdout.splitlines() == [
        "paisoar_jax: SIGINT: saving after this step, then the run ends (Ctrl-C twice more aborts)",
        "paisoar_jax: Ctrl-C pressed 3 times: aborting without saving this step "
        "(last saved: step 7 in somewhere)",
    ]


def test_two_sigterms_during_training_save_the_step_reached_once(tmp_path):
    """Before: the second SIGTERM restored the default handler and killed the run unsaved."""
    run_dir = tmp_path / "run"
    process = start(run_dir, "checkpoint.every=100")
    wait_for(logged_step(run_dir, 5), process)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    process.send_signal(signal.SIGTERM)
    stdout = finish(process, status=0)
    stopped = [line for line in stdout.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(stopped) == 1, stdout
    stopped_at = int(stopped[0].split("after step ")[1].split(";")[0])
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [stopped_at]


AFTER_THE_SAVE = """
import os, signal, time
from paisoar_jax.runtime.preemption import StopRequest, stop_saved

with StopRequest(speaks=False) as stop:
    stop.stepping = True
    os.kill(os.getpid(), signal.SIGTERM)
    while not stop.requested:
        time.sleep(0.01)
    stop_saved(stop.signal_name)  # what the loop says once the stop's save committed
print("after", flush=True)
time.sleep(60)  # the summary, the interpreter's exit ...
"""


def test_a_signal_after_the_stop_was_saved_ends_with_that_stops_status(tmp_path):
    """Before: the handlers went back to the defaults while the process was ending, so a
    second SIGTERM 0.7 s after the first ended a run that had saved with 143, not 0."""
    (tmp_path / "after.py").write_text(AFTER_THE_SAVE)
    process = subprocess.Popen(
        [PYTHON, str(tmp_path / "after.py")],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "after\n", process.communicate()
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert stdout.strip().splitlines()[-1] == (
        "paisoar_jax: SIGTERM: the run already saved for SIGTERM; exiting"
    )
