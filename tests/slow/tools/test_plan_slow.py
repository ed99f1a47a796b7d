"""The slow tier beside tests/tools/test_plan.py: longer runs, more settings.

`python -m paisoar_jax.plan`: counted bytes against the formulas, on 8 CPU devices.
"""

import subprocess

import pytest
from conftest import PYTHON, subprocess_env
from test_plan import (
    FP32,
    LAYERS,
    VOCAB,
    WIDTH,
    block_params,
    in_layer_loops,
    plans,  # noqa: F401 (fixtures)
)


def test_data_parallel_all_reduces_the_gradients(plans):
    result = plans["data"]
    assert set(result["collectives"]) == {"all-reduce"}
    assert all(op["group_size"] == 8 for op in result["collective_ops"])
    # Gradient bytes, plus the tied embedding's second contribution, plus a few scalars.
    gradient_bytes = FP32 * result["param_count"]
    expected = gradient_bytes + FP32 * VOCAB * WIDTH
    assert 0 <= result["collectives"]["all-reduce"]["bytes"] - expected <= 64
    # The scan over layers runs its all-reduce once per layer: the trip count counts.
    assert in_layer_loops(result, "all-reduce") == FP32 * block_params(result) * LAYERS


def test_gradient_accumulation_reduces_every_micro_batch(plans):
    single, accumulated = plans["data"], plans["accumulate"]
    assert accumulated["collectives"]["all-reduce"]["bytes"] == pytest.approx(
        2 * single["collectives"]["all-reduce"]["bytes"], abs=64
    )
    # The layer scan nests inside the accumulation scan: 2 x 2 runs.
    assert max(op["count"] for op in accumulated["collective_ops"]) == 2 * LAYERS


def test_cli_prints_a_table_for_the_default_config(tmp_path):
    environment = subprocess_env()
    environment.pop("XLA_FLAGS", None)  # --devices alone must give the 8 devices
    completed = subprocess.run(
        [PYTHON, "-m", "paisoar_jax.plan", "--devices", "8", "mesh.fsdp=8", "--link", "100"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    table = completed.stdout
    for expected in ("mesh data=1 fsdp=8 tensor=1", "8 simulated cpu devices", "all-gather"):
        assert expected in table
    assert "scaling efficiency" in table and "100 GB/s" in table
    # Every parameter's sharding: FSDP splits the stacked MLP kernel over fsdp.
    assert "blocks.mlp_in_kernel" in table and "[-, fsdp, -]" in table
    assert len(table.splitlines()) < 60
