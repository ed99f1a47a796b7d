"""fp8 matmuls with delayed scaling: numerics, the scaling state, sharding, resume, refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_RESNET, build_run, token_batches
from flax import nnx

from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError
from paisoar_jax.numerics.fp8 import Fp8Dot
from paisoar_jax.parallel import sharding
from paisoar_jax.tasks.zoo import zoo_workload

E4M3_MAX = 448.0


def test_fp8_dot_records_amax_and_scales_from_the_history():
    """One matmul, two steps: step 1 records each tensor's amax (the backward pass hands the
    new scaling state back as its gradient); step 2 scales by amax / 448 and lands within
    fp8's error of the bf16 product."""
    x = jax.random.normal(jax.random.key(0), (4, 16, 64)).astype(jnp.bfloat16)
    kernel = (0.05 * jax.random.normal(jax.random.key(1), (64, 32))).astype(jnp.bfloat16)
    with nnx.use_eager_sharding(False):  # no mesh here: the trainer builds models the same way
        graphdef, meta = nnx.split(Fp8Dot(history=4))

    def loss(meta, x, kernel):
        y = nnx.merge(graphdef, meta)(x, kernel)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    (next_meta, _, _), y = step(meta, x, kernel)
    dy = 2 * y.astype(jnp.float32)
    for tensor, value in (("lhs", x), ("rhs", kernel), ("grad", dy)):
        history = np.asarray(next_meta[f"{tensor}_amax_history"][...])
        np.testing.assert_allclose(history[0], jnp.abs(value).max(), rtol=1e-2, err_msg=tensor)
        assert np.count_nonzero(history) == 1, tensor

    (after, _, _), y = step(next_meta, x, kernel)
    np.testing.assert_allclose(
        after["lhs_scale"][...], jnp.abs(x).max().astype(jnp.float32) / E4M3_MAX, rtol=1e-2
    )
    reference = jnp.einsum("btd,df->btf", x, kernel, preferred_element_type=jnp.float32)
    error = jnp.linalg.norm(y.astype(jnp.float32) - reference) / jnp.linalg.norm(reference)
    assert 0 < float(error) < 0.05  # quantized (not exact), but close


def train_steps(overrides, devices, steps, same_batch=True):
    """(losses, state, train_step, first batch) after `steps` steps of the tiny GPT."""
    _, mesh, _, state, train_step = build_run(overrides, devices)
    batches = token_batches(1 if same_batch else steps)
    losses = []
    with jax.set_mesh(mesh):
        for index in range(steps):
            batch = jax.device_put(batches[index % len(batches)], sharding.batch_sharding(mesh))
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
    return losses, state, train_step, batch


def test_fp8_is_refused_for_convolutional_models():
    with pytest.raises(UserError, match="resnet is convolutional: use bf16"):
        zoo_workload(load_config(None, [*TINY_RESNET, "precision.policy=fp8"]))


def test_fp8_matmul_refuses_an_equation_it_would_compute_wrongly():
    from paisoar_jax.numerics.fp8 import matmul
    from paisoar_jax.numerics.precision import get_policy

    with nnx.use_eager_sharding(False):
        dots = nnx.Dict({"mlp": Fp8Dot(history=4)})
    x, kernel = jnp.ones((2, 3, 8), jnp.bfloat16), jnp.ones((8, 4), jnp.bfloat16)
    policy = get_policy("fp8")
    assert matmul("btd,df->btf", x, kernel, "mlp", policy=policy, dots=dots).shape == (2, 3, 4)
    with pytest.raises(ValueError, match="keeps the other axes in order"):
        matmul("btd,df->fbt", x, kernel, "mlp", policy=policy, dots=dots)
    with pytest.raises(ValueError, match="built without fp8 state"):
        matmul("btd,df->btf", x, kernel, "mlp", policy=policy, dots=None)
