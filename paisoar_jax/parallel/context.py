"""Causal attention over a sequence split across devices: all-gather or ring (issue 34).

With context parallelism each device of the `context` axis holds a slice of every
sequence's tokens. Attention needs every earlier token's keys and values, so one of:

- `gathered_attention`: each device gathers every slice's keys and values (one all-gather
  of K and V per layer; memory O(T) per device for them) and attends from its own queries.
- `ring_attention`: the key/value slices travel round the ring of devices (`ppermute`,
  C - 1 hops); each device attends from its queries to the slice it holds at each hop and
  folds the result into an online softmax (running maximum, sum and output, in fp32), so
  no device ever holds more than two slices.

Both run inside `jax.shard_map` over the context axis and take each token's global
position (and, for packed documents, its segment), so causality and document masks hold
whatever order the tokens are laid out in. That is what causal load balancing needs:
`balanced_order` lays the sequence out so that device i holds chunk i and chunk 2C - 1 - i
of 2C chunks, one from the front and one from the back, and every device does the same
work (a plain split gives the last device all the attention and the first almost none).

Shape suffixes: B batch, T tokens on this device, S key/value tokens, H query heads,
K key/value heads, G = H / K query heads per key/value head, E head width, C devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from paisoar_jax.numerics.precision import float32_island, matmul_fp32_out
from paisoar_jax.parallel.sharding import activation_axes, constrain, in_batch_vmap
from paisoar_jax.runtime.platform import compile_platform


def balanced_order(length: int, shards: int) -> np.ndarray:
    """The token order that balances causal attention: device i holds chunks i, 2C - 1 - i.

    `length` tokens in 2 x `shards` equal chunks; returns the positions in layout order
    (split evenly over the devices, device i's slice is chunk i then chunk 2C - 1 - i).
    """
    if length % (2 * shards):
        raise ValueError(f"{length} tokens do not cut into 2 x {shards} equal chunks")
    chunks = np.arange(length).reshape(2 * shards, length // (2 * shards))
    return np.concatenate([np.concatenate([chunks[i], chunks[-1 - i]]) for i in range(shards)])


# Queries attended at a time: one chunk's fp32 logits (heads x chunk x keys) are live, and
# the backward pass recomputes them (what flash attention saves), so a device's memory for
# attention grows with its keys, not with its keys x its queries.
QUERY_CHUNK = 512


def _block_scores(q_BxTxHxE, k_BxSxKxE, allowed_BxTxS) -> jax.Array:
    """fp32 logits of T queries against S keys, -inf where not allowed: B x K x G x T x S."""
    B, T, H, E = q_BxTxHxE.shape
    K = k_BxSxKxE.shape[2]
    q_BxTxKxGxE = q_BxTxHxE.reshape(B, T, K, H // K, E)
    # In the inputs' dtype, accumulated in fp32, forward and backward (16-bit gemms).
    logits = matmul_fp32_out("btkge,bske->bkgts", q_BxTxKxGxE, k_BxSxKxE)
    logits = logits / np.sqrt(E)
    return jnp.where(allowed_BxTxS[:, None, None], logits, -jnp.inf)


def _allowed(q_positions_BxT, k_positions_BxS, q_segments_BxT, k_segments_BxS) -> jax.Array:
    """Causal by global position, and within one document when segments are given."""
    allowed = q_positions_BxT[:, :, None] >= k_positions_BxS[:, None, :]
    if q_segments_BxT is not None:
        allowed &= q_segments_BxT[:, :, None] == k_segments_BxS[:, None, :]
    return allowed


def _partial_softmax(queries, keys) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(peak, total, output) of queries over keys: an unnormalised softmax, in fp32.

    `queries` = (q_BxTxHxE, positions_BxT, segments_BxT or None), `keys` = (k_BxSxKxE,
    v_BxSxKxE, positions_BxS, segments_BxS or None). peak and total are B x K x G x T,
    output B x K x G x T x E; a query with no key allowed has peak -inf and total 0.
    """
    q_BxTxHxE, q_positions, q_segments = queries
    k_BxSxKxE, v_BxSxKxE, k_positions, k_segments = keys
    allowed = _allowed(q_positions, k_positions, q_segments, k_segments)
    logits = _block_scores(q_BxTxHxE, k_BxSxKxE, allowed)
    peak = jnp.max(logits, axis=-1)
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0)[..., None])
    # The weights in the values' dtype for the gemm (as flash attention rounds them).
    output = matmul_fp32_out("bkgts,bske->bkgte", weights.astype(v_BxSxKxE.dtype), v_BxSxKxE)
    return peak, jnp.sum(weights, axis=-1), output


def _merge(first, second) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Two partial softmaxes of the same queries over disjoint keys, as one."""
    (peak_a, total_a, output_a), (peak_b, total_b, output_b) = first, second
    peak = jnp.maximum(peak_a, peak_b)
    safe = jnp.where(jnp.isfinite(peak), peak, 0.0)
    scale_a = jnp.where(jnp.isfinite(peak_a), jnp.exp(peak_a - safe), 0.0)
    scale_b = jnp.where(jnp.isfinite(peak_b), jnp.exp(peak_b - safe), 0.0)
    total = total_a * scale_a + total_b * scale_b
    return peak, total, output_a * scale_a[..., None] + output_b * scale_b[..., None]


def _chunked_softmax(queries, keys) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`_partial_softmax` a chunk of QUERY_CHUNK queries at a time, recomputed in backward."""
    q_BxTxHxE = queries[0]
    B, T = q_BxTxHxE.shape[:2]
    chunk = max(size for size in range(1, min(T, QUERY_CHUNK) + 1) if T % size == 0)
    attend = jax.checkpoint(_partial_softmax)
    if chunk == T:
        return attend(queries, keys)
    count = T // chunk
    # Chunks first (B x T x ... -> count x B x chunk x ...), mapped one after another.
    cut = lambda x: jnp.moveaxis(x.reshape(B, count, chunk, *x.shape[2:]), 1, 0)  # noqa: E731
    peak, total, output = jax.lax.map(lambda part: attend(part, keys), jax.tree.map(cut, queries))
    # count x B x K x G x chunk (x E) -> B x K x G x T (x E)
    join = lambda x: jnp.moveaxis(x, 0, 3).reshape(*x.shape[1:4], T, *x.shape[5:])  # noqa: E731
    return join(peak), join(total), join(output)


def _finish(output_BxKxGxTxE, total_BxKxGxT, dtype) -> jax.Array:
    """Normalised output as B x T x H x E (a row with nothing allowed gives zeros)."""
    B, K, G, T, E = output_BxKxGxTxE.shape
    normed = output_BxKxGxTxE / jnp.maximum(total_BxKxGxT, 1e-30)[..., None]
    return normed.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, E).astype(dtype)


def gathered_attention(
    q_BxTxHxE,
    k_BxTxKxE,
    v_BxTxKxE,
    positions_BxT,
    axis: str,
    segments_BxT=None,
    implementation: str = "xla",
) -> jax.Array:
    """Attention of this device's queries to every device's keys and values (all-gathered).

    Inside shard_map over `axis`; positions (and segments) are this device's tokens'.
    `implementation` cudnn (model.attention's choice on a GPU) runs cuDNN flash attention
    over the gathered keys, the layout's causal and document mask as a dense bias; xla runs
    the chunked softmax.
    """
    gather = lambda x: None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
    keys = tuple(map(gather, (k_BxTxKxE, v_BxTxKxE, positions_BxT, segments_BxT)))
    if implementation == "cudnn":
        allowed_BxTxS = _allowed(positions_BxT, keys[2], segments_BxT, keys[3])
        return jax.nn.dot_product_attention(
            q_BxTxHxE, keys[0], keys[1], mask=allowed_BxTxS[:, None], implementation="cudnn"
        )
    _, total, output = _chunked_softmax((q_BxTxHxE, positions_BxT, segments_BxT), keys)
    return _finish(output, total, q_BxTxHxE.dtype)


def ring_attention(
    q_BxTxHxE,
    k_BxTxKxE,
    v_BxTxKxE,
    positions_BxT,
    axis: str,
    segments_BxT=None,
    implementation: str = "xla",
) -> jax.Array:
    """Attention of this device's queries to every slice, the slices passed round the ring.

    Inside shard_map over `axis`. At each of the C hops the device attends to the slice it
    holds, folds it into the online softmax (fp32), and passes the slice on to the next
    device (a ppermute the hop's compute does not wait on, so XLA's scheduler may overlap
    the two): C - 1 passes in all. Each hop runs the chunked softmax in XLA whatever
    `implementation` says (cuDNN's kernel does not return the statistics a fold needs).
    """
    del implementation
    shards = jax.lax.axis_size(axis)
    ring = [(device, (device + 1) % shards) for device in range(shards)]
    B, T, H, E = q_BxTxHxE.shape
    K = k_BxTxKxE.shape[2]
    queries = (q_BxTxHxE, positions_BxT, segments_BxT)

    def hop(carry, _):
        softmax, held = carry
        softmax = _merge(softmax, _chunked_softmax(queries, held))
        return (softmax, jax.tree.map(lambda x: jax.lax.ppermute(x, axis, ring), held)), None

    G = H // K
    # Each device's running softmax is its own (varying over the axis, as scan's carry must
    # be from the start).
    varying = lambda x: jax.lax.pcast(x, axis, to="varying")  # noqa: E731
    softmax = (
        varying(jnp.full((B, K, G, T), -jnp.inf, jnp.float32)),
        varying(jnp.zeros((B, K, G, T), jnp.float32)),
        varying(jnp.zeros((B, K, G, T, E), jnp.float32)),
    )
    held = (k_BxTxKxE, v_BxTxKxE, positions_BxT, segments_BxT)
    # C - 1 hops that fold and pass, then the last slice folded where it arrived.
    (softmax, held), _ = jax.lax.scan(hop, (softmax, held), None, length=shards - 1)
    _, total, output = _merge(softmax, _chunked_softmax(queries, held))
    return _finish(output, total, q_BxTxHxE.dtype)


def _gathered_by_the_compiler(
    q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, positions_BxT, segments_BxT
) -> jax.Array:
    """The all-gather strategy written on global arrays, for a pipeline's cells.

    The keys and values (and their positions) are pinned whole along the sequence, so the
    compiler all-gathers them over `context`, while the queries keep their slices: each
    device attends from its tokens to all of them (one softmax, no chunks).
    """
    whole = lambda x, axes: None if x is None else constrain(x, axes)  # noqa: E731
    heads = ("batch", None, "act_heads", "head_dim")
    keys = (
        whole(k_BxTxKxE, heads),
        whole(v_BxTxKxE, heads),
        whole(positions_BxT, ("batch", None)),
        whole(segments_BxT, ("batch", None)),
    )
    _, total, output = _partial_softmax((q_BxTxHxE, positions_BxT, segments_BxT), keys)
    return _finish(output, total, q_BxTxHxE.dtype)


STRATEGIES = {"gather": gathered_attention, "ring": ring_attention}


def split_attention(
    q_BxTxHxE,
    k_BxTxKxE,
    v_BxTxKxE,
    positions_BxT,
    segments_BxT,
    strategy: str,
    implementation: str = "xla",
) -> jax.Array:
    """Attention over sequences split across the mesh's `context` axis (inside a jit).

    Global arrays in, global out: only the context axis turns manual (a shard_map over
    it), so the batch and the heads stay wherever the data, fsdp and tensor axes put them
    (with cuDNN every axis turns manual, as the activations are split). `strategy`: gather
    or ring (model.context_attention); `implementation`: the resolved model.attention
    (cudnn or xla). Inside a pipeline's vmap over its cells, where a shard_map does not
    lower, the compiler gathers the keys and values itself.
    """
    if in_batch_vmap():  # a pipeline's cell: no shard_map there
        return _gathered_by_the_compiler(
            q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, positions_BxT, segments_BxT
        )
    local = functools.partial(STRATEGIES[strategy], implementation=implementation)
    tokens = PartitionSpec(None, "context")
    dtype = q_BxTxHxE.dtype
    if compile_platform() == "cpu":
        # XLA:CPU aborts compiling the half-precision collectives of this shard_map's
        # backward pass (AllReducePromotion: "Invalid binary instruction opcode copy"): on
        # CPU they travel in fp32. GPUs keep the compute dtype on the wire.
        q_BxTxHxE, k_BxTxKxE, v_BxTxKxE = map(float32_island, (q_BxTxHxE, k_BxTxKxE, v_BxTxKxE))
    if segments_BxT is None:
        body = lambda q, k, v, positions: local(q, k, v, positions, "context")  # noqa: E731
        arguments = (q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, positions_BxT)
    else:
        body = lambda q, k, v, positions, segments: local(  # noqa: E731
            q, k, v, positions, "context", segments
        )
        arguments = (q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, positions_BxT, segments_BxT)
    if implementation == "cudnn" and strategy == "gather":
        # cuDNN's custom partitioner fails under a partly manual shard_map: every axis
        # manual, each array split as the activations are (batch, tokens, heads).
        batch = activation_axes("batch")
        tokens = PartitionSpec(batch, "context")
        heads = PartitionSpec(batch, "context", activation_axes("act_heads"))
        specs = (heads,) * 3 + (tokens,) * (len(arguments) - 3)
        split = jax.shard_map(body, in_specs=specs, out_specs=heads)
    else:
        split = jax.shard_map(
            body, in_specs=(tokens,) * len(arguments), out_specs=tokens, axis_names={"context"}
        )
    return split(*arguments).astype(dtype)
