"""Remat policies: the same gradients, and measurably less compiled memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import plan_run, task_for

from paisoar_jax.engine.state import init_state
from paisoar_jax.engine.step import jit_train_step, loss_and_grads
from paisoar_jax.numerics.remat import POLICIES, recomputed_activation
from paisoar_jax.parallel import sharding

# Twelve layers, as GPT-2 small, at a width that compiles in seconds on a CPU.
TWELVE_LAYERS = ["model.layers=12", "model.width=64", "model.seq_len=256"]


def layout_for(devices, policy, overrides=()):
    """(config, layout, mesh) of TINY + overrides with `policy`, on one device."""
    config, mesh, layout, _ = plan_run(
        [*overrides, "mesh.data=1", f"remat.policy={policy}"], devices[:1]
    )
    return config, layout, mesh


def temporary_bytes(devices, policy):
    """Compiled temporary memory of the twelve-layer train step (abstract inputs only)."""
    config, layout, mesh = layout_for(devices, policy, TWELVE_LAYERS)
    batch = jax.ShapeDtypeStruct(
        (config.train.global_batch, config.model.seq_len + 1),
        np.int32,
        sharding=sharding.batch_sharding(mesh),
    )
    with jax.set_mesh(mesh):
        step = jit_train_step(layout, task_for(config), lambda count: 1e-3, 1, mesh)
        compiled = step.lower(layout.abstract_state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def gradients(devices, policy):
    config, layout, mesh = layout_for(devices, policy)
    tokens = np.random.default_rng(0).integers(0, 256, (4, 33), dtype=np.int32)
    with jax.set_mesh(mesh):
        params, task = init_state(config.train.seed, layout).params, task_for(config)
        grad_fn = jax.jit(lambda p, t: loss_and_grads(p, {}, layout.graphdef, t, task)[1])
        return grad_fn(params, tokens)


@pytest.fixture(scope="module")
def reference_gradients(devices):
    return gradients(devices, "none")


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"none"}))
def test_every_policy_gives_the_gradients_of_none(devices, reference_gradients, policy):
    got = gradients(devices, policy)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference_gradients), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


ACTIVATIONS = {
    "gelu": lambda x, bias: jax.nn.gelu(x + bias),
    "erf_gelu": lambda x, bias: jax.nn.gelu(x + bias, approximate=False),
    "swiglu": lambda gate, up: jax.nn.silu(gate) * up,
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_an_mlp_activation_keeps_only_its_inputs_for_its_backward(name):
    """Plainly differentiated, GELU keeps its tanh and x + bias (SwiGLU its sigmoid), each
    as wide as the MLP; recomputed_activation keeps its two inputs alone, and its gradients
    are the plain ones."""
    function = ACTIVATIONS[name]
    generator = np.random.default_rng(0)
    first = jnp.asarray(generator.normal(size=(4, 16)), jnp.bfloat16)
    second = jnp.asarray(generator.normal(size=(16,) if "gelu" in name else (4, 16)), jnp.bfloat16)
    plain_out, plain_backward = jax.vjp(function, first, second)
    out, backward = jax.vjp(lambda *x: recomputed_activation(function, *x), first, second)
    kept = [(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(backward)]
    assert kept == [(first.shape, first.dtype), (second.shape, second.dtype)]
    plain_wide = [leaf for leaf in jax.tree.leaves(plain_backward) if leaf.shape == first.shape]
    assert len(plain_wide) > 2  # what is saved: more than the inputs
    np.testing.assert_array_equal(out, plain_out)
    cotangent = jnp.ones_like(out)
    for got, expected in zip(backward(cotangent), plain_backward(cotangent), strict=True):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=1e-2, atol=1e-2
        )
