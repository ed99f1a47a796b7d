"""Mixed precision: matmuls in the compute dtype, fp32 islands, fp16 trains like fp32."""

import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import PYTHON, subprocess_env, task_for
from flax import nnx

from paisoar_jax.config import load_config
from paisoar_jax.engine.step import loss_fn
from paisoar_jax.numerics.precision import float32_island, force_policy, fp32_function, get_policy
from paisoar_jax.tasks.zoo import build_model


def equations(jaxpr):
    """Every equation of a jaxpr, descending into scan/remat/pjit bodies."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from equations(inner)


def loss_jaxpr(policy, force=None):
    config = load_config(None, ["model.seq_len=16", "model.layers=2", "model.width=32"])
    with nnx.use_eager_sharding(False):
        model = build_model(config.model, get_policy(policy), "none", nnx.Rngs(0))
    if force:
        force_policy(model.blocks, force)
    graphdef, params = nnx.split(model)
    tokens = jnp.zeros((2, 17), jnp.int32)
    task, key = task_for(config), jax.random.PRNGKey(0)
    loss = lambda p: loss_fn(nnx.to_pure_dict(p), {}, graphdef, tokens, task, key)[0]  # noqa: E731
    return jax.make_jaxpr(loss)(params).jaxpr


@pytest.mark.parametrize("policy, dtype", [("fp16", jnp.float16), ("bf16", jnp.bfloat16)])
def test_matmuls_in_compute_dtype_islands_in_fp32(policy, dtype):
    eqns = list(equations(loss_jaxpr(policy)))
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    # Weight matmuls have no batch dimensions; attention's (batch, heads) ones do. On CPU
    # fp16 attention runs in fp32 (see models/attention.py), so check it only for bf16.
    weight_dots = [e for e in dots if not e.params["dimension_numbers"][1][0]]
    checked = dots if dtype == jnp.bfloat16 else weight_dots
    assert weight_dots and all(v.aval.dtype == dtype for e in checked for v in e.invars)
    # The final logits accumulate into fp32 (preferred_element_type).
    assert any(e.outvars[0].aval.dtype == jnp.float32 for e in dots)
    # Softmax (exp), layer norm (rsqrt) and the loss's log run in fp32.
    for name in ("exp", "rsqrt", "log"):
        found = [e for e in eqns if e.primitive.name == name]
        assert found and all(e.outvars[0].aval.dtype == jnp.float32 for e in found), name


def test_force_policy_keeps_a_submodule_in_fp32():
    eqns = list(equations(loss_jaxpr("fp16", force="fp32")))
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    in_dtypes = {v.aval.dtype for e in dots for v in e.invars}
    assert jnp.dtype(jnp.float32) in in_dtypes  # the blocks, forced
    assert jnp.dtype(jnp.float16) in in_dtypes  # the logits, still fp16


def test_fp32_function_casts_its_inputs():
    seen = {}

    @fp32_function
    def norm(x, scale=None):
        seen["dtypes"] = (x.dtype, scale.dtype)
        return x * scale

    out = norm(jnp.ones(3, jnp.float16), scale=jnp.ones(3, jnp.bfloat16))
    assert seen["dtypes"] == (jnp.float32, jnp.float32) and out.dtype == jnp.float32
    assert float32_island(jnp.ones(2, jnp.bfloat16)).dtype == jnp.float32


def one_device_env():
    """Like a user's plain machine: one CPU device, as the default run sees it."""
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)
    return env


# A learning rate that blows the params up in one step, on a model that compiles fast.
EXPLODING = [
    "optim.lr=1e30",
    "optim.clip_norm=0",
    "optim.warmup_steps=0",
    "model.layers=1",
    "model.width=32",
    "model.seq_len=16",
]


QUIET_TRAIN = [
    "train.eval_every=0",
    "train.sample_bytes=0",
    "run.progress=false",
    "run.tensorboard=false",
]


def run_train(*overrides, timeout):
    """`python -m paisoar_jax.train` on one CPU device, quietly."""
    return subprocess.run(
        [PYTHON, "-m", "paisoar_jax.train", *QUIET_TRAIN, *overrides],
        env=one_device_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def final_losses(policies, tmp_path, steps=100):
    """The last metrics record of a run per policy; the runs go side by side (one device
    each: the two cores run two of them in about the time of one and a half)."""
    processes = {}
    for policy in policies:
        run_dir = tmp_path / policy
        arguments = [f"precision.policy={policy}", f"train.steps={steps}", f"run.dir={run_dir}"]
        processes[policy] = subprocess.Popen(
            [PYTHON, "-m", "paisoar_jax.train", *QUIET_TRAIN, *arguments],
            env=one_device_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finals = {}
    for policy, process in processes.items():
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-2000:]
        lines = (tmp_path / policy / "metrics.jsonl").read_text().splitlines()
        finals[policy] = json.loads(lines[-1])
    return finals


def test_bf16_non_finite_loss_stops_with_the_step(tmp_path):
    result = run_train(
        "precision.policy=bf16",
        *EXPLODING,
        "train.steps=6",
        "train.log_every=2",
        f"run.dir={tmp_path / 'run'}",
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "training diverged" in last and "at step " in last


# Models of one's own, written with plain flax layers and no dtype anywhere: the policy must
# still decide their arithmetic (issue 30).
class OwnCNN(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 16, (3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.1)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, images, rng=None):
        x = jax.nn.relu(self.norm(self.conv(images)))
        x = self.drop(x, rngs=rng) if rng is not None else x
        return self.head(x.mean(axis=(1, 2)))


class OwnMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden, self.out = nnx.Linear(8, 64, rngs=rngs), nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x, rng=None):
        return self.out(jax.nn.relu(self.hidden(x)))


class OwnTransformer(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(4, 16, decode=False, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 16, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, tokens, rng=None):
        x = self.embed(tokens)
        x = x + self.attention(self.norm(x))
        x = x + self.fc2(jax.nn.gelu(self.fc1(x)))
        return self.head(x.mean(axis=1))


def own_loss(model, batch, rng):
    logits = model(batch["x"], rng).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


OWN_DATA = {
    "cnn": lambda rng: rng.normal(size=(64, 8, 8, 3)).astype(np.float32),
    "mlp": lambda rng: rng.normal(size=(64, 8)).astype(np.float32),
    "transformer": lambda rng: rng.integers(0, 32, (64, 6)).astype(np.int32),
}
OWN_MODELS = {"cnn": OwnCNN, "mlp": OwnMLP, "transformer": OwnTransformer}
HEAVY = ("dot_general", "conv_general_dilated")
# Each model's first kernel split over its output features (tensor parallelism).
TENSOR_RULES = {
    "cnn": 'sharding.rules=[["conv\\\\.kernel", [null, null, null, tensor]]]',
    "mlp": 'sharding.rules=[["hidden\\\\.kernel", [null, tensor]]]',
    "transformer": 'sharding.rules=[["fc1\\\\.kernel", [null, tensor]]]',
}


def own_step_jaxpr(kind, overrides):
    from paisoar_jax import api
    from paisoar_jax.engine.step import jit_train_step
    from paisoar_jax.run.setup import setup

    rng = np.random.default_rng(0)
    data = {"x": OWN_DATA[kind](rng), "y": rng.integers(0, 10, 64).astype(np.int32)}
    base = ["train.global_batch=16", "run.progress=false", "run.tensorboard=false"]
    config = api.resolve_config(None, [*base, *overrides])
    config, workload = api.build_workload(
        config, model=OWN_MODELS[kind], loss=own_loss, optimizer=optax.adam(1e-3), data=data
    )
    run = setup(config, workload, jax.devices())
    step = jit_train_step(run.layout, run.task, run.lr_schedule, config.train.grad_accum, run.mesh)
    with jax.set_mesh(run.mesh):
        return step.trace(run.layout.abstract_state, run.task.batch_shape(16)).jaxpr


@pytest.mark.parametrize("kind", OWN_MODELS)
@pytest.mark.parametrize(
    "policy, mesh",
    [
        ("bf16", ["mesh.data=8"]),
        ("fp16", ["mesh.data=8", "mesh.zero=3", "sharding.min_split_size=16"]),
        ("bf16", ["mesh.data=2", "mesh.tensor=4", "rules"]),
    ],
    ids=["bf16-data", "fp16-zero3", "bf16-tensor-rules"],
)
def test_a_plain_nnx_model_computes_in_the_policy_dtype(kind, policy, mesh):
    """Every matmul and convolution of the train step (forward and backward) takes operands
    in the compute dtype, though no layer was given a dtype."""
    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[policy]
    mesh = [TENSOR_RULES[kind] if override == "rules" else override for override in mesh]
    eqns = list(equations(own_step_jaxpr(kind, [f"precision.policy={policy}", *mesh]).jaxpr))
    heavy = [e for e in eqns if e.primitive.name in HEAVY]
    assert heavy
    # The one exception, upstream: jax's attention (which nnx.MultiHeadAttention calls)
    # accumulates the scores in fp32, so their gradient reaches the two score products of
    # the backward pass in fp32 beside a compute-dtype operand.
    score_backward = [e for e in heavy if _is_attention_score_backward(e)]
    assert len(score_backward) == (4 if kind == "transformer" else 0)
    dtypes = {str(v.aval.dtype) for e in heavy if e not in score_backward for v in e.invars}
    assert dtypes == {jnp.dtype(dtype).name}, dtypes
    if kind == "cnn":
        assert any(e.primitive.name == "conv_general_dilated" for e in heavy)
    # The norms' statistics stay fp32 (flax's): a mean of squares in fp32.
    if kind in ("cnn", "transformer"):
        assert any(
            e.primitive.name == "rsqrt" and e.outvars[0].aval.dtype == jnp.float32 for e in eqns
        )


def _is_attention_score_backward(eqn) -> bool:
    stack = str(eqn.source_info.name_stack)
    return stack.startswith("transpose(") and ("BNTS" in stack)


def test_a_layer_forced_to_fp32_or_given_a_dtype_keeps_it():
    from paisoar_jax.numerics.precision import follow_policy

    model = OwnTransformer(nnx.Rngs(0))
    model.fc2 = nnx.Linear(64, 16, dtype=jnp.float32, rngs=nnx.Rngs(1))
    force_policy(model.attention, "fp32")
    assert follow_policy(model, get_policy("bf16")) > 0
    assert model.fc1.dtype == jnp.bfloat16 and model.embed.dtype == jnp.bfloat16
    assert model.fc2.dtype == jnp.float32  # the user's own choice
    assert model.attention.dtype is None and model.attention.query.dtype is None  # forced fp32
    assert follow_policy(OwnMLP(nnx.Rngs(0)), get_policy("fp32")) == 0


class OwnViT(nnx.Module):
    """A vision transformer of one's own: stock flax layers only (nnx.MultiHeadAttention)."""

    def __init__(self, rngs):
        self.embed = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(4, 32, decode=False, rngs=rngs)
        self.head = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x_BxPx8):
        h_BxPxD = self.embed(x_BxPx8)
        h_BxPxD = h_BxPxD + self.attention(self.norm(h_BxPxD))
        return self.head(h_BxPxD.mean(1))


def vit_loss(model, batch, rng):
    logits = model(batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def test_an_own_transformer_trains_under_fp16_on_cpu_as_on_a_gpu(tmp_path):
    """Before: jax.nn.dot_product_attention's F16_F16_F32 dots were refused by XLA:CPU, in a
    traceback that dumped the step's jaxpr."""
    import paisoar_jax

    x = np.random.default_rng(0).normal(size=(32, 4, 8)).astype(np.float32)
    data = {"x": x, "y": (x[:, 0, 0] > 0).astype(np.int32)}
    overrides = ["precision.policy=fp16", "train.steps=2", "train.global_batch=16",
                 "train.grad_accum=2", "train.eval_every=0", "run.progress=false",
                 f"run.dir={tmp_path / 'run'}", "checkpoint.enabled=false"]  # fmt: skip
    result = paisoar_jax.fit(
        None, overrides, model=OwnViT, loss=vit_loss, optimizer=optax.adam(1e-3), data=data,
    )  # fmt: skip
    assert result["steps"] == 2 and np.isfinite(result["final_loss"])
    # The product itself: fp16 operands, fp32 sums, as a GPU computes it.
    q_BxTxHxK = jax.random.normal(jax.random.key(1), (2, 4, 2, 8), jnp.float16)
    fp16 = jax.jit(jax.nn.dot_product_attention)(q_BxTxHxK, q_BxTxHxK, q_BxTxHxK)
    fp32 = jax.nn.dot_product_attention(*(q_BxTxHxK.astype(jnp.float32),) * 3)
    assert fp16.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(fp16, np.float32), fp32, atol=2e-3)


def test_an_error_from_the_compiled_step_is_one_line_without_the_jaxpr():
    from paisoar_jax.engine.compilation import readable_step_errors
    from paisoar_jax.errors import UserError

    jaxpr = "{ lambda ; a:f16[2,4]. let b:f32[2,2] = dot_general a a in (b,) }"

    def lowering_that_fails(error):  # as jax's lowering cache raises: inside its KeyError
        try:
            raise KeyError(("closed_call", jaxpr))
        except KeyError:
            raise error  # noqa: B904 (jax chains it implicitly)

    with pytest.raises(UserError) as refused, readable_step_errors():
        lowering_that_fails(
            ValueError("The precision 'F16_F16_F32' is not supported by dot_general on CPU")
        )
    message = str(refused.value)
    assert "\n" not in message and "{ lambda" not in message
    assert "asks dot_general for precision F16_F16_F32, which XLA on CPU lacks" in message
    assert "set precision.policy=bf16 or fp32" in message
    # Any other error is raised as it was (a bug keeps its traceback), less the jaxpr.
    with pytest.raises(RuntimeError) as kept, readable_step_errors():
        lowering_that_fails(RuntimeError("a bug of ours"))
    assert kept.value.__suppress_context__
