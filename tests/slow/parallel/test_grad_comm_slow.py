"""The slow tier beside tests/parallel/test_grad_comm.py: longer runs, more settings.

Compressed gradient exchange: bytes and dtypes in the HLO, fp32 sums, losses, resume.
"""

import jax
import numpy as np
import pytest
from conftest import build_run, token_batches
from test_grad_comm import EF, final_eval_loss, run_steps, saved_residual, steps


@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.data=8"],
        ["mesh.data=8", "mesh.zero=1", "train.grad_accum=2"],
        ["mesh.data=4", "mesh.fsdp=2", "mesh.zero=3"],
        ["mesh.data=4", "mesh.tensor=2", "precision.policy=bf16"],
    ],
)
def test_compressed_steps_follow_the_fp32_steps(mesh, devices):
    """Losses of 3 steps (the first is the same forward pass) within rounding of fp32's."""
    reference, _ = steps(mesh, devices)
    for dtype, tolerance in (("bf16", 1e-4), ("int8", 1e-3)):
        losses, _ = steps([*mesh, f"mesh.grad_comm={dtype}"], devices)
        assert losses[0] == pytest.approx(reference[0], rel=1e-6)
        assert losses == pytest.approx(reference, rel=tolerance)


def test_an_fp16_overflow_skips_the_step_and_keeps_the_residual(devices):
    """A scale that overflows: the fp32 sum is non-finite, the step is skipped on every
    device, params and error-feedback residual bit-identical."""
    overrides = ["mesh.data=8", "mesh.grad_comm=int8", "mesh.grad_comm_error_feedback=true"]
    overrides += ["precision.policy=fp16", "precision.loss_scale=static:1e30"]
    _, mesh, _, state, train_step = build_run(overrides, devices)
    before = jax.device_get((state.params, state.comm))
    with jax.set_mesh(mesh):
        state, metrics = train_step(state, token_batches(1)[0])
    assert float(metrics["skipped_steps"]) == 1
    after = jax.device_get((state.params, state.comm))
    for new, old in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(new, old)


def test_resume_is_exact_with_the_error_feedback_residual(tmp_path):
    """Steps 4-6 after a resume at 3 equal the uninterrupted run's, residual and all."""
    whole = run_steps(tmp_path / "whole", EF, 6)
    run_steps(tmp_path / "split", EF, 3)
    resumed = run_steps(tmp_path / "split", EF, 6)
    assert [resumed[step] for step in (4, 5, 6)] == [whole[step] for step in (4, 5, 6)]
    residual = saved_residual(tmp_path / "split", 6)
    assert np.abs(residual).max() > 0
    np.testing.assert_array_equal(residual, saved_residual(tmp_path / "whole", 6))


def test_a_residual_of_another_mesh_starts_from_zero(tmp_path, capsys):
    """Resuming an error-feedback run on data=4 x fsdp=2: one warning, and it trains on."""
    run_steps(tmp_path / "run", EF, 3)
    resumed = run_steps(tmp_path / "run", [*EF, "mesh.data=4", "mesh.fsdp=2"], 4)
    assert 4 in resumed and np.isfinite(resumed[4])
    assert "it starts from zero" in capsys.readouterr().err


def test_compressed_runs_end_200_steps_within_one_percent_of_fp32(tmp_path):
    """bf16 and int8 with error feedback: the eval loss after 200 steps (the default
    model's curves are in benchmarks/RESULTS.md, benchmarks/grad_comm_curves.py)."""
    reference = final_eval_loss(tmp_path / "fp32", [])
    for name, overrides in (("bf16", ["mesh.grad_comm=bf16"]), ("int8", EF)):
        loss = final_eval_loss(tmp_path / name, overrides)
        assert loss == pytest.approx(reference, rel=0.01), name
