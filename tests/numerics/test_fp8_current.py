"""fp8 with current scaling (precision.fp8=tensorwise|rowwise, numerics/fp8.py).

The three GEMMs against fp32's math within fp8's rounding; rowwise keeps the rows an outlier
row would wash out of one tensor-wide scale; each mode trains as bf16 does; a matmul under
precision.fp8_min_size stays in bf16. (The H200 target's fp8 GEMMs: the gpu_aot tier.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build_run
from flax import nnx

from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError
from paisoar_jax.numerics import fp8
from paisoar_jax.numerics.precision import Policy, policy_of


def fp32_product(x, kernel):
    return jnp.einsum("btd,dhe->bthe", x.astype(jnp.float32), kernel.astype(jnp.float32))


def relative_error(got, expected):
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - expected)) / jnp.max(jnp.abs(expected)))


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_the_three_gemms_are_fp32s_within_fp8s_rounding(rowwise):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 8, 32)), jnp.bfloat16)
    kernel = jnp.asarray(rng.normal(size=(32, 4, 16)) * 0.1, jnp.bfloat16)

    def loss(product):
        return lambda x, kernel: jnp.sum(product(x, kernel).astype(jnp.float32) ** 2)

    ours = lambda x, kernel: fp8.current_scaled(x, kernel, 1, rowwise)  # noqa: E731
    # e4m3 keeps 3 bits of mantissa (1/16 relative), e5m2 2: a few percent of the largest.
    assert relative_error(ours(x, kernel), fp32_product(x, kernel)) < 0.06
    gradients = jax.grad(loss(ours), argnums=(0, 1))(x, kernel)
    expected = jax.grad(loss(fp32_product), argnums=(0, 1))(x, kernel)
    for got, reference in zip(gradients, expected, strict=True):
        assert got.shape == reference.shape and got.dtype == jnp.bfloat16
        assert relative_error(got, reference) < 0.1


def test_rowwise_keeps_the_rows_an_outlier_washes_out_of_one_scale():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, 8, 32)).astype(np.float32)
    x[0, 0] *= 1e5  # one token's activations 1e5 times the others' (e4m3 spans 2^-9..448)
    x, kernel = jnp.asarray(x, jnp.bfloat16), jnp.asarray(rng.normal(size=(32, 2, 8)), jnp.bfloat16)
    expected = fp32_product(x, kernel)[0, 1:]  # the ordinary rows
    tensorwise = fp8.current_scaled(x, kernel, 1, False)[0, 1:]
    rowwise = fp8.current_scaled(x, kernel, 1, True)[0, 1:]
    assert relative_error(rowwise, expected) < 0.06
    assert relative_error(tensorwise, expected) > 0.2  # their values fell under e4m3's range


@pytest.mark.parametrize("mode", ["delayed", "tensorwise", "rowwise"])
def test_each_mode_trains_as_bf16_does(devices, mode, bf16_losses):
    """30 steps of a batch the model learns: each step within 3% of bf16's loss."""
    losses = pattern_losses(["precision.policy=fp8", f"precision.fp8={mode}"], devices)
    np.testing.assert_allclose(losses, bf16_losses, rtol=0.03)  # 0.5 to 1.3% seen
    assert losses[-1] < 0.1 * losses[0]


def pattern_losses(overrides, devices, steps=30):
    from test_spikes import pattern_batch

    settings = ["optim.warmup_steps=0", "optim.schedule=constant", *overrides]
    _, _, _, state, train_step = build_run(settings, devices[:1])
    losses = []
    for _ in range(steps):
        state, metrics = train_step(state, pattern_batch())
        losses.append(float(metrics["loss"]))
    return np.array(losses)


@pytest.fixture(scope="module")
def bf16_losses(devices):
    return pattern_losses(["precision.policy=bf16"], devices)


def test_a_matmul_under_the_minimum_size_stays_in_bf16():
    x = jnp.ones((2, 3, 64), jnp.bfloat16)
    kernel = jnp.full((64, 256), 0.01, jnp.bfloat16)
    policy = Policy(compute_dtype=jnp.bfloat16, fp8=True, fp8_scaling="tensorwise")
    small = Policy(**{**policy.__dict__, "fp8_min_size": 128})  # 64 contracted: under it
    with nnx.use_eager_sharding(False):
        dots = fp8.block_dots(policy, ("mlp_in",))

    def program(policy):
        return jax.jit(
            lambda x, k: fp8.matmul("btd,df->btf", x, k, "mlp_in", policy=policy, dots=dots)
        )

    fp8_text = program(policy).lower(x, kernel).as_text()
    assert "f8E4M3FN" in fp8_text
    assert "f8E4M3FN" not in program(small).lower(x, kernel).as_text()


def test_the_policy_carries_the_configs_scaling():
    config = load_config(None, ["precision.policy=fp8", "precision.fp8=rowwise"])
    policy = policy_of(config.precision)
    assert (policy.fp8, policy.fp8_scaling, policy.fp8_min_size) == (True, "rowwise", 0)
    with pytest.raises(UserError, match="precision.fp8_min_size"):
        load_config(None, ["precision.fp8_min_size=-1"])
    with pytest.raises(UserError, match="precision.fp8"):
        load_config(None, ["precision.fp8=blockwise"])
