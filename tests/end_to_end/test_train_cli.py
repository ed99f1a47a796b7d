"""End to end through `python -m paisoar_jax.train`, as a user runs it."""

import subprocess

import pytest
from conftest import PYTHON, TINY, run_module, run_modules, subprocess_env

FIELDS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "loss_scale",
    "skipped_steps",
    "step_time_s",
    "tokens_per_s",
    "mfu",
    "data_wait_frac",
    "checkpoint_s",
}


def run_train(*args, cwd, timeout=300):
    return run_module("train", *args, cwd=cwd, timeout=timeout)


BAD_INPUTS = [
    (["train.stepz=3"], "unknown config key train.stepz"),
    (["train.steps=many"], "train.steps: expected int, got 'many'"),
    (["mesh.data=3"], "mesh data=3,fsdp=1,tensor=1 needs 3 devices, but 8 are present"),
    (
        ["mesh.data=8", "train.global_batch=12"],
        "train.global_batch=12 is not divisible by the 8 batch shards",
    ),
    (["mesh.data=1", "mesh.tensor=8"], "(heads, size 4) is not divisible by mesh tensor=8"),
    (
        ["mesh.data=1", "mesh.tensor=8", "model.heads=8", "model.mlp_width=100"],
        "(mlp, size 100) is not divisible by mesh tensor=8",
    ),
    (["--config", "missing.yaml"], "config file not found: missing.yaml"),
    (["model.attention=cudnn"], "model.attention=cudnn needs an NVIDIA GPU"),
    (["data.source=arrayrecord:/no/data"], "arrayrecord:/no/data: no such file or directory"),
    # Said of the key that names it (before: "data.eval_source: data.source=arrayrecord:...").
    (["data.eval_source=arrayrecord:/no/data"], "error: data.eval_source=arrayrecord:/no/data: no"),
    (["run.dir=/dev/null/run"], "run.dir /dev/null/run is not writable"),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Each bad input's run, all started at once: {args: CompletedProcess}."""
    cwd = tmp_path_factory.mktemp("refusals")
    commands = [("train", *TINY, *args) for args, _ in BAD_INPUTS]
    results = run_modules(commands, cwd=cwd, timeout=180)
    return {tuple(args): result for (args, _), result in zip(BAD_INPUTS, results, strict=True)}


@pytest.mark.parametrize("args, message", BAD_INPUTS)
def test_bad_input_gets_one_line_and_exit_2(refusals, args, message):
    result = refusals[tuple(args)]
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("paisoar_jax.train: error: ")
    assert message in lines[0]


def test_a_bad_key_is_refused_before_the_model_libraries_load(tmp_path):
    # A typo answers in a second: no flax, orbax or grain import (several seconds) first.
    program = (
        "import sys\n"
        "from paisoar_jax.train import main\n"
        "assert main(['train.stepz=1']) == 2\n"
        "loaded = [name for name in ('flax', 'orbax', 'grain') if name in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    completed = subprocess.run(
        [PYTHON, "-c", program],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "unknown config key train.stepz" in completed.stderr


@pytest.mark.checks("resume", families=["zoo:gpt"])
def test_a_run_resumed_by_a_new_process_continues_exactly(tiny_losses):
    """The command line's resume: cut at step 3 (its checkpoint), a new process to step 6;
    steps 4-6 give the losses of the uninterrupted run (tiny_losses: conftest.py's)."""
    whole = tiny_losses(steps=6, name="whole")
    tiny_losses(steps=3, name="cut")
    resumed = tiny_losses(steps=6, name="cut")
    assert list(resumed) == list(whole) == [1, 2, 3, 4, 5, 6]
    assert [resumed[step] for step in (4, 5, 6)] == [whole[step] for step in (4, 5, 6)]
