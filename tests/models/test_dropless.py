"""Dropless experts on grouped matmuls (models/dropless.py) against the capacity path.

With a capacity of every token (expert_capacity_factor=0) the buffers drop nothing, so both
paths compute the same sums: outputs and gradients equal in fp32, one step and several on
one device and over expert parallelism.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_moe import LLAMA, MOE, inputs, layer

from paisoar_jax.errors import UserError
from paisoar_jax.models.dropless import dropless_experts
from paisoar_jax.models.layers import gated_activation
from paisoar_jax.models.moe import MoeShape

SHAPES = {
    "softmax": MoeShape(4, 2, mlp_width=16),
    "sigmoid, shared": MoeShape(4, 2, mlp_width=16, router="sigmoid", shared_experts=1),
    "biased, clamped": MoeShape(4, 2, mlp_width=16, biases=True, activation="clamped_swiglu"),
}


def outputs_and_gradients(module, h):
    """(the layer's output, d sum(y^2) / d (its parameters, its input), its statistics)."""

    def loss(params, h):
        y, statistics = nnx.merge(graphdef, params, rest)(h)
        return jnp.sum(y**2), (y, statistics)

    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, (y, statistics)), gradients = jax.jit(grad)(params, h)
    return y, gradients, statistics


@pytest.mark.parametrize("name", list(SHAPES))
def test_dropless_gives_the_capacity_paths_outputs_and_gradients(name):
    capacity = layer(SHAPES[name], seed=3)
    if SHAPES[name].biases:  # nonzero biases, so that they count
        for bias in ("gate_bias", "up_bias", "down_bias", "router_logit_bias"):
            kernel = getattr(capacity, bias)
            kernel[...] = jax.random.normal(jax.random.key(7), kernel.shape) * 0.3
    dropless = nnx.clone(capacity)
    dropless.shape = dataclasses.replace(capacity.shape, impl="dropless")
    h = inputs()
    y, gradients, statistics = outputs_and_gradients(dropless, h)
    expected_y, expected_gradients, expected_statistics = outputs_and_gradients(capacity, h)
    # The router's statistics carry over (load, drops, entropy, losses): the same routing.
    for name, value in expected_statistics.items():
        np.testing.assert_allclose(statistics[name], value, rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(y, expected_y, rtol=1e-5, atol=1e-6)
    flat, expected_flat = (jax.tree.leaves(tree) for tree in (gradients, expected_gradients))
    assert len(flat) == len(expected_flat) > 4
    for got, expected in zip(flat, expected_flat, strict=True):  # (1e-5 of each leaf's scale)
        np.testing.assert_allclose(got, expected, atol=1e-5 * np.abs(expected).max())


def test_an_expert_without_tokens_gets_exactly_zero_gradient():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(2, 5, 8)).astype(np.float32)
    chosen = rng.choice([0, 1, 3], size=(2, 5, 2)).astype(np.int32)  # expert 2: none
    weights = rng.uniform(size=(2, 5, 2)).astype(np.float32)
    kernels = tuple(
        rng.normal(size=shape).astype(np.float32) for shape in ((4, 8, 6), (4, 8, 6), (4, 6, 8))
    )

    def loss(kernels):
        y = dropless_experts(h, chosen, weights, kernels, None, gated_activation("silu"))
        return jnp.sum(y**2)

    gradients = jax.grad(loss)(kernels)
    for gradient in gradients:
        assert np.all(np.asarray(gradient[2]) == 0.0)
        assert all(np.abs(np.asarray(gradient[expert])).max() > 0 for expert in (0, 1, 3))


def dropless_losses(mesh, devices, impl="dropless"):
    from conftest import build_run, token_batches

    overrides = [*MOE, *LLAMA, "model.expert_capacity_factor=0", f"model.moe_impl={impl}"]
    _, _, _, state, train_step = build_run([*overrides, *mesh], devices)
    initial, values, dropped = jax.device_get(state.params), [], []
    for batch in token_batches(3):
        state, metrics = train_step(state, batch)
        # The gradient's norm beside the loss: Adam's step hides a gradient scaled whole.
        values.append((float(metrics["loss"]), float(metrics["grad_norm"])))
        dropped.append(float(metrics["moe_dropped_fraction"]))
    assert dropped == [0.0] * 3
    return values, (initial, jax.device_get(state.params))


@pytest.fixture(scope="module")
def capacity_run(devices):
    """The capacity path's losses and parameters on one device (nothing dropped)."""
    return dropless_losses(["mesh.data=1"], devices[:1], "capacity")


@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.data=1"],
        ["mesh.data=2", "mesh.expert=4"],
        ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"],
    ],
    ids=["one-device", "expert4-data2", "fsdp2-expert2-tensor2"],
)
def test_dropless_training_gives_the_capacity_paths_losses(devices, mesh, capacity_run):
    from conftest import assert_steps_match

    count = int(np.prod([int(entry.split("=")[1]) for entry in mesh]))
    capacity, capacity_state = capacity_run
    dropless, dropless_state = dropless_losses(mesh, devices[:count])
    np.testing.assert_allclose(dropless, capacity, rtol=1e-5)
    assert_steps_match(dropless_state, capacity_state)


def test_dropless_with_a_capacity_factor_is_one_line():
    from paisoar_jax.config import load_config

    overrides = [*MOE, "model.moe_impl=dropless", "model.expert_capacity_factor=1.25"]
    with pytest.raises(UserError, match="model.moe_impl=dropless drops no choice"):
        load_config(None, overrides)


def test_dropless_over_pipeline_stages_is_one_line(devices):
    from conftest import build_run

    overrides = [*MOE, *LLAMA, "model.moe_impl=dropless", "mesh.stage=2", "mesh.data=1"]
    with pytest.raises(UserError, match="model.moe_impl=dropless with mesh.stage > 1"):
        build_run(overrides, devices[:2])
