"""Test setup: 8 simulated CPU devices (set before jax is imported) and shared helpers."""

import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compile once per machine: repeated test runs reuse the compiled programs.
CACHE_DIR = pathlib.Path(os.environ.get("PAISOAR_TEST_CACHE", "/tmp/paisoar_jax_test_cache"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE_DIR))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import absl.flags  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

# grain worker processes read absl flags; they must count as parsed once jax is imported.
absl.flags.FLAGS.mark_as_parsed()

REPO = pathlib.Path(__file__).resolve().parents[1]

# A model small enough to compile in seconds, big enough for every mesh in the tests
# (width and MLP divide by 8, heads by 2).
TINY = [
    "model.seq_len=32",
    "model.layers=2",
    "model.width=64",
    "model.heads=4",
    "train.global_batch=16",
    "train.sample_bytes=0",
    "run.progress=false",
    "run.tensorboard=false",
]

# The image counterpart: a ResNet-18 with 8 base channels on 16 px synthetic images.
TINY_RESNET = [
    "model.name=resnet",
    "model.variant=resnet18",
    "model.width=8",
    "model.image_size=16",
    "model.num_classes=10",
    "data.source=synthetic",
    "optim.name=sgd",
    "optim.lr=0.1",
    "train.global_batch=16",
    "run.progress=false",
    "run.tensorboard=false",
]


def subprocess_env() -> dict[str, str]:
    """Environment for `python -m paisoar_jax.*` children: 8 CPU devices, shared cache."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="session")
def devices():
    devices = jax.devices()
    assert len(devices) == 8, "tests expect 8 simulated CPU devices"
    return devices


PYTHON = sys.executable


def run_module(module, *args, cwd, timeout=300):
    """Runs `python -m paisoar_jax.<module> args...` as a user would; the CompletedProcess."""
    import subprocess

    return subprocess.run(
        [PYTHON, "-m", f"paisoar_jax.{module}", *args],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def plan_run(overrides, devices, base=TINY):
    """(config, mesh, layout, schedule) for TINY + overrides on `devices`: no arrays yet."""
    from paisoar_jax.config import load_config
    from paisoar_jax.workload import setup
    from paisoar_jax.zoo import zoo_workload

    config = load_config(None, list(base) + list(overrides))
    run = setup(config, zoo_workload(config), devices)
    return config, run.mesh, run.layout, run.schedule


def build_run(overrides, devices, base=TINY):
    """(config, mesh, layout, state, train_step) for TINY + overrides on `devices`."""
    from paisoar_jax.state import init_state
    from paisoar_jax.step import jit_train_step
    from paisoar_jax.zoo import task_for

    config, mesh, layout, schedule = plan_run(overrides, devices, base)
    with jax.set_mesh(mesh):
        state = init_state(config, layout)
        task = task_for(config)
        train_step = jit_train_step(layout, task, schedule, config.train.grad_accum, mesh)
    return config, mesh, layout, state, train_step


def resumable_run(run_dir, overrides, steps):
    """{step: loss} of a TINY + overrides run to `steps` in run_dir (resuming what is there).

    It logs every step and saves every 3, with a constant learning rate, so a run cut at 3
    and resumed to 6 follows the schedule of one run of 6.
    """
    from paisoar_jax.config import load_config
    from paisoar_jax.loop import train

    settings = [*TINY, *overrides, f"train.steps={steps}", "train.log_every=1"]
    settings += ["train.eval_every=0", "checkpoint.every=3", f"run.dir={run_dir}"]
    # The same learning rates however long the run: no warmup (it is min(warmup, steps)).
    settings += ["optim.schedule=constant", "optim.warmup_steps=0"]
    train(load_config(None, settings))
    return {record["step"]: record["loss"] for record in run_records(run_dir)}


def token_batches(count, batch=16, seq_len=32, seed=0):
    """Fixed random int32 token batches of shape (batch, seq_len + 1)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (batch, seq_len + 1), dtype=np.int32) for _ in range(count)]


def run_records(run_dir):
    """The records of run_dir/metrics.jsonl, in order."""
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="session")
def token_dataset(tmp_path_factory):
    """A converted byte-level dataset of a few standard-library files, in 2 shards."""
    import sysconfig

    from paisoar_jax.tools.convert import main as convert

    root = pathlib.Path(sysconfig.get_paths()["stdlib"]) / "json"
    output = tmp_path_factory.mktemp("tokens") / "dataset"
    status = convert(
        ["text", "--input", str(root / "*.py"), "--output", str(output), "--shards", "2"]
    )
    assert status == 0
    return output
