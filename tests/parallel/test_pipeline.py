"""Pipeline parallelism: pipelined steps equal one device's, bytes and bubble as the formulas."""

import functools

import jax
import numpy as np
import optax
import pytest
from conftest import (
    TINY,
    assert_steps_match,
    build_run,
    plan_run,
    resumable_run,
    run_records,
    task_for,
    token_batches,
    train,
)
from flax import nnx

import paisoar_jax
from paisoar_jax import api
from paisoar_jax.config import config_from_dict, load_config, to_dict
from paisoar_jax.engine.memory import per_device_bytes
from paisoar_jax.engine.step import loss_and_grads
from paisoar_jax.errors import UserError
from paisoar_jax.inference.generator import placement
from paisoar_jax.parallel import pipeline
from paisoar_jax.parallel import rules as rules_table
from paisoar_jax.run.oom import memory_fixes
from paisoar_jax.run.setup import setup
from paisoar_jax.tasks.zoo import check_model
from paisoar_jax.tools.doctor import findings
from paisoar_jax.tools.plan.core import memory_settings


def check_zoo_model(config):
    """zoo.check_model on `config`'s sections, as the command line checks them at start."""
    check_model(config.model, config.mesh, config.train, config.precision.policy)


def three_steps(overrides, devices):
    """(losses, gradients per step, params) of three train steps on fixed batches."""
    config, mesh, layout, state, train_step = build_run(overrides, devices)
    task = task_for(config)
    gradients = jax.jit(
        lambda state, batch: loss_and_grads(
            state.params, state.model_state, layout.graphdef, batch, task, layout=layout
        )[1]
    )
    losses, grads, initial = [], [], jax.device_get(state.params)
    with jax.set_mesh(mesh):
        for batch in token_batches(3, batch=config.train.global_batch):
            grads.append(jax.device_get(gradients(state, batch)))
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
    return losses, grads, (initial, jax.device_get(state.params))


@functools.cache
def one_device(model: tuple[str, ...]):
    return three_steps([*model, "mesh.data=1"], jax.devices()[:1])


GPT4 = ("model.layers=4",)
GPT8 = ("model.layers=8",)
LLAMA4 = ("model.name=llama", "model.kv_heads=2", "model.layers=4")


# A mixture of experts whose capacity drops choices, with its router's losses in the loss.
MOE4 = (*LLAMA4, "model.experts=4", "model.mlp_width=64", "model.expert_capacity_factor=1.0")
MOE4 += ("model.router_z_loss=0.001",)


@pytest.mark.parametrize("repeats", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_pipelined_mixture_of_experts_steps_as_one_device_accumulating(repeats, devices):
    """Its router statistics per micro-batch, averaged: those of one device's grad_accum."""

    def steps(overrides, devices):
        config, mesh, _, state, train_step = build_run([*MOE4, *overrides], devices)
        initial, records = jax.device_get(state.params), []
        with jax.set_mesh(mesh):
            for batch in token_batches(2, batch=config.train.global_batch):
                state, metrics = train_step(state, batch)
                records.append({name: float(value) for name, value in metrics.items()})
        return records, (initial, jax.device_get(state.params))

    stages = ["mesh.data=1", "mesh.stage=2", "train.pipeline_microbatches=4"]
    pipelined, params = steps([*stages, f"train.pipeline_repeats={repeats}"], devices[:2])
    accumulated, reference = steps(["mesh.data=1", "train.grad_accum=4"], devices[:1])
    for name in ("loss", "moe_balance_loss", "moe_z_loss", "moe_dropped_fraction"):
        found = [record[name] for record in pipelined]
        np.testing.assert_allclose(found, [record[name] for record in accumulated], rtol=1e-5)
    assert pipelined[0]["moe_layer_load/3"] == pytest.approx(accumulated[0]["moe_layer_load/3"])
    assert_steps_match(params, reference)


def block_bytes(overrides, devices):
    """(per-device bytes of the stacked blocks' params, of all params)."""
    _, _, layout, _ = plan_run(["model.layers=8", *overrides], devices)
    params = layout.abstract_state.params  # shapes with their shardings
    return per_device_bytes(params["blocks"]), per_device_bytes(params)


def test_each_stage_holds_its_share_of_the_blocks(devices):
    flat_blocks, flat_total = block_bytes(["mesh.data=8"], devices)
    staged_blocks, staged_total = block_bytes(["mesh.data=2", "mesh.stage=4"], devices)
    assert staged_blocks * 4 == flat_blocks
    assert flat_total / staged_total > 3  # the embeddings stay whole on every stage


@pytest.mark.parametrize("repeats", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_plan_reports_the_stage_to_stage_bytes_and_the_bubble(repeats, devices):
    """Per device: one micro-batch's activations forward and their gradient back at each of
    the M R + S - 1 iterations, as plan reads them from the compiled HLO."""
    from paisoar_jax.tools.plan import format_table, plan

    config = load_config(
        None,
        [
            *TINY,
            "model.layers=4",
            "mesh.data=4",
            "mesh.stage=2",
            f"train.pipeline_repeats={repeats}",
        ],
    )
    result = plan(config, devices, simulated=True)
    stages, micro, batch_shards = 2, 4, 4
    iterations = micro * repeats + stages - 1
    rows = config.train.global_batch // micro // batch_shards
    activation_bytes = rows * config.model.seq_len * config.model.width * 4  # fp32
    report = result["pipeline"]
    assert report["p2p_bytes"] == 2 * iterations * activation_bytes
    assert report["bubble"] == pytest.approx((stages - 1) / iterations)
    assert report["schedule"] == ("gpipe" if repeats == 1 else "circular")
    assert result["collectives"]["collective-permute"]["count"] == 2 * iterations
    # The gradients are summed over the 4 batch shards once per step, not per iteration.
    over_the_batch = [op for op in result["collective_ops"] if op["group_size"] == batch_shards]
    assert over_the_batch and all(op["count"] == 1 for op in over_the_batch)
    assert f"bubble {report['bubble']:.1%}" in format_table(result)


def run_steps(run_dir, mesh, steps):
    return resumable_run(run_dir, ["model.layers=4", *mesh], steps)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.stage=3", "train.pipeline_microbatches=4"], "model.layers=4 does not split"),
        (["mesh.stage=2", "train.pipeline_repeats=4"], "= 2 x 4 = 8 equal groups"),
        (["mesh.stage=2", "train.pipeline_microbatches=3"], "does not divide the batch of 16"),
        (
            [
                "mesh.stage=4",
                "train.pipeline_microbatches=2",
                "train.pipeline_repeats=2",
                "model.layers=8",
            ],
            "needs train.pipeline_microbatches >= 4",
        ),
        (["mesh.stage=2", "model.scan_layers=false"], "set model.scan_layers=true"),
        (["mesh.stage=2", "precision.policy=fp8"], "fp8 does not pipeline yet"),
        (["train.pipeline_repeats=2"], "is for a pipelined mesh"),
        (["mesh.stage=0"], "mesh.stage must be a positive size"),
    ],
)
def test_bad_pipelines_are_refused_in_one_line(overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        check_zoo_model(load_config(None, ["model.layers=4", *overrides]))


def test_a_model_without_a_stack_is_refused_by_name():
    config = load_config(None, ["model.name=resnet", "model.variant=resnet18", "mesh.stage=2"])
    with pytest.raises(UserError, match="model.name=resnet has none: set mesh.stage=1"):
        check_zoo_model(config)


def test_micro_batches_must_split_over_the_batch_shards(devices):
    with pytest.raises(UserError, match="which do not split over the 4 batch shards"):
        plan_run(["mesh.data=4", "mesh.stage=2", "train.pipeline_microbatches=8"], devices)


def test_a_model_without_a_stack_is_named(devices):
    """A model of one's own that runs no stack through scan_layers is refused when traced."""
    context_pipeline = pipeline.Pipeline(stages=2, microbatches=2)
    with pipeline.active(context_pipeline) as context:
        pass
    with pytest.raises(UserError, match="MyModel runs none through paisoar_jax.scan_layers"):
        pipeline.check_used(context, "MyModel")


def test_scan_layers_is_a_scan_outside_a_pipeline():
    weights = np.arange(12.0).reshape(3, 2, 2)

    def step(x, weight):
        return x @ weight, None

    x = np.ones((2, 2))
    expected = x @ weights[0] @ weights[1] @ weights[2]
    np.testing.assert_allclose(pipeline.scan_layers(step, x, weights), expected)


VIT = ["model.name=vit", "model.variant=vit_tiny", "model.image_size=8", "model.num_classes=10"]
VIT += ["model.scan_layers=true", "data.source=synthetic", "train.global_batch=16"]


def vit_losses(run_dir, mesh):
    overrides = [*VIT, *mesh, "train.steps=3", "train.log_every=1", "train.eval_every=0"]
    overrides += ["checkpoint.enabled=false", "run.progress=false", "run.tensorboard=false"]
    train(load_config(None, [*overrides, f"run.dir={run_dir}"]))
    return [record["loss"] for record in run_records(run_dir)]


class StackedNet(nnx.Module):
    """A model of one's own with a stack of 4 identical blocks, run by scan_layers."""

    def __init__(self, rngs):
        self.embed = nnx.Linear(16, 32, rngs=rngs)

        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return nnx.Sequential(nnx.LayerNorm(32, rngs=rngs), nnx.Linear(32, 32, rngs=rngs))

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        graphdef, stacked = nnx.split(self.blocks)

        def step(x, layer):
            return x + jax.nn.gelu(nnx.merge(graphdef, layer)(x)), None

        return self.head(paisoar_jax.scan_layers(step, self.embed(x), stacked))


class UnstackedNet(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


def classify(model, batch, rng):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def own_model_losses(run_dir, model, overrides):
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(256, 16)).astype(np.float32)}
    data["y"] = (data["x"][:, :4].argmax(-1)).astype(np.int32)
    settings = ["train.global_batch=16", "train.steps=3", "train.log_every=1"]
    settings += ["train.eval_every=0", "run.progress=false", "run.tensorboard=false"]
    settings += ["checkpoint.enabled=false", f"run.dir={run_dir}", *overrides]
    paisoar_jax.fit(None, settings, model=model, loss=classify, data=data)
    return [record["loss"] for record in run_records(run_dir)]


def test_a_model_of_ones_own_pipelines_its_stack(tmp_path, capsys):
    """scan_layers in the user's model: pipelined like the zoo's, the stack on the stages by a
    rule that names its leading axis `layers`."""
    rules = 'sharding.rules=[["blocks\\\\.", [layers]]]'
    pipelined = own_model_losses(tmp_path / "staged", StackedNet, ["mesh.stage=2", rules])
    flat = own_model_losses(tmp_path / "flat", StackedNet, ["mesh.data=8"])
    assert len(pipelined) == 3
    np.testing.assert_allclose(pipelined, flat, rtol=1e-5)
    for rule in (rules, 'sharding.rules=[["blocks\\\\.", [stage]]]'):  # logical or mesh axis
        config = api.resolve_config(None, ["train.global_batch=16", "mesh.stage=2", rule])
        data = {"x": np.zeros((64, 16), np.float32), "y": np.zeros((64,), np.int32)}
        config, workload = api.build_workload(config, model=StackedNet, loss=classify, data=data)
        layout = setup(config, workload, jax.devices()).layout
        placed = rules_table.describe(layout.abstract_state.params, layout.shardings.params)
        blocks = {where for path, _, where in placed if path.startswith("blocks.")}
        assert blocks == {"[stage, -]", "[stage, -, -]"}, rule
    with pytest.raises(UserError, match="UnstackedNet runs none through paisoar_jax.scan_layers"):
        own_model_losses(tmp_path / "none", UnstackedNet, ["mesh.stage=2"])


@pytest.mark.parametrize("microbatches, fires", [(8, True), (16, False)])
def test_doctor_names_a_bubble_over_a_fifth_of_the_step(microbatches, fires):
    """stage=4: 8 micro-batches idle 3/11 = 27% of the step, 16 idle 3/19 = 16%."""
    overrides = ["mesh.stage=4", f"train.pipeline_microbatches={microbatches}"]
    config = load_config(None, [*TINY, "model.layers=4", "train.global_batch=32", *overrides])
    finding = findings.pipeline_bubble(findings.Run(config.run_dir, config, [], None))
    assert (finding is not None) == fires
    if fires:
        assert "idle 27% of the step" in finding.evidence
        assert finding.fixes[0].startswith("`mesh.stage=4` `train.pipeline_microbatches=16`")


def test_generate_places_a_pipelined_run_without_stages():
    """Decoding runs the stack whole: a stage=2 run's config is placed with stage 1."""
    config = load_config(
        None, [*TINY, "model.layers=4", "mesh.stage=2", "train.pipeline_repeats=2"]
    )
    placed = config_from_dict(to_dict(config), placement(config.mesh, 8))
    assert (placed.mesh.stages, placed.train.pipeline_repeats) == (1, 1)


@pytest.mark.parametrize("global_batch, suggested", [(16, None), (64, "train.grad_accum=2")])
def test_out_of_memory_fixes_keep_the_micro_batches_splittable(global_batch, suggested):
    """data=4 x stage=2, 4 micro-batches: grad_accum=2 is only suggested where each pipeline
    micro-batch still splits over the 4 batch devices."""
    config = load_config(
        None, [*TINY, "mesh.data=4", "mesh.stage=2", f"train.global_batch={global_batch}"]
    )
    mesh = {"data": 4, "stage": 2, "fsdp": 1, "tensor": 1}
    accumulations = [
        fix for fix, _ in memory_fixes(memory_settings(config), mesh) if "grad_accum" in fix
    ]
    assert accumulations == ([suggested] if suggested else [])
