"""Next-token cross-entropy from a decoder's last stream, a vocabulary chunk at a time.

A small decoder's largest activation is its logits: B x T x V in fp32 (3.3 GB for GPT-2 at
B16 T1024), written by the head's matmul, read by the softmax and again by its backward.
Here the head is applied to one slice of the vocabulary at a time; each slice's logits are
reduced at once to a running log-sum-exp (and the target's logit, in the slice that holds
it) and dropped. The backward makes each slice's logits again and turns them into that
slice's share of the stream's gradient and the head's columns' gradient. No buffer of B x T
x V is ever made; the price is the head's forward matmul twice.

Chunks split the vocabulary, not the tokens: the tokens are split over the batch axes, so a
token chunk's share of the head's gradient would need a reduction over devices per chunk;
a vocabulary chunk's is its own columns, reduced once as the unfused gradient is. Exact to
the unfused loss within fp32 rounding: both accumulate the logits in fp32, and the backward
rounds the logits' gradient to the stream's dtype before its two matmuls, as
precision.matmul_fp32_out does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

AUTO_CHUNK_COLUMNS = 8192  # model.loss_chunks=-1: the widest slice of the vocabulary


def chunk_count(loss_chunks: int, vocab_size: int) -> int:
    """model.loss_chunks resolved: -1 (auto) slices a vocabulary wider than 8,192 columns.

    0 means the logits whole (a small vocabulary's are small, and one matmul beats two).
    """
    if loss_chunks >= 0:
        return loss_chunks
    return -(-vocab_size // AUTO_CHUNK_COLUMNS) if vocab_size > AUTO_CHUNK_COLUMNS else 0


def chunk_bounds(vocab_size: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of each of `chunks` near-equal slices of the vocabulary."""
    edges = np.linspace(0, vocab_size, min(chunks, vocab_size) + 1).round().astype(int)
    return [(int(start), int(end)) for start, end in zip(edges[:-1], edges[1:], strict=True)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def chunked_cross_entropy(
    h_BxTxD, head_DxV, targets_BxT, chunks: int, fp32_logits: bool = True
) -> jax.Array:
    """fp32 cross-entropies (B x T) of the logits h @ head against `targets_BxT`.

    `fp32_logits=False` (model.fp32_logits=false) rounds each slice's logits to the stream's
    dtype, as the unfused loss's bf16 logits are, before the fp32 softmax: half the bytes
    for the softmax and its backward to read (3.3 GB a GPT-2 step on one H200).
    """
    return _forward(h_BxTxD, head_DxV, targets_BxT, chunks, fp32_logits)[0]


def _logits(h_BxTxD, head_DxV, start: int, end: int, fp32_logits: bool) -> jax.Array:
    """One vocabulary slice's logits, accumulated in fp32, kept in fp32 or the stream's dtype."""
    logits_BxTxC = jnp.einsum(
        "btd,dv->btv",
        h_BxTxD,
        head_DxV[:, start:end],
        preferred_element_type=jnp.float32 if fp32_logits else h_BxTxD.dtype,
    )
    return logits_BxTxC.astype(jnp.float32)


def _maximum_and_exp_sum(logits_BxTxC) -> tuple[jax.Array, jax.Array]:
    """(m, sum(exp(logits - m))) over the last axis, m the maximum, in one read of the slice.

    One variadic reduction of (running maximum, sum scaled to it) pairs, the online softmax's
    step: a max and then a sum of exponentials would read the fp32 slice twice (3.3 GB a
    GPT-2 step on one H200).
    """

    def combine(left, right):
        (left_maximum, left_total), (right_maximum, right_total) = left, right
        maximum = jnp.maximum(left_maximum, right_maximum)
        # A side at the maximum keeps its sum as it is (also when both are -inf: no NaN).
        scale = lambda m: jnp.where(m == maximum, 1.0, jnp.exp(m - maximum))  # noqa: E731
        return maximum, left_total * scale(left_maximum) + right_total * scale(right_maximum)

    ones_BxTxC = jnp.ones_like(logits_BxTxC)  # each logit alone: its own maximum, sum 1
    return jax.lax.reduce(
        (logits_BxTxC, ones_BxTxC),
        (jnp.float32(-jnp.inf), jnp.float32(0.0)),
        combine,
        (logits_BxTxC.ndim - 1,),
    )


def _forward(h_BxTxD, head_DxV, targets_BxT, chunks: int, fp32_logits: bool):
    maximum_BxT = jnp.full(targets_BxT.shape, -jnp.inf, jnp.float32)
    total_BxT = jnp.zeros(targets_BxT.shape, jnp.float32)
    target_BxT = jnp.zeros(targets_BxT.shape, jnp.float32)
    for start, end in chunk_bounds(head_DxV.shape[1], chunks):
        logits_BxTxC = _logits(h_BxTxD, head_DxV, start, end, fp32_logits)
        chunk_maximum_BxT, chunk_total_BxT = _maximum_and_exp_sum(logits_BxTxC)
        new_maximum_BxT = jnp.maximum(maximum_BxT, chunk_maximum_BxT)
        total_BxT = total_BxT * jnp.exp(maximum_BxT - new_maximum_BxT) + chunk_total_BxT * (
            jnp.exp(chunk_maximum_BxT - new_maximum_BxT)
        )
        maximum_BxT = new_maximum_BxT
        inside_BxT = (targets_BxT >= start) & (targets_BxT < end)
        index_BxT = jnp.clip(targets_BxT - start, 0, end - start - 1)
        picked_BxT = jnp.take_along_axis(logits_BxTxC, index_BxT[..., None], axis=-1)[..., 0]
        target_BxT = jnp.where(inside_BxT, picked_BxT, target_BxT)
    log_sum_BxT = maximum_BxT + jnp.log(total_BxT)
    return log_sum_BxT - target_BxT, (h_BxTxD, head_DxV, targets_BxT, log_sum_BxT)


def _backward(chunks: int, fp32_logits: bool, residuals, cotangent_BxT):
    h_BxTxD, head_DxV, targets_BxT, log_sum_BxT = residuals
    gradient_h_BxTxD = jnp.zeros(h_BxTxD.shape, jnp.float32)
    gradient_head = []
    for start, end in chunk_bounds(head_DxV.shape[1], chunks):
        probabilities_BxTxC = jnp.exp(
            _logits(h_BxTxD, head_DxV, start, end, fp32_logits) - log_sum_BxT[..., None]
        )
        hit_BxTxC = targets_BxT[..., None] == start + jnp.arange(end - start)
        gradient_BxTxC = (probabilities_BxTxC - hit_BxTxC) * cotangent_BxT[..., None]
        gradient_BxTxC = gradient_BxTxC.astype(h_BxTxD.dtype)
        gradient_h_BxTxD += jnp.einsum(
            "btv,dv->btd",
            gradient_BxTxC,
            head_DxV[:, start:end],
            preferred_element_type=jnp.float32,
        )
        gradient_head.append(
            jnp.einsum("btd,btv->dv", h_BxTxD, gradient_BxTxC, preferred_element_type=jnp.float32)
        )
    gradient_head_DxV = jnp.concatenate(gradient_head, axis=1).astype(head_DxV.dtype)
    return gradient_h_BxTxD.astype(h_BxTxD.dtype), gradient_head_DxV, None


chunked_cross_entropy.defvjp(_forward, _backward)
