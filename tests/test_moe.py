"""The MoE feed-forward against a token-by-token reference: routing, seats, drops, losses."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paisoar_jax.models.moe import MoeFeedForward, MoeShape, balance_loss, route, seats, z_loss
from paisoar_jax.precision import get_policy

WIDTH, B, T = 8, 2, 6


def layer(shape: MoeShape, seed: int = 0) -> MoeFeedForward:
    with nnx.use_eager_sharding(False):  # its logical axis names, without a mesh
        return MoeFeedForward(WIDTH, shape, get_policy("fp32"), 0.5, nnx.Rngs(seed))


def silu(x):
    return x / (1 + np.exp(-x))


def reference(module: MoeFeedForward, h_BxTxD: np.ndarray):
    """Token by token, in numpy: the output, and the (row, token, rank) choices dropped."""
    shape = module.shape
    weights, chosen, _ = (np.asarray(a) for a in route(_logits(module, h_BxTxD), shape))
    gate, up, down = (
        np.asarray(k[...]) for k in (module.gate_kernel, module.up_kernel, module.down_kernel)
    )
    capacity = shape.capacity(h_BxTxD.shape[1])
    y = np.zeros_like(h_BxTxD)
    dropped = set()
    for row in range(h_BxTxD.shape[0]):
        taken = [0] * shape.experts
        for rank in range(shape.experts_per_token):  # every first choice before any second
            for token in range(h_BxTxD.shape[1]):
                expert = chosen[row, token, rank]
                if taken[expert] == capacity:
                    dropped.add((row, token, rank))
                    continue
                taken[expert] += 1
                x = h_BxTxD[row, token]
                hidden = silu(x @ gate[expert]) * (x @ up[expert])
                y[row, token] += weights[row, token, rank] * (hidden @ down[expert])
    if shape.shared_experts:
        x = h_BxTxD
        hidden = silu(x @ np.asarray(module.shared_gate_kernel[...]))
        hidden = hidden * (x @ np.asarray(module.shared_up_kernel[...]))
        y = y + hidden @ np.asarray(module.shared_down_kernel[...])
    return y, dropped


def _logits(module, h_BxTxD):
    return jnp.einsum("btd,dx->btx", h_BxTxD, module.router_kernel[...])


def inputs(seed=1):
    return np.random.default_rng(seed).normal(size=(B, T, WIDTH)).astype(np.float32)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared_experts", [0, 1])
def test_dropless_output_is_the_weighted_sum_of_each_tokens_experts(router, shared_experts):
    shape = MoeShape(4, 2, mlp_width=16, router=router, shared_experts=shared_experts)
    module, h = layer(shape), inputs()
    y, statistics = jax.jit(lambda module, h: module(h))(module, h)
    expected, dropped = reference(module, h)
    assert not dropped and float(statistics["dropped_fraction"]) == 0.0
    np.testing.assert_allclose(np.asarray(y), expected, rtol=2e-5, atol=2e-6)


def test_a_tight_capacity_drops_exactly_the_choices_the_reference_drops():
    shape = MoeShape(3, 2, mlp_width=16, capacity_factor=0.5)  # 2 seats per expert and row
    module, h = layer(shape, seed=3), inputs(seed=4)
    assert shape.capacity(T) == 2
    y, statistics = jax.jit(lambda module, h: module(h))(module, h)
    expected, dropped = reference(module, h)
    _, chosen, _ = route(_logits(module, h), shape)
    _, kept = seats(chosen, shape.experts, shape.capacity(T))
    assert dropped == {tuple(index) for index in np.argwhere(~np.asarray(kept))}
    assert float(statistics["dropped_fraction"]) == pytest.approx(len(dropped) / (B * T * 2))
    assert dropped  # the capacity really bit
    np.testing.assert_allclose(np.asarray(y), expected, rtol=2e-5, atol=2e-6)


def test_first_choices_are_seated_before_second_choices():
    # Three tokens all choose expert 0 first and 1 second; expert 0 has two seats.
    chosen = jnp.array([[[0, 1], [0, 1], [0, 1]]])
    seat, kept = seats(chosen, experts=2, capacity=2)
    assert np.asarray(seat).tolist() == [[[0, 0], [1, 1], [2, 2]]]
    assert np.asarray(kept).tolist() == [[[True, True], [True, True], [False, False]]]
    # Token 0's second choice of expert 0 waits for token 2's first choice of it.
    seat, kept = seats(jnp.array([[[1, 0], [0, 1], [0, 1]]]), experts=2, capacity=2)
    assert np.asarray(seat).tolist() == [[[0, 2], [0, 1], [1, 2]]]
    assert np.asarray(kept).tolist() == [[[True, False], [True, True], [True, False]]]


def test_the_balance_loss_and_z_loss_equal_their_formulas_on_a_hand_made_routing():
    # Four tokens, two experts, one choice each: three go to expert 0.
    probabilities = jnp.array([[[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]]])
    chosen = jnp.array([[[0], [0], [0], [1]]])
    share, mean_probability = np.array([0.75, 0.25]), np.array([0.65, 0.35])
    expected = 2 * np.sum(share * mean_probability)
    assert float(balance_loss(chosen, probabilities)) == pytest.approx(expected)
    balanced = balance_loss(jnp.array([[[0], [1]]]), jnp.full((1, 2, 2), 0.5))
    assert float(balanced) == pytest.approx(1.0)  # K = 1 when balanced
    logits = jnp.array([[[0.0, math.log(3.0)]]])  # logsumexp = log 4
    assert float(z_loss(logits)) == pytest.approx(math.log(4.0) ** 2)


def test_renormalised_weights_sum_to_one_and_sigmoid_scores_need_not():
    logits = jnp.asarray(inputs()[..., :4])
    for router in ("softmax", "sigmoid"):
        weights, chosen, probabilities = route(logits, MoeShape(4, 2, router=router))
        np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(probabilities.sum(-1)), 1.0, rtol=1e-6)
    weights, _, _ = route(logits, MoeShape(4, 2, router="sigmoid", renormalize=False))
    np.testing.assert_allclose(
        np.asarray(weights), np.asarray(jax.nn.sigmoid(jax.lax.top_k(logits, 2)[0])), rtol=1e-6
    )


def test_the_router_learns_through_the_weights_of_the_kept_choices():
    module, h = layer(MoeShape(4, 2, mlp_width=16)), inputs()
    graphdef, params = nnx.split(module)

    def loss(params):
        y, statistics = nnx.merge(graphdef, params)(h)
        return jnp.mean(y**2) + 0.01 * statistics["balance_loss"]

    grads = jax.jit(jax.grad(loss))(params)
    for name in ("router_kernel", "gate_kernel", "up_kernel", "down_kernel"):
        assert float(jnp.abs(grads[name][...]).sum()) > 0, name
