"""The slow tier beside tests/parallel/test_context_parallel.py: longer runs, more settings.

Sequences split over mesh.context give one device's losses, gradients and steps.
"""

import numpy as np
import pytest
from test_context_parallel import LLAMA

from paisoar_jax.config import load_config


@pytest.mark.checks("resume", families=["zoo:llama"])
def test_a_run_resumes_exactly_on_another_context_split(tmp_path):
    """3 steps on mesh.context=4, resumed to 6 on context=2 = 6 steps straight."""
    from conftest import resumable_run

    settings = [*LLAMA, "mesh.data=2", "model.context_attention=ring"]
    straight = resumable_run(tmp_path / "straight", [*settings, "mesh.context=4"], 6)
    resumable_run(tmp_path / "cut", [*settings, "mesh.context=4"], 3)
    resumed = resumable_run(tmp_path / "cut", [*settings, "mesh.context=2", "mesh.fsdp=2"], 6)
    assert [resumed[step] for step in (4, 5, 6)] == pytest.approx(
        [straight[step] for step in (4, 5, 6)], rel=1e-5
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["precision.policy=bf16", "mesh.zero=3", "mesh.fsdp=2", "mesh.context=2"],
        ["precision.policy=fp16", "train.grad_accum=2", "mesh.context=4"]
        + ["model.context_attention=ring"],
        ["model.position=rotary", "model.scan_layers=false", "mesh.context=2", "mesh.tensor=2"],
    ],
    ids=["bf16-zero3", "fp16-accumulation-ring", "gpt-rotary-unrolled"],
)
def test_every_context_setting_trains_evaluates_and_samples(overrides, tmp_path):
    """A run through the training loop: steps, an eval and the closing sample, all split."""
    from conftest import TINY, run_records, train

    settings = [*TINY, "mesh.data=-1", "train.steps=4", "train.eval_every=2"]
    settings += ["train.sample_bytes=8", "train.log_every=1", f"run.dir={tmp_path}", *overrides]
    train(load_config(None, settings))
    records = run_records(tmp_path)
    assert all(np.isfinite(record["loss"]) for record in records if "loss" in record)
    assert any(np.isfinite(record.get("eval_loss", np.nan)) for record in records)
