"""Mixed precision: matmuls in the compute dtype, fp32 islands, fp16 trains like fp32."""

import json
import subprocess

import jax
import jax.numpy as jnp
import pytest
from conftest import PYTHON, subprocess_env
from flax import nnx

from paisoar_jax.config import load_config
from paisoar_jax.precision import float32_island, force_policy, fp32_function, get_policy
from paisoar_jax.step import loss_fn
from paisoar_jax.zoo import build_model, task_for


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
    # fp16 attention runs in fp32 (see models/gpt.py), so check it only for bf16.
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


def run_train(*overrides, timeout):
    """`python -m paisoar_jax.train` on one CPU device, quietly."""
    return subprocess.run(
        [
            PYTHON,
            "-m",
            "paisoar_jax.train",
            "train.eval_every=0",
            "train.sample_bytes=0",
            "run.progress=false",
            "run.tensorboard=false",
            *overrides,
        ],
        env=one_device_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def final_loss(policy, tmp_path, steps=100):
    run_dir = tmp_path / policy
    result = run_train(
        f"precision.policy={policy}", f"train.steps={steps}", f"run.dir={run_dir}", timeout=400
    )
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records[-1]


@pytest.mark.slow
def test_fp16_default_model_ends_within_2_percent_of_fp32(tmp_path):
    fp32, fp16 = final_loss("fp32", tmp_path), final_loss("fp16", tmp_path)
    assert fp32["loss_scale"] == 1.0 and fp16["loss_scale"] >= 1.0
    assert abs(fp16["loss"] - fp32["loss"]) / fp32["loss"] < 0.02, (fp16["loss"], fp32["loss"])
    assert fp16["loss"] < 3.0  # it did learn (4.2 at the start)


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


@pytest.mark.slow
def test_fp16_scale_that_keeps_falling_warns_of_divergence(tmp_path):
    # Params blown up by a huge step: every later gradient overflows, however small the scale.
    result = run_train(
        "precision.policy=fp16",
        *EXPLODING,
        "train.steps=8",
        "train.log_every=1",
        f"run.dir={tmp_path / 'run'}",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the loss scale fell at each of the last 3 log steps" in result.stderr
    assert "diverging, not just overflowing" in result.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records[-1]["skipped_steps"] >= 5
    assert records[-1]["loss_scale"] <= 2.0**15 / 2**5
