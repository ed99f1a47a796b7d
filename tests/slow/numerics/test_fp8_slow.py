"""The slow tier beside tests/numerics/test_fp8.py: longer runs, more settings.

fp8 matmuls with delayed scaling: numerics, the scaling state, sharding, resume, refusals.
"""

import jax
import numpy as np
from conftest import build_run, run_records, token_batches, train
from flax import nnx
from test_fp8 import train_steps

from paisoar_jax.config import load_config


def test_fp8_trains_like_bf16_and_compiles_to_fp8_matmuls(devices):
    steps = 12  # one batch over and over at full lr: the loss falls steeply in both
    common = ["optim.warmup_steps=0", "optim.schedule=constant"]
    fp8_losses, state, train_step, batch = train_steps(
        [*common, "precision.policy=fp8"], devices[:1], steps
    )
    bf16_losses, *_ = train_steps([*common, "precision.policy=bf16"], devices[:1], steps)
    assert fp8_losses[-1] < 0.8 * fp8_losses[0]
    np.testing.assert_allclose(fp8_losses, bf16_losses, rtol=0.01)
    # Four matmuls per block, each with its own state, stacked over the 2 scanned layers.
    fp8_state = state.model_state["blocks"]["fp8"]
    assert sorted(fp8_state) == ["mlp_in", "mlp_out", "out", "qkv"]
    history = np.asarray(fp8_state["mlp_out"]["grad_amax_history"])
    assert history.shape == (2, 1024)
    assert (np.count_nonzero(history, axis=1) == steps).all()
    assert (np.asarray(fp8_state["qkv"]["lhs_scale"]) != 1).all()
    # The compiled step quantizes to e4m3 (inputs, weights) and e5m2 (gradients).
    hlo = train_step.lower(state, batch).compile().as_text()
    assert "f8e4m3fn" in hlo and "f8e5m2" in hlo


def test_sharded_fp8_step_matches_one_device(devices):
    """Each amax is the max over the global tensor, so the scales match one device's (to
    the bf16 rounding of gradients summed in another order)."""
    common = ["precision.policy=fp8"]
    one_losses, one, *_ = train_steps([*common, "mesh.data=1"], devices[:1], 3, same_batch=False)
    losses, sharded, *_ = train_steps(
        [*common, "mesh.data=4", "mesh.fsdp=2"], devices, 3, same_batch=False
    )
    np.testing.assert_allclose(losses, one_losses, rtol=1e-3)
    pairs = zip(
        jax.tree_util.tree_leaves_with_path(jax.device_get(sharded.model_state)),
        jax.tree.leaves(jax.device_get(one.model_state)),
        strict=True,
    )
    for (path, actual), expected in pairs:
        np.testing.assert_allclose(actual, expected, rtol=5e-2, err_msg=jax.tree_util.keystr(path))


def test_grad_accumulation_threads_the_scaling_state_through_micro_batches(devices):
    overrides = ["precision.policy=fp8", "train.grad_accum=2"]
    _, state, *_ = train_steps(overrides, devices[:1], 1)
    history = np.asarray(state.model_state["blocks"]["fp8"]["qkv"]["lhs_amax_history"])
    assert (np.count_nonzero(history, axis=1) == 2).all()  # one entry per micro-batch


def test_resume_restores_the_scaling_state_and_continues_exactly(tmp_path):
    common = ["precision.policy=fp8", "model.layers=1", "model.width=32", "model.seq_len=32"]
    common += ["train.log_every=1", "train.eval_every=0", "checkpoint.every=3"]
    common += ["train.sample_bytes=0", "run.progress=false", "run.tensorboard=false"]
    common += ["optim.schedule=constant", "optim.warmup_steps=0"]
    straight = train(load_config(None, [*common, "train.steps=6", f"run.dir={tmp_path}/a"]))
    train(load_config(None, [*common, "train.steps=3", f"run.dir={tmp_path}/b"]))
    resumed = train(load_config(None, [*common, "train.steps=6", f"run.dir={tmp_path}/b"]))
    assert resumed["resumed_from"] == 3
    losses = [[record["loss"] for record in run_records(tmp_path / name)] for name in "ab"]
    assert losses[0] == losses[1] and len(losses[0]) == 6
    assert straight["final_loss"] == resumed["final_loss"]


def test_a_bf16_checkpoint_step_starts_an_fp8_run_with_fresh_scales(tmp_path, capsys):
    common = ["model.layers=1", "model.width=32", "model.seq_len=32", "train.eval_every=0"]
    common += ["train.sample_bytes=0", "run.progress=false", "run.tensorboard=false"]
    train(
        load_config(
            None, [*common, "precision.policy=bf16", "train.steps=2", f"run.dir={tmp_path}/a"]
        )
    )
    fine_tune = [*common, "precision.policy=fp8", "train.steps=2", f"run.dir={tmp_path}/b"]
    summary = train(
        load_config(None, [*fine_tune, f"checkpoint.init_from={tmp_path}/a/checkpoints/2"])
    )
    assert summary["steps"] == 2 and np.isfinite(summary["final_loss"])
    assert "(BatchNorm statistics, fp8 scales): they start afresh" in capsys.readouterr().err


def test_a_block_forced_off_fp8_keeps_its_scaling_state(devices):
    """precision.force_policy on an fp8 model: the skipped matmuls' state is kept, not
    overwritten by a zero gradient (scales of 0 would make the next fp8 step NaN)."""
    from conftest import task_for

    from paisoar_jax.engine.step import loss_and_grads
    from paisoar_jax.numerics.precision import force_policy

    config, mesh, layout, state, _ = build_run(["precision.policy=fp8"], devices[:1])
    model = nnx.merge(layout.graphdef, state.params, state.model_state)
    force_policy(model.blocks, "bf16")
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
    params, model_state = nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)
    batch = token_batches(1)[0]
    with jax.set_mesh(mesh):
        _, grads, _, new_model_state = jax.jit(
            lambda p, s, b: loss_and_grads(p, s, graphdef, b, task_for(config))
        )(params, model_state, batch)
    jax.tree.map(np.testing.assert_array_equal, new_model_state, model_state)
    assert any(np.abs(leaf).max() > 0 for leaf in jax.tree.leaves(grads))
