"""The chunked cross-entropy (paisoar_jax/models/chunked_loss.py) against the unfused one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from paisoar_jax.models.chunked_loss import chunk_bounds, chunk_count, chunked_cross_entropy

B, T, D, V = 2, 8, 16, 50  # a vocabulary that 3 chunks do not divide


def unfused(h_BxTxD, head_DxV, targets_BxT):
    logits = jnp.einsum("btd,dv->btv", h_BxTxD, head_DxV, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets_BxT)


def test_the_chunks_cover_the_vocabulary_once():
    assert chunk_bounds(50, 3) == [(0, 17), (17, 33), (33, 50)]
    assert chunk_bounds(4, 8) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # never an empty chunk


def test_auto_slices_only_a_vocabulary_wider_than_8192():
    assert chunk_count(-1, 256) == 0  # the tiny models' logits stay whole
    assert chunk_count(-1, 8192) == 0
    assert chunk_count(-1, 50304) == 7  # gpt2: 7 slices of 7,186
    assert chunk_count(-1, 128256) == 16  # llama 3
    assert chunk_count(0, 50304) == 0 and chunk_count(3, 256) == 3  # as asked


@pytest.mark.parametrize("chunks", [1, 3, 7])
def test_the_loss_and_its_gradients_are_the_unfused_ones(chunks):
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(D, V)) * 0.5, jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(B, T)), jnp.float32)  # a masked, weighted mean
    for loss in (unfused, lambda h, w, t: chunked_cross_entropy(h, w, t, chunks)):
        np.testing.assert_allclose(loss(h, head, targets), unfused(h, head, targets), rtol=1e-5)
    gradients = [
        jax.grad(lambda h, w, loss=loss: jnp.sum(loss(h, w, targets) * weights), (0, 1))(h, head)
        for loss in (unfused, lambda h, w, t: chunked_cross_entropy(h, w, t, chunks))
    ]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), *gradients)


def test_bf16_logits_are_the_unfused_bf16_logits_loss():
    """model.fp32_logits=false: each slice's logits are rounded to bf16, as the unfused
    loss's are (the matmul's bf16 output, upcast for the softmax), so both give the same loss
    and, to bf16 rounding, the same gradients; the fp32 slices differ from them."""
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(B, T, D)), jnp.bfloat16)
    head = jnp.asarray(rng.normal(size=(D, V)), jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)

    def unfused_bf16(h, head, targets):
        logits = jnp.einsum("btd,dv->btv", h, head).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets)

    sliced = lambda h, head, targets: chunked_cross_entropy(h, head, targets, 3, False)
    expected = unfused_bf16(h, head, targets)
    np.testing.assert_allclose(sliced(h, head, targets), expected, rtol=1e-6)
    fp32_difference = np.abs(chunked_cross_entropy(h, head, targets, 3) - expected).max()
    assert fp32_difference > 1e-3  # the rounding is there to see
    gradients = [
        jax.grad(lambda h, w, loss=loss: jnp.sum(loss(h, w, targets)), (0, 1))(h, head)
        for loss in (unfused_bf16, sliced)
    ]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2
        ),
        *gradients,
    )


def test_no_buffer_holds_the_whole_logits():
    """The compiled loss and gradient hold no f32 array of B x T x V elements."""
    h = jnp.ones((B, T, D), jnp.bfloat16)
    head = jnp.ones((D, V), jnp.bfloat16)
    targets = jnp.zeros((B, T), jnp.int32)
    step = jax.jit(jax.grad(lambda h, w: chunked_cross_entropy(h, w, targets, 4).sum(), (0, 1)))
    text = step.lower(h, head).compile().as_text()
    assert f"f32[{B},{T},{V}]" not in text
    reference = jax.jit(jax.grad(lambda h, w: unfused(h, w, targets).sum(), (0, 1)))
    assert f"f32[{B},{T},{V}]" in reference.lower(h, head).compile().as_text()  # the check bites


@pytest.mark.parametrize(
    "overrides",
    [[], ["model.name=llama", "model.kv_heads=2", "model.tie_embeddings=false"]],
    ids=["gpt-tied", "llama"],
)
def test_model_loss_chunks_trains_a_decoder_as_the_logits_do(overrides):
    """model.loss_chunks: the zoo decoder's loss and gradients are the unfused ones."""
    from conftest import TINY, task_for, token_batches
    from flax import nnx

    from paisoar_jax.config import load_config
    from paisoar_jax.numerics.precision import get_policy
    from paisoar_jax.tasks.zoo import build_model

    batch = token_batches(1, batch=4)[0]
    results = []
    for chunks in (0, 3):
        config = load_config(None, [*TINY, *overrides, f"model.loss_chunks={chunks}"])
        with nnx.use_eager_sharding(False):
            model = build_model(config.model, get_policy("fp32"), "none", nnx.Rngs(params=0))
        task = task_for(config)
        loss = lambda model, task=task: task.loss(model, batch, jax.random.PRNGKey(0))[0]
        value, gradients = nnx.value_and_grad(loss)(model)
        results.append((value, nnx.to_pure_dict(gradients)))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
        results[0][1],
        results[1][1],
    )
