"""Steps compiled for an 8 x H200 target on this CPU machine (tools/plan/gpu_target.py): what
the GPU compiler makes of them. The gpu_aot tier (`python -m pytest -m gpu_aot`, with the gpu-aot
extra's CUDA plugin); the first tests run in any environment."""

import functools
import os
import subprocess

from conftest import PYTHON, REPO, subprocess_env

from paisoar_jax.tools.plan import gpu_target

CONFIGS = sorted(path.stem for path in (REPO / "configs").glob("*.yaml"))
SMALL = ["train.global_batch=8"]  # per config: the shapes are the config's


def test_the_targets_describe_the_published_devices():
    h200, h100 = gpu_target.DEVICES["h200"], gpu_target.DEVICES["h100"]
    assert h200.memory_bytes > 140e9 > h100.memory_bytes > 80e9
    text = gpu_target.target_config(h200)
    assert "core_count: 132" in text and "major: 9 minor: 0" in text
    assert 'device_description_str: "NVIDIA H200 141GB HBM3e"' in text


def test_a_real_device_kind_names_its_target():
    """What bench and plan on a GPU read from jax's device_kind."""
    assert gpu_target.target_of("NVIDIA H200") == "h200"
    assert gpu_target.target_of("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_target.target_of("NVIDIA A100-SXM4-80GB") is None
    assert gpu_target.target_of("cpu") is None


def test_a_missing_plugin_is_one_line(tmp_path):
    """Without the CUDA plugin (this environment, unless it is the gpu-aot one)."""
    env = subprocess_env()
    if (
        "jax_plugins.xla_cuda12"
        in subprocess.run(
            [
                PYTHON,
                "-c",
                "import pkgutil, jax_plugins; print([m.name for m in "
                "pkgutil.iter_modules(jax_plugins.__path__, 'jax_plugins.')])",
            ],
            env=env,
            capture_output=True,
            text=True,
        ).stdout
    ):
        env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
        (tmp_path / "jax_plugins").mkdir()  # hides the installed plugins from this run
        (tmp_path / "jax_plugins" / "__init__.py").write_text("")
    result = subprocess.run(
        [PYTHON, "-m", "paisoar_jax.plan", "--target", "h200", "model.layers=1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install "paisoar-jax[gpu-aot]"' in lines[0], lines


@functools.cache
def target_plan(config_name: str, *overrides: str) -> dict:
    """The plan of a shipped config (and overrides) on 8 x H200, compiled once per run."""
    from paisoar_jax.config import load_config
    from paisoar_jax.tools import plan

    config = load_config(REPO / "configs" / f"{config_name}.yaml", [*SMALL, *overrides])
    devices = gpu_target.target_devices("h200", 1, 8)
    return plan.plan(config, devices, target="h200")


PEER_TEMPORARIES = 10_810_937_888  # ../shared/peers/gpt_jax.py at B16 T1024 on one H200
# (benchmarks/peer_side_by_side.py, 2026-12-04): the hand-written step measured at 34.95 ms


# ../shared/peers/gpt_jax.py at gpt_1b's shape (L24 D2048 T2048 B8) on one H200, compiled
# with params and optimizer state donated, as ours are (benchmarks/peer_side_by_side.py
# --rows gpt_1b, commit 91d6e9d): its temporaries and its device memory in all. As written
# it holds 26.5 GiB of temporaries and a second copy of the state, where XLA puts
# activations (55.9 GiB in all).
PEER_1B_DONATED_TEMPORARIES = 39_942_602_272
PEER_1B_DONATED_TOTAL = 55_732_574_616
