"""A loop of one's own over `prepare` stops on SIGTERM as fit does: it saves the step reached
and exits 0, and a fresh process loads its run directory."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[3]


OWN_LOOP = """
import pathlib, sys, time
sys.path.insert(0, {tests!r})
import paisoar_jax
from test_own_loop_safety import DATA, HELD_OUT, MLP, SETTINGS, loss

prepared = paisoar_jax.prepare(None, [*SETTINGS, "train.steps=100000", "run.dir=own"],
                               model=MLP, loss=loss, data=DATA, eval_data=HELD_OUT)
state = prepared.state
for step, batch in zip(range(prepared.start_step + 1, 100001), prepared.batches()):
    state, metrics = prepared.train_step(state, batch)
    stop = prepared.should_stop(step)
    if step % 4 == 0 or stop:
        prepared.log(step, metrics | prepared.evaluate(state, step))
        prepared.save(state)
    if step == 6:
        pathlib.Path("stepping").touch()
    if stop:
        print("stopped at", step, flush=True)
        break
    time.sleep(0.02)
prepared.close()
"""


def test_an_own_loop_stops_on_sigterm_after_saving_and_a_fresh_process_loads_it(tmp_path):
    script = tmp_path / "own_loop.py"
    script.write_text(OWN_LOOP.format(tests=str(REPO / "tests" / "run")))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    process = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, **pipes)
    deadline = time.monotonic() + 120
    while not (tmp_path / "stepping").exists() and process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    stopped = int(stdout.split("stopped at")[-1])
    saved = sorted(int(path.name) for path in (tmp_path / "own" / "checkpoints").iterdir()
                   if path.name.isdigit())  # fmt: skip
    assert saved[-1] == stopped and 4 in saved
    records = [json.loads(line) for line in (tmp_path / "own" / "metrics.jsonl").open()]
    assert records[-1]["step"] == stopped and "eval_loss" in records[-1]
    check = (
        "import paisoar_jax, sys; sys.path.insert(0, {tests!r}); "
        "from test_own_loop_safety import HELD_OUT, MLP; "
        "print(paisoar_jax.load('own', model=MLP)(HELD_OUT['x'][:2]).shape)"
    ).format(tests=str(REPO / "tests" / "run"))
    loaded = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert loaded.returncode == 0 and "(2, 4)" in loaded.stdout, loaded.stderr[-2000:]
