"""The slow tier beside tests/parallel/test_pipeline.py: longer runs, more settings.

Pipeline parallelism: pipelined steps equal one device's, bytes and bubble as the formulas.
"""

import jax
import numpy as np
import pytest
from conftest import (
    assert_steps_match,
    assert_trees_close,
    build_run,
    token_batches,
)
from test_pipeline import (
    GPT4,
    GPT8,
    LLAMA4,
    VIT,
    check_zoo_model,
    one_device,
    run_steps,
    three_steps,
    vit_losses,
)

from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError


# In the slow tier: the fast tier's pipelined-equals-flat check is a model of one's own.
@pytest.mark.parametrize(
    "model, mesh",
    [
        (GPT4, ["mesh.data=4", "mesh.stage=2"]),  # gpipe, 4 micro-batches
        (GPT4, ["mesh.data=2", "mesh.stage=4"]),  # gpipe, 8 micro-batches
        (GPT4, ["mesh.data=4", "mesh.stage=2", "train.pipeline_repeats=2"]),  # circular
        (GPT8, ["mesh.data=2", "mesh.stage=4", "train.pipeline_repeats=2"]),  # circular
        (GPT4, ["mesh.data=1", "mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2"]),
        (LLAMA4, ["mesh.data=1", "mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    ],
)
def test_pipelined_steps_equal_one_device(model, mesh, devices):
    """Losses and gradients of 3 steps, and the params they lead to, to float tolerance."""
    losses, grads, params = three_steps([*model, *mesh], devices)
    reference_losses, reference_grads, reference_params = one_device(model)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    assert_trees_close(grads, reference_grads, rtol=1e-4)
    assert_steps_match(params, reference_params)


@pytest.mark.parametrize(
    "overrides",
    [
        ["mesh.zero=1", "precision.policy=bf16", "train.grad_accum=2", "remat.policy=full"],
        ["mesh.zero=3", "mesh.fsdp=2", "train.pipeline_microbatches=2", "remat.policy=dots"],
        ["precision.policy=fp16", "train.pipeline_microbatches=8"],
    ],
)
def test_it_composes_with_zero_accumulation_remat_and_half_precision(overrides, devices):
    """Each setting trains pipelined and gives the unpipelined run's losses."""
    model = ["model.layers=4", "train.global_batch=32"]
    pipelined, _, _ = three_steps([*model, "mesh.stage=2", *overrides], devices)
    unpipelined = [override for override in overrides if "pipeline" not in override]
    flat, _, _ = three_steps([*model, *unpipelined], devices)
    np.testing.assert_allclose(
        pipelined, flat, rtol=2e-3 if "precision" in str(overrides) else 1e-5
    )


def test_an_overflow_skips_the_step_on_every_stage(devices):
    """fp16 with a scale that overflows: one global decision, and the state stays as it was."""
    overrides = ["mesh.stage=2", "precision.policy=fp16", "precision.loss_scale=static:1e30"]
    _, mesh, _, state, train_step = build_run(["model.layers=4", *overrides], devices)
    before = jax.device_get(state.params)
    with jax.set_mesh(mesh):
        state, metrics = train_step(state, token_batches(1)[0])
    assert float(metrics["skipped_steps"]) == 1
    after = jax.tree.leaves(jax.device_get(state.params))
    for new, old in zip(after, jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(new, old)


@pytest.mark.parametrize(
    "first, second",
    [(["mesh.stage=2", "mesh.data=4"], ["mesh.data=8"]), (["mesh.data=8"], ["mesh.stage=4"])],
)
def test_a_checkpoint_resumes_with_or_without_stages(first, second, tmp_path):
    """Steps 4-6 after a resume onto the other mesh equal the run that kept its mesh."""
    uninterrupted = run_steps(tmp_path / "whole", first, 6)
    run_steps(tmp_path / "split", first, 3)
    resumed = run_steps(tmp_path / "split", second, 6)
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5)


@pytest.mark.checks("sharded", families=["zoo:vit"])
def test_a_pipelined_vit_trains_as_one_device_does(tmp_path):
    pipelined = vit_losses(tmp_path / "staged", ["mesh.stage=2", "mesh.data=4"])
    flat = vit_losses(tmp_path / "flat", ["mesh.data=8"])
    assert len(pipelined) == 3
    np.testing.assert_allclose(pipelined, flat, rtol=1e-5)
    with pytest.raises(UserError, match="set model.scan_layers=true"):
        check_zoo_model(load_config(None, [*VIT, "model.scan_layers=false", "mesh.stage=2"]))
    with pytest.raises(UserError, match=r"model.depth \(vit_tiny\)=4 does not split"):
        check_zoo_model(load_config(None, [*VIT, "mesh.stage=3", "train.pipeline_microbatches=4"]))
