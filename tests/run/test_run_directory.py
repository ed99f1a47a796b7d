"""paisoar_jax/run/run_directory.py: a run directory deleted mid-run costs no training."""

import json
import re
import shutil
import subprocess
import time

from conftest import PYTHON, TINY, subprocess_env

from paisoar_jax.run.run_directory import vanished

RUN = [*TINY, "train.steps=150", "train.log_every=5", "train.eval_every=0", "checkpoint.every=20"]


def run_until_step_then(tmp_path, step, damage):
    """Starts a run, does `damage(run_dir)` once step `step` is logged; (status, output)."""
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [PYTHON, "-m", "paisoar_jax.train", *RUN, f"run.dir={run_dir}"],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.exists() and f'"step": {step},' in metrics.read_text()):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
        time.sleep(0.01)
    damage(run_dir)
    out = process.communicate(timeout=240)[0]
    return process.returncode, out, run_dir


def remove(run_dir):
    shutil.rmtree(run_dir, ignore_errors=True)  # (a save may be writing into it)
    shutil.rmtree(run_dir, ignore_errors=True)


def test_a_deleted_run_directory_is_made_again_and_the_run_finishes_resumable(tmp_path):
    status, out, run_dir = run_until_step_then(tmp_path, 25, remove)
    assert status == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    said = [line for line in out.splitlines() if "vanished during the run" in line]
    assert len(said) == 1 and said[0].startswith(f"paisoar_jax: warning: {run_dir}"), out
    assert "metrics.jsonl goes on from here and the next checkpoint is saved there" in said[0]
    assert (run_dir / "config.yaml").read_text().startswith("# ") or "train:" in (
        run_dir / "config.yaml"
    ).read_text()
    assert 150 in [int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 150 and records[0]["step"] > 25


def test_a_run_directory_made_again_by_a_save_in_flight_still_counts_as_vanished(tmp_path):
    """Before: Orbax's save of step 20, in flight when the directory went, made its path again
    (checkpoints/20.orbax-checkpoint-tmp/...), so the run wrote on into deleted files unsaid."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "20.orbax-checkpoint-tmp").mkdir(parents=True)
    assert vanished(run_dir, run_dir / "checkpoints") == [run_dir]
    (run_dir / "config.yaml").write_text("train: {}\n")
    assert vanished(run_dir, run_dir / "checkpoints") == []
    assert vanished(run_dir, None) == []
    assert vanished(tmp_path / "elsewhere", None) == [tmp_path / "elsewhere"]


def test_a_run_directory_that_cannot_be_made_again_is_saved_elsewhere_in_one_line(tmp_path):
    def replace_with_a_file(run_dir):
        remove(run_dir)
        run_dir.write_text("not a directory")

    status, out, run_dir = run_until_step_then(tmp_path, 25, replace_with_a_file)
    assert status == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    error = [line for line in out.splitlines() if "error:" in line]
    assert len(error) == 1, out
    found = re.fullmatch(
        rf"paisoar_jax.train: error: cannot write {run_dir}/checkpoints \((.+)\); saved step "
        rf"(\d+) to (\S+) instead: move that directory's contents to {run_dir}/checkpoints "
        r"and run again to resume",
        error[0],
    )
    assert found, error[0]
    rescued = __import__("pathlib").Path(found.group(3))
    try:
        assert [p.name for p in rescued.iterdir()] == [found.group(2)]
    finally:
        shutil.rmtree(rescued.parent)
