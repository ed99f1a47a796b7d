"""LoRA (engine/lora.py): only the adapters train, sharded like one device, resumable."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY, assert_steps_match, build_run, resumable_run, task_for, token_batches
from flax import nnx, traverse_util

import paisoar_jax
from paisoar_jax import api
from paisoar_jax.config import load_config
from paisoar_jax.engine.state import init_state
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import sharding
from paisoar_jax.run.setup import setup

LLAMA_LORA = ["model.name=llama", "model.kv_heads=2", "lora.rank=4", "lora.alpha=8"]
ADAMW = ["optim.name=adamw", "optim.lr=1e-2", "optim.warmup_steps=0", "optim.weight_decay=0.1"]


def flat(tree) -> dict[str, np.ndarray]:
    """{dotted path: array} of a params dict."""
    return {
        ".".join(map(str, path)): np.asarray(leaf)
        for path, leaf in traverse_util.flatten_dict(jax.device_get(tree)).items()
    }


def is_adapter(path: str) -> bool:
    return "_lora." in path


@functools.cache
def two_steps(overrides: tuple[str, ...], count: int = 8):
    """(initial params, final params, opt_state leaves, losses) of two AdamW steps."""
    devices = jax.devices()[:count]
    config, mesh, layout, state, train_step = build_run([*LLAMA_LORA, *ADAMW, *overrides], devices)
    where = sharding.batch_sharding(mesh)
    initial = flat(state.params)
    losses = []
    with jax.set_mesh(mesh):
        for batch in token_batches(2):
            state, metrics = train_step(state, jax.device_put(batch, where))
            losses.append(float(metrics["loss"]))
    opt_leaves = [np.shape(leaf) for leaf in jax.tree.leaves(state.opt_state)]
    return initial, flat(state.params), opt_leaves, losses


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_only_the_adapters_train_and_the_optimizer_holds_only_them(policy):
    initial, final, opt_leaves, losses = two_steps((f"precision.policy={policy}",))
    adapters = sorted(path for path in final if is_adapter(path))
    # Every projection of the llama block by default (stacked over the layers): 7 pairs.
    kernels = sorted({path.rsplit("_lora.", 1)[0] for path in adapters})
    assert kernels == [
        f"blocks.{name}_kernel" for name in ("down", "gate", "k", "out", "q", "up", "v")
    ]
    assert len(adapters) == 14
    for path, value in final.items():
        if is_adapter(path):
            assert value.dtype == np.float32, path
            assert not np.array_equal(value, initial[path]), f"{path} did not train"
        else:  # bit for bit, and held in the compute dtype (no fp32 master copy)
            assert value.dtype == {"bf16": jnp.bfloat16, "fp16": jnp.float16}[policy], path
            assert np.array_equal(value.view(np.uint16), initial[path].view(np.uint16)), path
    assert all(np.all(initial[path] == 0) for path in adapters if path.endswith(".b"))
    # Adam's two moments per adapter weight, step counts (and fp16's loss scale): no leaf
    # of a frozen weight.
    adapter_shapes = sorted(final[path].shape for path in adapters)
    moments = sorted(shape for shape in opt_leaves if len(shape) > 0)
    assert moments == sorted(adapter_shapes * 2)
    assert np.isfinite(losses).all()


def test_adapters_start_from_the_base_models_output(devices):
    """B = 0: the adapted model's logits are the base model's at the start."""
    logits = []
    for lora in ([], ["lora.rank=4"]):
        config, mesh, layout, state, _ = build_run(
            ["mesh.data=1", "model.name=llama", "model.kv_heads=2", *lora], devices[:1]
        )
        model = nnx.merge(layout.graphdef, state.params, state.model_state)
        logits.append(np.asarray(model(jnp.asarray(token_batches(1)[0][:2, :-1]))))
    np.testing.assert_array_equal(logits[0], logits[1])


@pytest.mark.checks("lora", "sharded", families=["zoo:llama"])
@pytest.mark.parametrize(
    "mesh",
    [
        ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"),
        pytest.param(
            ("mesh.data=2", "mesh.stage=2", "mesh.fsdp=2", "train.pipeline_microbatches=2"),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ("mesh.data=8", "mesh.zero=1", "remat.policy=full", "lora.dropout=0.1"),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["data-fsdp-tensor", "stage-fsdp", "zero1-remat-dropout"],
)
def test_sharded_lora_equals_one_device(mesh):
    unsplit = tuple(setting for setting in mesh if not setting.startswith(("mesh.", "train.pip")))
    expected = two_steps(unsplit, 1)
    initial, final, _, losses = two_steps(mesh)
    np.testing.assert_allclose(losses, expected[3], rtol=2e-5)
    assert_steps_match(
        (
            {k: v for k, v in initial.items() if is_adapter(k)},
            {k: v for k, v in final.items() if is_adapter(k)},
        ),
        (
            {k: v for k, v in expected[0].items() if is_adapter(k)},
            {k: v for k, v in expected[1].items() if is_adapter(k)},
        ),
    )
    for path in final:
        if not is_adapter(path):
            np.testing.assert_array_equal(final[path], expected[1][path], err_msg=path)


def test_dropout_draws_per_step_and_is_off_in_eval(devices):
    config, mesh, layout, state, train_step = build_run(
        [*LLAMA_LORA, "lora.dropout=0.5", "mesh.data=1", *ADAMW], devices[:1]
    )
    task = task_for(config)
    batch = jnp.asarray(token_batches(1)[0])
    with jax.set_mesh(mesh):
        state, _ = train_step(state, batch)  # B is no longer zero: the adapters now count
        model = nnx.merge(layout.graphdef, state.params, state.model_state)
        key = jax.random.key(1)
        eval_losses = {float(task.eval_rows(model, batch)["loss"].mean()) for _ in range(2)}
        from paisoar_jax.engine import lora

        with lora.dropout_key(jax.random.PRNGKey(3)):
            dropped = float(task.loss(model, batch, key)[0])
        with lora.dropout_key(jax.random.PRNGKey(4)):
            other = float(task.loss(model, batch, key)[0])
    assert len(eval_losses) == 1  # no dropout outside training
    assert dropped != other  # each step's key draws its own masks


@pytest.mark.checks("lora", "resume", families=["zoo:llama"])
def test_a_resumed_lora_run_continues_exactly(tmp_path):
    settings = [*LLAMA_LORA, "precision.policy=bf16", "train.grad_accum=2"]
    whole = resumable_run(tmp_path / "whole", settings, 6)
    resumable_run(tmp_path / "cut", settings, 3)
    resumed = resumable_run(tmp_path / "cut", settings, 6)
    assert [resumed[step] for step in range(4, 7)] == [whole[step] for step in range(4, 7)]


class Net(nnx.Module):
    """A model of one's own: two Linear layers and a norm."""

    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.down = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.norm(self.up(x))))


def net_loss(model, batch, rng):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def examples(count=128):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(count, 16)).astype(np.float32)
    return {"x": x, "y": (x[:, :4].argmax(-1)).astype(np.int32)}


@pytest.mark.checks("lora", families=["zoo:your own (fit)"])
def test_a_model_of_ones_own_adapts_its_linear_layers(tmp_path):
    overrides = [
        "train.global_batch=16",
        "train.steps=4",
        "train.eval_every=0",
        "run.progress=false",
        "run.tensorboard=false",
        f"run.dir={tmp_path}",
        "lora.rank=2",
        "lora.targets=[up\\.kernel]",
        "optim.lr=0.1",
    ]
    config = api.resolve_config(None, overrides)
    config, workload = api.build_workload(config, model=Net, loss=net_loss, data=examples())
    run = setup(config, workload, jax.devices()[:1])
    assert run.layout.trainable == frozenset(
        {("up", "kernel_lora", "a"), ("up", "kernel_lora", "b")}
    )
    result = paisoar_jax.fit(None, overrides, model=Net, loss=net_loss, data=examples())
    params = nnx.state(result.model, nnx.Param)
    assert np.any(np.asarray(params["up"]["kernel_lora"]["b"][...]) != 0)
    loaded = nnx.state(paisoar_jax.load(tmp_path, Net), nnx.Param)  # as fit gave it back
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(loaded), nnx.to_pure_dict(params))
    with jax.set_mesh(run.mesh):
        start = init_state(config.train.seed, run.layout)
    assert np.array_equal(
        np.asarray(params["up"]["kernel"][...]), np.asarray(start.params["up"]["kernel"])
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["lora.rank=4", "lora.targets=[nothing_here]"], "'nothing_here' matches no projection"),
        (["lora.rank=-1"], "lora.rank must be >= 1"),
        (["lora.targets=[q_kernel]"], "lora.targets is set, but lora.rank=0"),
        (["lora.alpha=32"], "lora.alpha is set, but lora.rank=0 trains no adapters"),
        (["lora.rank=4", "lora.dropout=1"], "lora.dropout must be in [0, 1)"),
        (["lora.rank=4", "lora.alpha=0"], "lora.alpha must be a positive number"),
    ],
    ids=[
        "no-match",
        "negative-rank",
        "targets-without-rank",
        "alpha-without-rank",
        "dropout",
        "alpha",
    ],
)
def test_bad_lora_settings_are_one_line(overrides, message, devices):
    with pytest.raises(UserError, match=None) as error:
        config = load_config(None, [*TINY, "model.name=llama", *overrides])
        from paisoar_jax.tasks.zoo import zoo_workload

        setup(config, zoo_workload(config), devices[:1])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_model_of_ones_own_names_its_targets(devices):
    config = api.resolve_config(None, ["lora.rank=2", "train.global_batch=16"])
    config, workload = api.build_workload(config, model=Net, loss=net_loss, data=examples())
    with pytest.raises(UserError, match="lora.targets is needed") as error:
        setup(config, workload, devices[:1])
    assert "up.kernel" in str(error.value)


def test_lora_fine_tunes_from_exported_weights(tmp_path, devices):
    """checkpoint.init_from of a model without adapters: its weights frozen, adapters fresh."""
    from paisoar_jax.api import export_run

    base = [*TINY, "model.name=llama", "model.kv_heads=2", "train.eval_every=0"]
    paisoar_jax.fit(None, [*base, "train.steps=2", f"run.dir={tmp_path / 'base'}"])
    export_run(tmp_path / "base", tmp_path / "exported")
    tuned = [*base, "lora.rank=4", f"checkpoint.init_from={tmp_path / 'exported'}"]
    result = paisoar_jax.fit(None, [*tuned, "train.steps=2", f"run.dir={tmp_path / 'tuned'}"])
    assert result["steps"] == 2
    config = load_config(None, [*tuned, "mesh.data=1"])
    from paisoar_jax.checkpointing.weights import checkpoint_step, load_weights
    from paisoar_jax.tasks.zoo import zoo_workload

    run = setup(config, zoo_workload(config), devices[:1])
    _, step_dir, _ = checkpoint_step(tmp_path / "tuned")
    with jax.set_mesh(run.mesh):
        trained_params = flat(load_weights(step_dir, run.layout.abstract_state)[0])
        frozen = lora_split_frozen(run)
        exported = flat(load_weights(tmp_path / "exported", frozen)[0])
    for path, value in exported.items():
        np.testing.assert_array_equal(trained_params[path], value, err_msg=path)
    assert any(
        np.any(value != 0) for path, value in trained_params.items() if path.endswith("_lora.b")
    )


def lora_split_frozen(run):
    """The run's abstract state holding only the frozen params."""
    from paisoar_jax.engine import lora

    abstract = run.layout.abstract_state
    return abstract.replace(params=lora.split(abstract.params, run.layout.trainable)[1])


@pytest.mark.parametrize(
    "model, peft_names, ours",
    [
        ("llama", "[q_proj,v_proj,o_proj]", ["out_kernel", "q_kernel", "v_kernel"]),
        ("gpt", "[c_proj]", ["mlp_out_kernel", "out_kernel"]),
        ("gpt", "[all-linear]", ["mlp_in_kernel", "mlp_out_kernel", "out_kernel", "qkv_kernel"]),
    ],
)
def test_peft_module_names_are_lora_targets(model, peft_names, ours):
    from paisoar_jax.engine import lora
    from paisoar_jax.numerics.precision import get_policy
    from paisoar_jax.tasks.zoo import build_model

    overrides = [f"model.name={model}", "lora.rank=2", f"lora.targets={peft_names}"]
    config = load_config(None, [*TINY, *overrides])
    with nnx.use_eager_sharding(False):
        built = build_model(config.model, get_policy("fp32"), "none", nnx.Rngs(params=0))
    chosen = lora.add_adapters(built, config.lora, 0)
    assert [path.removeprefix("blocks.") for path in chosen] == ours
