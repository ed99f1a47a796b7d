"""A model of one's own through `paisoar_jax.fit`: sharded like one device, fp16, bad input.

The model below is plain flax NNX with no sharding annotations and is not in the zoo.
"""

import jax
import numpy as np
import optax
import pytest
from conftest import FIT_BASE, assert_steps_match, assert_trees_close, run_records
from flax import nnx

import paisoar_jax
from paisoar_jax import api
from paisoar_jax.config import load_config
from paisoar_jax.engine.state import init_state
from paisoar_jax.engine.step import jit_eval_step, jit_train_step, loss_and_grads
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import rules, sharding
from paisoar_jax.run.setup import setup
from paisoar_jax.tools.doctor import command as doctor

BASE = FIT_BASE  # a model of one's own through fit: log each step, no eval
RULES = (
    '[["blocks\\\\.\\\\d+\\\\.up\\\\.kernel", [fsdp, tensor]],'
    ' ["blocks\\\\.\\\\d+\\\\.down\\\\.kernel", [tensor, fsdp]],'
    ' ["up\\\\.bias", [tensor]]]'
)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.up = nnx.Linear(64, 128, rngs=rngs)
        self.down = nnx.Linear(128, 64, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Net(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Linear(16, 64, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.head = nnx.Linear(64, 6, rngs=rngs)  # 6 classes: tensor=4 does not divide them

    def __call__(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def net_loss(model, batch, rng):
    logits = model(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def examples(count=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 16)).astype(np.float32)
    return {"x": x, "y": (np.abs(x[:, :3]).argmax(-1) + 3 * (x[:, 3] > 0)).astype(np.int32)}


def batches(count, rows=16):
    data = examples(count * rows, seed=1)
    return [
        {key: value[i * rows : (i + 1) * rows] for key, value in data.items()} for i in range(count)
    ]


def prepared(overrides, devices, **parts):
    config = api.resolve_config(None, [*BASE, *overrides])
    parts = {"model": Net, "loss": net_loss, "data": examples(), **parts}
    config, workload = api.build_workload(config, **parts)
    return config, setup(config, workload, devices)


def gradient_function(layout, task):
    """The jitted gradients of one batch, weights cast as the train step casts them."""
    return jax.jit(
        lambda params, model_state, batch: loss_and_grads(
            params, model_state, layout.graphdef, batch, task, layout=layout
        )[1]
    )


def three_steps(overrides, devices):
    config, run = prepared(overrides, devices, optimizer=optax.adam(1e-2))
    layout = run.layout
    with jax.set_mesh(run.mesh):
        state = init_state(config.train.seed, layout)
        where = sharding.batch_sharding(run.mesh)
        placed = [jax.device_put(batch, where) for batch in batches(3)]
        gradients = gradient_function(layout, run.task)(state.params, state.model_state, placed[0])
        initial = jax.device_get(state.params)
        train_step = jit_train_step(layout, run.task, run.lr_schedule, 1, run.mesh)
        losses = []
        for batch in placed:
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
    shardings = {
        path: where for path, _, where in rules.describe(state.params, layout.shardings.params)
    }
    return {
        "losses": losses,
        "grads": jax.device_get(gradients),
        "params": (initial, jax.device_get(state.params)),
        "shardings": shardings,
        "lr": float(metrics.get("lr", np.nan)),
    }


@pytest.fixture(scope="module")
def reference(devices):
    return three_steps(["mesh.data=1"], devices[:1])


@pytest.mark.checks("sharded", families=["zoo:your own (fit)"])
@pytest.mark.parametrize(
    "overrides",
    [
        ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", f"sharding.rules={RULES}"],
        ["mesh.data=8", "mesh.zero=3", "sharding.min_split_size=256"],
    ],
    ids=["data2-fsdp2-tensor2-rules", "zero3-default"],
)
def test_unannotated_model_matches_one_device(reference, devices, overrides):
    sharded = three_steps(overrides, devices)
    np.testing.assert_allclose(sharded["losses"], reference["losses"], rtol=2e-5)
    assert_trees_close(sharded["grads"], reference["grads"], rtol=1e-4)
    assert_steps_match(sharded["params"], reference["params"])
    assert set(reference["shardings"].values()) == {"[-]", "[-, -]"}  # one device: whole
    where = sharded["shardings"]
    if "mesh.tensor=2" in overrides:  # what the rules say; the rest stays whole
        assert where["blocks.0.up.kernel"] == "[fsdp, tensor]"
        assert where["blocks.1.down.kernel"] == "[tensor, fsdp]"
        assert where["blocks.0.up.bias"] == "[tensor]"
        assert where["head.kernel"] == "[-, -]" and where["blocks.0.norm.scale"] == "[-]"
    else:  # ZeRO-3: the largest dimension the 8 shards divide; small params whole
        assert where["blocks.0.up.kernel"] == "[-, data]"  # (64, 128)
        assert where["head.kernel"] == "[data, -]"  # (64, 6): 6 is not divisible by 8
        assert where["blocks.0.up.bias"] == "[-]"  # 128 elements < min_split_size
    assert np.isnan(reference["lr"])  # a bare optax optimizer: no schedule to report


def test_rules_widen_fsdp_over_data_for_zero(devices):
    config, run = prepared(
        ["mesh.data=4", "mesh.fsdp=2", "mesh.zero=1", f"sharding.rules={RULES}"], devices
    )
    params = dict(
        (p, w)
        for p, _, w in rules.describe(run.layout.abstract_state.params, run.layout.shardings.params)
    )
    state = dict(
        (p, w)
        for p, _, w in rules.describe(
            run.layout.abstract_state.params, run.layout.gradient_shardings
        )
    )
    assert params["blocks.0.up.kernel"] == "[fsdp, -]"  # tensor=1 drops out
    assert state["blocks.0.up.kernel"] == "[data+fsdp, -]"  # ZeRO-1: optimizer state over data


def test_fp16_overflow_skips_the_step_bit_for_bit(devices):
    config, run = prepared(["mesh.data=1", "precision.policy=fp16"], devices[:1])
    assert run.layout.compute_dtypes["blocks"][0]["up"]["kernel"] == np.float16
    assert run.layout.compute_dtypes["blocks"][0]["norm"]["scale"] is None  # norms stay fp32
    good, bad = batches(2)
    bad = {"x": bad["x"] * 1e6, "y": bad["y"]}  # beyond fp16's range once cast
    with jax.set_mesh(run.mesh):
        state = init_state(config.train.seed, run.layout)
        step = jit_train_step(run.layout, run.task, run.lr_schedule, 1, run.mesh)
        state, _ = step(state, good)
        before = jax.device_get(state)
        state, metrics = step(state, bad)
        after = jax.device_get(state)
    assert int(metrics["skipped_steps"]) == 1
    jax.tree.map(np.testing.assert_array_equal, after.params, before.params)
    jax.tree.map(
        np.testing.assert_array_equal, after.opt_state.inner_state, before.opt_state.inner_state
    )
    assert float(after.opt_state.scale) == float(before.opt_state.scale) / 2


@pytest.mark.parametrize("cast_inputs", [False, True])
def test_batch_floats_reach_the_loss_in_their_dtype_and_weights_in_the_compute_dtype(
    devices, cast_inputs
):
    """A float input (a diffusion timestep) stays float32 unless precision.cast_inputs."""
    seen = {}

    def spying_loss(model, batch, rng):
        seen["x"], seen["kernel"] = batch["x"].dtype, model.embed.kernel[...].dtype
        seen["scale"] = model.blocks[0].norm.scale[...].dtype
        return net_loss(model, batch, rng)

    overrides = ["mesh.data=1", "precision.policy=bf16", f"precision.cast_inputs={cast_inputs}"]
    config, run = prepared(overrides, devices[:1], loss=spying_loss)
    with jax.set_mesh(run.mesh):
        state = init_state(config.train.seed, run.layout)
        step = jit_train_step(run.layout, run.task, run.lr_schedule, 1, run.mesh)
        _, metrics = step(state, batches(1)[0])
    x_dtype = jax.numpy.bfloat16 if cast_inputs else np.float32
    assert seen == {"x": x_dtype, "kernel": jax.numpy.bfloat16, "scale": np.float32}
    assert metrics["loss"].dtype == np.float32


def test_force_policy_keeps_a_submodule_in_fp32(devices):
    def model(rngs):
        net = Net(rngs)
        paisoar_jax.force_policy(net.head, "fp32")
        return net

    config, run = prepared(["mesh.data=1", "precision.policy=bf16"], devices[:1], model=model)
    dtypes = run.layout.compute_dtypes
    assert dtypes["head"]["kernel"] is None and dtypes["embed"]["kernel"] == jax.numpy.bfloat16


def test_remat_blocks_by_path_and_by_helper(devices):
    """remat.blocks and paisoar_jax.remat_block checkpoint the blocks, eval_data too (each
    eval row's model under vmap); gradients and eval sums unchanged."""

    def helped(rngs):
        net = Net(rngs)
        for block in net.blocks:
            paisoar_jax.remat_block(block)
        return net

    results = {}
    for name, overrides, model in (
        ("none", [], Net),
        ("by path", ["remat.policy=full", "remat.blocks=[blocks\\.\\d+$]"], Net),
        ("helper", ["remat.policy=full"], helped),
    ):
        config, run = prepared(
            ["mesh.data=1", *overrides], devices[:1], model=model, eval_data=examples(32, 2)
        )
        layout = run.layout
        with jax.set_mesh(run.mesh):
            state = init_state(config.train.seed, layout)
            grad_fn = gradient_function(layout, run.task)
            batch = batches(1)[0]
            grads = grad_fn(state.params, state.model_state, batch)
            evaluate = jit_eval_step(layout, run.task, run.mesh)
            sums = evaluate(state.params, state.model_state, batch, np.ones(16, bool))
            results[name] = jax.device_get((grads, sums))
            jaxpr = str(jax.make_jaxpr(grad_fn)(state.params, state.model_state, batch))
        assert ("remat" in jaxpr) == (name != "none"), name
    for name in ("by path", "helper"):
        jax.tree.map(np.testing.assert_allclose, results[name], results["none"])


BAD_INPUT = {
    "loss not a scalar": (
        {"loss": lambda model, batch, rng: (model(batch["x"]).mean(-1), {})},
        [],
        "loss must return a scalar loss first; it returned an array of shape (16,)",
    ),
    "loss without metrics": (
        {"loss": lambda model, batch, rng: model(batch["x"]).mean()},
        [],
        "loss must return (loss, metrics)",
    ),
    "rule matching nothing": (
        {},
        ['sharding.rules=[["attention\\\\.kernel", [fsdp]]]'],
        "sharding.rules: 'attention\\\\.kernel' matches no parameter",
    ),
    "axis that does not divide": (
        {},
        ["mesh.data=2", "mesh.tensor=4", 'sharding.rules=[["head\\\\.kernel", [null, tensor]]]'],
        "on head.kernel (shape (64, 6)): dimension 1 (size 6) is not divisible by mesh tensor=4",
    ),
    "unknown axis": (
        {},
        ['sharding.rules=[["head\\\\.kernel", [model, null]]]'],
        "unknown axis 'model'",
    ),
    "batch not over the shards": (
        {"data": batches(2, rows=12)},
        ["train.global_batch=12", "mesh.data=8"],
        "train.global_batch=12 is not divisible by the 8 batch shards",
    ),
    "rows not the global batch": (
        {"data": batches(2, rows=8)},
        [],
        "gives batches of 8 rows per process",
    ),
    "remat with no block": ({}, ["remat.policy=full"], "applies to no block of this model"),
    "fp8": ({}, ["precision.policy=fp8"], "precision.policy=fp8 runs the zoo's"),
    "generator data": ({"data": (batch for batch in batches(2))}, [], "one-shot iterator"),
    # Before: a KeyError traceback at the first eval, 50 steps of work in.
    "eval data with another key": (
        {"eval_data": {"inputs": examples()["x"], "y": examples()["y"]}},
        ["train.eval_every=50"],
        "eval_data: the loss fails on its batches (inputs: float32[16, 16], y: int32[16]): "
        "KeyError: 'x'",
    ),
    "eval data of another width": (
        {"eval_data": {"x": np.zeros((64, 8), np.float32), "y": examples()["y"][:64]}},
        ["train.eval_every=50"],
        "eval_data: the loss fails on its batches (x: float32[16, 8], y: int32[16])",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_a_one_line_user_error(case, capsys, tmp_path):
    parts, overrides, message = BAD_INPUT[case]
    parts = {"model": Net, "loss": net_loss, "data": examples(), **parts}
    with pytest.raises(UserError) as refused:  # a ValueError: caught as any bad value is
        paisoar_jax.fit(None, [*BASE, f"run.dir={tmp_path}", *overrides], **parts)
    assert isinstance(refused.value, ValueError)
    assert "\n" not in str(refused.value) and message in str(refused.value), str(refused.value)
    assert not capsys.readouterr().err.strip()  # raised, not printed


UNCAUGHT = """
import paisoar_jax
paisoar_jax.fit(None, ["train.stepz=3"])
print("not reached")
"""


def test_an_uncaught_bad_input_in_a_script_is_one_line_and_exit_2(tmp_path):
    import subprocess

    from conftest import PYTHON, subprocess_env

    (tmp_path / "script.py").write_text(UNCAUGHT)
    result = subprocess.run(
        [PYTHON, "script.py"], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "paisoar_jax.fit: error: unknown config key train.stepz (known: ema_decay, eval_batches,"
        " eval_every, global_batch, grad_accum, hang_timeout_s, harness_every, "
        "harness_include_path, harness_limit, harness_tasks, log_every, memory_limit_gb, "
        "objective, peak_tflops, pipeline_microbatches, pipeline_repeats, profile_steps, "
        "sample_bytes, seed, skip_spikes, steps)"
    ]
    assert "not reached" not in result.stdout


def test_exit_on_error_is_deprecated_and_still_exits_2(tmp_path, capsys):
    with pytest.warns(DeprecationWarning, match="exit_on_error is deprecated"):
        with pytest.raises(SystemExit) as exit_info:
            paisoar_jax.fit(None, model=Net, data=examples(), exit_on_error=True)
    assert exit_info.value.code == 2
    assert "needs loss=" in capsys.readouterr().err


def test_plan_fit_prints_every_parameter(devices, capsys):
    result = paisoar_jax.plan_fit(
        None,
        [*BASE, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", f"sharding.rules={RULES}"],
        model=Net,
        loss=net_loss,
        data=examples(),
    )
    table = capsys.readouterr().out
    rows = {row["path"]: row for row in result["parameters"]}
    assert rows["blocks.0.up.kernel"] == {
        "path": "blocks.0.up.kernel",
        "shape": [64, 128],
        "sharding": "[fsdp, tensor]",
    }
    assert "blocks.1.down.kernel" in table and "[tensor, fsdp]" in table
    assert result["model"] == "custom"
    # No flops_per_example: the compute is unknown, not 0 us at 0.0% efficiency.
    assert "  compute                unknown   (give flops_per_example to count it)" in table
    assert "scaling efficiency unknown" in table and "0.0%" not in table
    assert "  step, no overlap       unknown   scaling efficiency unknown" in table


def test_bench_fit_and_doctor_read_a_model_of_ones_own(tmp_path, capsys):
    overrides = [*BASE, "train.steps=6", "train.log_every=2", f"run.dir={tmp_path}/bench"]
    result = paisoar_jax.bench_fit(None, overrides, model=Net, loss=net_loss, data=examples())
    assert result["model"] == "custom" and result["examples_per_s"] > 0
    assert result["mfu"] is None  # no flops_per_example given
    assert '"examples_per_s"' in capsys.readouterr().out
    run = doctor.load_run(tmp_path / "bench")
    assert all(finding.name != "low-mfu" for finding in doctor.diagnose(run))


class Annotated(nnx.Module):
    """Logical axis names on the weights (flax nnx.with_partitioning): the rules table places
    them as it places the zoo's."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            16, 64, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs
        )
        self.down = nnx.Linear(64, 6, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def test_logical_axis_names_follow_the_rules_table(devices):
    _, run = prepared(
        ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.min_split_size=64"],
        devices,
        model=Annotated,
    )
    placed = {
        path: where
        for path, _, where in rules.describe(
            run.layout.abstract_state.params, run.layout.shardings.params
        )
    }
    assert placed["up.kernel"] == "[fsdp, tensor]"  # embed -> fsdp, mlp -> tensor
    assert placed["down.kernel"] == "[fsdp, -]"  # no names: the default splits its largest dim
    assert placed["up.bias"] == "[fsdp]"  # 64 elements: not below min_split_size=64


def test_the_out_of_memory_fixes_name_the_blocks_of_a_model_of_ones_own():
    from paisoar_jax.run.oom import memory_fixes
    from paisoar_jax.tools.plan.core import memory_settings

    config, _ = api.build_workload(
        api.resolve_config(None, BASE), model=Net, loss=net_loss, data=examples()
    )
    assert (
        memory_fixes(memory_settings(config))[0][0]
        == "remat.policy=dots remat.blocks=[<block path regex>]"
    )


class Stateful(nnx.Module):
    """BatchNorm statistics and a Dropout that keeps its own nnx.Rngs stream (typed keys)."""

    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.norm = nnx.BatchNorm(64, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.down = nnx.Linear(64, 6, rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(jax.nn.relu(self.norm(self.up(x)))))


@pytest.mark.checks("resume", families=["zoo:your own (fit)"])
def test_model_state_with_rng_streams_resumes_exactly(tmp_path):
    """Typed PRNG keys in the model (nnx.Dropout's stream) are saved and restored, and a run
    resumed from step 3 logs what the uninterrupted run logged."""
    common = [*BASE, "train.eval_every=3", "checkpoint.every=3", "mesh.data=4", "mesh.fsdp=2"]
    common.append("optim.schedule=constant")  # the same lr whatever train.steps says
    parts = {"model": Stateful, "loss": net_loss, "data": examples(), "eval_data": examples(64)}
    whole = [*common, "train.steps=6", f"run.dir={tmp_path}/whole"]
    paisoar_jax.fit(None, whole, **parts)
    for steps in (3, 6):
        paisoar_jax.fit(None, [*common, f"train.steps={steps}", f"run.dir={tmp_path}/cut"], **parts)
    fields = ("loss", "accuracy", "grad_norm", "eval_loss", "eval_accuracy")
    logged = {
        name: [tuple(record.get(f) for f in fields) for record in run_records(tmp_path / name)]
        for name in ("whole", "cut")
    }
    assert logged["cut"] == logged["whole"] and len(logged["whole"]) == 6
    # config.yaml says that the program, not its model/data/optim settings, made the run.
    written = (tmp_path / "whole" / "config.yaml").read_text()
    assert written.startswith("# Written by paisoar_jax.fit: the model, loss and data were")
    assert load_config(str(tmp_path / "whole" / "config.yaml")).train.steps == 6
    assert doctor.load_run(tmp_path / "whole").by_fit  # the doctor's advice is a program's


def test_remat_blocks_on_a_zoo_model_is_refused(tmp_path):
    overrides = [*BASE, f"run.dir={tmp_path}", "remat.policy=full", "remat.blocks=[blocks]"]
    with pytest.raises(UserError, match="remat.blocks is for a model of your own"):
        paisoar_jax.fit(None, overrides)


def test_fine_tuning_a_model_with_rng_streams_from_its_export(tmp_path):
    common = [*BASE, "train.eval_every=0", "train.steps=2", "checkpoint.every=2"]
    parts = {"model": Stateful, "loss": net_loss, "data": examples()}
    paisoar_jax.fit(None, [*common, f"run.dir={tmp_path}/first"], **parts)
    paisoar_jax.export_run(tmp_path / "first", tmp_path / "export")
    init = f"checkpoint.init_from={tmp_path}/export"
    summary = paisoar_jax.fit(None, [*common, init, f"run.dir={tmp_path}/tuned"], **parts)
    assert summary["steps"] == 2 and summary["resumed_from"] == 0


def test_remat_blocks_checkpoint_the_outermost_match_only(devices):
    config, run = prepared(
        ["mesh.data=1", "remat.policy=full", "remat.blocks=[blocks\\.\\d+]"], devices[:1]
    )
    model = run.layout.create_model()
    checkpointed = [
        path for path, module in nnx.iter_modules(model) if hasattr(type(module), "_remat_policy")
    ]
    assert sorted(".".join(map(str, path)) for path in checkpointed) == ["blocks.0", "blocks.1"]


def test_rules_lists_and_default_splits_agree_with_zero(devices):
    """`fsdp` inside a list of axes widens over data too, and the default splits params and
    optimizer state on the same dimension."""
    list_rule = '[["blocks\\\\.\\\\d+\\\\.up\\\\.kernel", [[fsdp, tensor], null]]]'
    _, run = prepared(
        [
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "mesh.zero=3",
            f"sharding.rules={list_rule}",
            "sharding.min_split_size=256",
        ],
        devices,
    )
    layout = run.layout
    params = {
        p: w for p, _, w in rules.describe(layout.abstract_state.params, layout.shardings.params)
    }
    state = {
        p: w for p, _, w in rules.describe(layout.abstract_state.params, layout.gradient_shardings)
    }
    assert params["blocks.0.up.kernel"] == "[data+fsdp+tensor, -]"
    _, run = prepared(
        ["mesh.data=2", "mesh.fsdp=4", "mesh.zero=1", "sharding.min_split_size=256"], devices
    )
    layout = run.layout
    params = {
        p: w for p, _, w in rules.describe(layout.abstract_state.params, layout.shardings.params)
    }
    state = {
        p: w for p, _, w in rules.describe(layout.abstract_state.params, layout.gradient_shardings)
    }
    assert (
        params["head.kernel"] == "[fsdp, -]" and state["head.kernel"] == "[data+fsdp, -]"
    )  # (64, 6)
    assert (
        params["blocks.0.up.kernel"] == "[-, fsdp]"
        and state["blocks.0.up.kernel"] == "[-, data+fsdp]"
    )


def test_a_dict_of_jax_arrays_is_examples():
    from paisoar_jax.data.user_data import ExampleData, open_user_data

    data = jax.tree.map(jax.numpy.asarray, examples(32))
    assert isinstance(open_user_data(data, "data"), ExampleData)


def test_a_config_the_zoo_cannot_build_is_refused_before_any_device():
    from paisoar_jax.api import resolve_config

    with pytest.raises(UserError, match="model.variant='resnet99' is not one of"):
        resolve_config(None, ["model.name=resnet", "model.variant=resnet99"])
    with pytest.raises(UserError, match="resnet is convolutional: use bf16"):
        resolve_config(None, ["model.name=resnet", "precision.policy=fp8"])


def test_the_package_lists_its_public_names():
    assert {"fit", "load", "FitResult", "force_policy"} <= set(dir(paisoar_jax))


def test_a_run_directory_of_another_model_says_what_to_do(tmp_path, capsys):
    """Before: `checkpoint .../2 does not fit this model: it has no params.up.bias`, and no
    way out named."""
    common = [*BASE, "train.steps=2", f"run.dir={tmp_path}"]
    paisoar_jax.fit(None, common, model=Net, loss=net_loss, data=examples())
    with pytest.raises(UserError) as refused:
        paisoar_jax.fit(None, common, model=Stateful, loss=net_loss, data=examples())
    error = [str(refused.value)]
    assert "\n" not in error[0] and "does not fit this model" in error[0]
    assert "run.name=..." in error[0] and "checkpoint.resume=never" in error[0]
    # Outside a script (here pytest's runner) the name comes from the model: a lambda's is fit.
    assert (api._program_name(Net), api._program_name(lambda rngs: Net(rngs))) == ("Net", "fit")


def test_a_keras_style_tuple_of_arrays_is_examples(tmp_path):
    """Before: `data=(x, y)` was read as two batches, then `too many values to unpack`."""
    data = examples()
    seen = []

    def tuple_loss(model, batch, rng):
        x, y = batch
        seen.append((x.shape, y.shape))
        return net_loss(model, {"x": x, "y": y}, rng)

    overrides = [*BASE, "train.steps=2", "train.eval_every=2", f"run.dir={tmp_path}"]
    result = paisoar_jax.fit(
        None, overrides, model=Net, loss=tuple_loss, data=(data["x"], data["y"]),
        eval_data=(data["x"][:64], data["y"][:64]),
    )  # fmt: skip
    assert result["steps"] == 2 and "eval_loss" in result
    assert seen[0] == ((16, 16), (16,))


class Odd(nnx.Module):
    """Sizes that 8 divides nowhere: FSDP over 8 devices cannot split its large kernel."""

    def __init__(self, rngs):
        self.wide = nnx.Linear(16, 1031, rngs=rngs)  # 16 x 1031: 16 divides, so it splits
        self.odd = nnx.Linear(1031, 131, rngs=rngs)  # 135,061 elements, no dimension divides
        self.head = nnx.Linear(131, 6, rngs=rngs)  # small: whole by design, not named

    def __call__(self, x):
        return self.head(self.odd(self.wide(x)))


def test_fsdp_names_the_parameters_it_leaves_whole(devices, capsys):
    """Before: mesh.fsdp=8 on a model with no divisible dimension left it whole, silently."""
    prepared(["mesh.data=1", "mesh.fsdp=8"], devices, model=Odd)
    warning = capsys.readouterr().err
    assert "FSDP/ZeRO over 8 devices leaves 1 parameter(s) whole" in warning
    assert "odd.kernel (1031, 131)" in warning and "wide.kernel" not in warning
    assert "head" not in warning  # under sharding.min_split_size: whole on purpose


def test_fewer_rows_than_one_global_batch_are_refused(tmp_path):
    """Before: 10 rows with a global batch of 16 trained, each step repeating 6 of them."""
    with pytest.raises(UserError, match="the train split has 10 examples, fewer than one global"):
        paisoar_jax.fit(
            None,
            [*BASE, "train.steps=2", f"run.dir={tmp_path}"],
            model=Net,
            loss=net_loss,
            data=examples(10),
        )


def test_the_lr_of_an_optax_schedule_is_logged_when_injected(tmp_path, capsys):
    """Before: lr was null for any optax optimizer with its own schedule, injected or not."""
    schedule = optax.cosine_decay_schedule(1e-2, 10)
    optimizers = {
        "injected": optax.inject_hyperparams(optax.adam)(learning_rate=schedule),
        "plain": optax.adam(schedule),
    }
    logged = {}
    for name, optimizer in optimizers.items():
        overrides = [*BASE, "train.steps=3", f"run.dir={tmp_path}/{name}"]
        paisoar_jax.fit(
            None, overrides, model=Net, loss=net_loss, data=examples(), optimizer=optimizer
        )
        logged[name] = [record["lr"] for record in run_records(tmp_path / name)]
    np.testing.assert_allclose(logged["injected"], [schedule(step) for step in range(3)], 1e-6)
    assert logged["plain"] == [None] * 3  # unreadable: said once, not guessed
    assert capsys.readouterr().out.count("lr is not logged: your optimizer's learning rate") == 1


def test_the_moving_average_of_the_weights_resumes_exactly_and_loads(tmp_path, capsys):
    """train.ema_decay: each step average * d + new * (1 - d); checkpointed (a resumed run
    ends on the uninterrupted run's average), result.ema_model, load(ema=True), export --ema;
    turned on mid-run it starts from the restored weights."""
    from paisoar_jax.tools import export

    decay = 0.5
    common = [*BASE, "checkpoint.every=2", "optim.schedule=constant", f"train.ema_decay={decay}"]
    parts = {"model": Net, "loss": net_loss, "data": examples(), "optimizer": optax.adam(1e-2)}
    steps = []
    for step in range(1, 4):  # one step a run: the weights after each, from its checkpoint
        run = [*common, f"train.steps={step}", "checkpoint.every=1", f"run.dir={tmp_path}/cut"]
        steps.append(paisoar_jax.fit(None, run, **parts).model)
    whole = paisoar_jax.fit(None, [*common, "train.steps=3", f"run.dir={tmp_path}/whole"], **parts)
    weights = lambda module: nnx.to_pure_dict(nnx.state(module, nnx.Param))
    expected = weights(Net(nnx.Rngs(0)))  # the factory's weights at the run's seed
    for module in steps:
        expected = jax.tree.map(lambda a, w: a * decay + w * (1 - decay), expected, weights(module))
    for average in (whole.ema_model, paisoar_jax.load(tmp_path / "whole", Net, ema=True)):
        jax.tree.map(np.testing.assert_allclose, weights(average), expected)
    assert export.main([str(tmp_path / "whole"), "--output", str(tmp_path / "out"), "--ema"]) == 0
    exported = paisoar_jax.load(tmp_path / "out", Net)
    jax.tree.map(np.testing.assert_allclose, weights(exported), expected)
    # A run without the average: none to load; turned on later, it starts from the weights.
    plain = [*BASE, f"run.dir={tmp_path}/plain"]
    assert paisoar_jax.fit(None, [*plain, "train.steps=2"], **parts).ema_model is None
    with pytest.raises(UserError, match="holds no moving average of the weights"):
        paisoar_jax.load(tmp_path / "plain", Net, ema=True)
    on_later = [*plain, "train.steps=3", f"train.ema_decay={decay}"]
    later = paisoar_jax.fit(None, on_later, **parts)
    assert "the average starts from its weights" in capsys.readouterr().err
    assert later.ema_model is not None
    # Turned off again: the saved average is dropped, the run goes on.
    assert paisoar_jax.fit(None, [*plain, "train.steps=4"], **parts)["steps"] == 4
