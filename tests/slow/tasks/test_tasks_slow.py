"""The slow tier beside tests/tasks/test_tasks.py: longer runs, more settings.

Image classification through the trainer: global BatchNorm, statistics in the state,
accumulation, eval with running statistics, resume, the digits run and bad input.
"""

import jax
import numpy as np
import pytest
from conftest import (
    TINY_RESNET,
    build_run,
    plan_run,
    run_module,
    run_records,
    task_for,
    train,
)
from flax import nnx
from test_tasks import image_batch, image_folder, one_step

from paisoar_jax.config import load_config
from paisoar_jax.parallel import sharding


@pytest.mark.checks("sharded", families=["zoo:resnet"])
@pytest.mark.parametrize(
    "mesh", [["mesh.data=8"], ["mesh.data=2", "mesh.fsdp=4", "mesh.zero=3"]], ids=["dp", "fsdp"]
)
def test_sharded_step_with_global_batch_norm_matches_one_device(mesh, devices):
    """BatchNorm under jit with the batch split over 8 devices uses the statistics of the
    whole global batch: loss, params and running statistics equal one device's."""
    batch = image_batch()
    reference_metrics, reference = one_step([], devices[:1], batch)
    metrics, state = one_step(mesh, devices, batch)
    np.testing.assert_allclose(metrics["loss"], reference_metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], reference_metrics["grad_norm"], rtol=1e-4)
    assert metrics["accuracy"] == reference_metrics["accuracy"]
    for tree in ("params", "model_state"):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
            getattr(state, tree),
            getattr(reference, tree),
        )
    # The statistics really moved (momentum 0.9 from 0 and 1) and are fp32.
    stem_mean = state.model_state["stem_norm"]["mean"]
    assert stem_mean.dtype == np.float32 and np.abs(stem_mean).max() > 0


def test_accumulation_threads_the_statistics_through_the_micro_batches(devices):
    """grad_accum=2 updates the running statistics once per micro-batch, in order."""
    batch = image_batch()
    config, mesh, layout, state, train_step = build_run(
        ["train.grad_accum=2"], devices[:1], base=TINY_RESNET
    )
    task = task_for(config)
    model = nnx.merge(layout.graphdef, state.params, state.model_state)
    for micro in range(2):  # micro-batch j holds rows j, j + 2, j + 4, ...
        rows = {name: values[micro::2] for name, values in batch.items()}
        task.loss(model, rows, jax.random.PRNGKey(0))
    expected = nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])
    with jax.set_mesh(mesh):
        state, _ = train_step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        jax.device_get(state.model_state),
        expected,
    )


def test_eval_uses_the_running_statistics(devices):
    """In eval an image's logits do not depend on the rest of its batch."""
    config, mesh, layout, state, train_step = build_run([], devices[:1], base=TINY_RESNET)
    batch = image_batch()
    with jax.set_mesh(mesh):
        state, _ = train_step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
    model = nnx.merge(layout.graphdef, state.params, state.model_state)
    images = batch["image"].astype(np.float32) / 255
    whole = model(images, train=False)
    np.testing.assert_allclose(model(images[:3], train=False), whole[:3], rtol=1e-5, atol=1e-6)
    assert not np.allclose(model(images[:3], train=True), whole[:3], atol=1e-3)


def test_skipped_fp16_step_keeps_the_statistics(devices):
    """An overflowing step leaves params and running statistics as they were."""
    overrides = [
        "precision.policy=fp16",
        "precision.initial_scale=1e30",
        "precision.max_scale=1e30",
    ]
    config, mesh, layout, state, train_step = build_run(overrides, devices[:1], base=TINY_RESNET)
    before = jax.device_get(state.model_state)
    with jax.set_mesh(mesh):
        state, metrics = train_step(
            state, jax.device_put(image_batch(), sharding.batch_sharding(mesh))
        )
    assert int(metrics["skipped_steps"]) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.model_state), before)


@pytest.mark.checks("resume", families=["zoo:resnet"])
def test_resume_restores_the_statistics_and_continues_exactly(tmp_path):
    """Stopping at step 3 and resuming gives the losses and state of an unbroken run."""
    common = [*TINY_RESNET, "train.log_every=1", "train.eval_every=0", "checkpoint.every=3"]
    common += ["optim.schedule=constant", "optim.warmup_steps=0"]  # lr not tied to train.steps
    straight = train(load_config(None, [*common, "train.steps=6", f"run.dir={tmp_path}/a"]))
    train(load_config(None, [*common, "train.steps=3", f"run.dir={tmp_path}/b"]))
    resumed = train(load_config(None, [*common, "train.steps=6", f"run.dir={tmp_path}/b"]))
    assert resumed["resumed_from"] == 3
    assert straight["final_loss"] == resumed["final_loss"]
    losses = [[r["loss"] for r in run_records(tmp_path / name)] for name in "ab"]
    assert losses[0] == losses[1] and len(losses[0]) == 6
    assert {"examples_per_s", "accuracy"} <= run_records(tmp_path / "a")[-1].keys()


def test_digits_trains_to_over_95_percent_from_the_command_line(tmp_path):
    """The README's image example: the shipped digits config, as a user runs it."""
    result = run_module("train", "--config", "digits", "run.dir=out", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = run_records(tmp_path / "out")
    final = records[-1]
    assert final["eval_accuracy"] >= 0.95, final
    assert "examples_per_s" in final and "tokens_per_s" not in final
    assert "eval_accuracy" in result.stdout.splitlines()[-1]


def test_an_image_folder_trains_with_unreadable_files_skipped(tmp_path, capfd):
    """Real PNGs are decoded, cropped and flipped; the broken file is skipped with a count."""
    folder = image_folder(tmp_path / "images", ["cat", "dog"], files=6)
    (folder / "cat" / "broken.png").write_bytes(b"truncated")
    overrides = [
        *TINY_RESNET,
        f"data.source=images:{folder}",
        "data.eval_fraction=0.3",
        "train.global_batch=8",
        "train.steps=4",
        "train.log_every=2",
        "train.eval_every=4",
        "train.eval_batches=1",
        f"run.dir={tmp_path}/run",
    ]
    summary = train(load_config(None, overrides))
    assert summary["steps"] == 4 and 0 <= summary["eval_accuracy"] <= 1
    assert "skipped 1" in capfd.readouterr().err


def test_export_and_init_from_keep_the_batch_norm_statistics(tmp_path, devices):
    """The running statistics travel with the params: an export holds them and a run that
    starts from it (checkpoint.init_from) starts from them, not from fresh ones."""
    from paisoar_jax.checkpointing.checkpoint import Checkpointer
    from paisoar_jax.checkpointing.weights import load_weights
    from paisoar_jax.run.resume import starting_point
    from paisoar_jax.run.setup import setup
    from paisoar_jax.tasks.zoo import zoo_workload
    from paisoar_jax.tools.export import export

    common = [*TINY_RESNET, "train.steps=3", "train.eval_every=0", "checkpoint.every=3"]
    train(load_config(None, [*common, f"run.dir={tmp_path}/run"]))
    export(tmp_path / "run", tmp_path / "export")
    config, mesh, layout, _ = plan_run([], devices[:1], base=TINY_RESNET)
    checkpointer = Checkpointer(tmp_path / "run" / "checkpoints", keep=3)
    with jax.set_mesh(mesh):
        saved = checkpointer.restore(3, layout.abstract_state).state
        params, model_state = load_weights(tmp_path / "export", layout.abstract_state)
        tuned = load_config(None, [*common, f"checkpoint.init_from={tmp_path}/export"])
        started, step, _ = starting_point(setup(tuned, zoo_workload(tuned), devices[:1]), None)
    checkpointer.close()
    assert step == 0
    for tree in (model_state, started.model_state):
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(tree), saved.model_state)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), saved.params)
    assert np.abs(saved.model_state["stem_norm"]["mean"]).max() > 0  # not the fresh zeros
