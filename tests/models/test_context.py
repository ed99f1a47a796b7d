"""Attention over a sequence split across 8 devices equals attention over the whole of it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from paisoar_jax.parallel.context import (
    balanced_order,
    gathered_attention,
    ring_attention,
)

B, T, H, K, E = 2, 64, 4, 2, 8


def reference(q, k, v, segments=None):
    """Causal attention over the whole sequence (within each document), in fp32."""
    mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def split(attention, q, k, v, positions, segments, devices):
    """`attention` inside shard_map, the sequence (in the given layout) over 8 devices."""
    mesh = Mesh(np.array(devices), ("context",))
    tokens = PartitionSpec(None, "context")
    with_segments = segments is not None

    def local(q, k, v, positions, segments):
        return attention(q, k, v, positions, "context", segments if with_segments else None)

    run = jax.shard_map(local, mesh=mesh, in_specs=(tokens,) * 5, out_specs=tokens, check_vma=False)
    return run(q, k, v, positions, segments if with_segments else jnp.zeros_like(positions))


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, E)).astype(np.float32)
    k, v = (rng.normal(size=(B, T, K, E)).astype(np.float32) for _ in range(2))
    # Packed documents: row 0 of three, row 1 of one.
    segments = np.stack([np.repeat([0, 1, 2], [20, 30, 14]), np.zeros(T, int)]).astype(np.int32)
    return q, k, v, segments


@pytest.mark.parametrize("attention", [gathered_attention, ring_attention], ids=["gather", "ring"])
@pytest.mark.parametrize("balanced", [False, True], ids=["plain", "balanced"])
@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_split_attention_equals_the_whole(attention, balanced, packed, devices):
    q, k, v, segments = inputs()
    segments = segments if packed else None
    order = balanced_order(T, 8) if balanced else np.arange(T)
    positions = np.broadcast_to(order, (B, T)).astype(np.int32)
    laid_out = lambda x: None if x is None else x[:, order]  # noqa: E731
    found = split(
        attention, laid_out(q), laid_out(k), laid_out(v), positions, laid_out(segments), devices
    )
    expected = reference(q, k, v, None if segments is None else jnp.asarray(segments))
    np.testing.assert_allclose(np.asarray(found), np.asarray(expected)[:, order], atol=2e-6)


@pytest.mark.parametrize("attention", [gathered_attention, ring_attention], ids=["gather", "ring"])
def test_split_attention_gradients_equal_the_whole(attention, devices):
    q, k, v, _ = inputs(1)
    order = balanced_order(T, 8)
    positions = np.broadcast_to(order, (B, T)).astype(np.int32)
    target = np.random.default_rng(2).normal(size=(B, T, H, E)).astype(np.float32)

    def split_loss(q, k, v):
        out = split(attention, q, k, v, positions, None, devices)
        return jnp.sum(out * target[:, order])

    def whole_loss(q, k, v):
        return jnp.sum(reference(q, k, v) * target)

    found = jax.grad(split_loss, argnums=(0, 1, 2))(q[:, order], k[:, order], v[:, order])
    expected = jax.grad(whole_loss, argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(found, expected, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want)[:, order], atol=1e-5)


def test_the_balanced_order_gives_each_device_a_front_and_a_back_chunk():
    order = balanced_order(16, 4)  # 8 chunks of 2
    assert order.reshape(4, 4).tolist() == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]
    # Every device's causal work (keys before each of its queries) is the same.
    work = [sum(position + 1 for position in device) for device in order.reshape(4, 4)]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="do not cut into 2 x 4 equal chunks"):
        balanced_order(12, 4)


@pytest.mark.parametrize("attention", [gathered_attention, ring_attention], ids=["gather", "ring"])
def test_queries_in_chunks_give_the_same_values_and_gradients(attention, devices, monkeypatch):
    """Each device's 8 queries attended 2 at a time (4 chunks, recomputed in backward)."""
    from paisoar_jax.parallel import context

    monkeypatch.setattr(context, "QUERY_CHUNK", 2)
    q, k, v, segments = inputs(3)
    order = balanced_order(T, 8)
    positions = np.broadcast_to(order, (B, T)).astype(np.int32)
    target = np.random.default_rng(4).normal(size=(B, T, H, E)).astype(np.float32)

    def split_loss(q, k, v):
        out = split(attention, q, k, v, positions, segments[:, order], devices)
        return jnp.sum(out * target[:, order])

    def whole_loss(q, k, v):
        return jnp.sum(reference(q, k, v, jnp.asarray(segments)) * target)

    laid_out = [x[:, order] for x in (q, k, v)]
    found_loss, found = jax.value_and_grad(split_loss, argnums=(0, 1, 2))(*laid_out)
    expected_loss, expected = jax.value_and_grad(whole_loss, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(float(found_loss), float(expected_loss), rtol=1e-5)
    for got, want in zip(found, expected, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want)[:, order], atol=1e-5)
