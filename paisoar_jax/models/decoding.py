"""Decoding with a key/value cache, for the zoo's decoders (gpt, llama).

A block's `decode(x, rotary, cache, index)` attends from the new positions
index .. index + T - 1 to everything the cache holds up to them, after writing its own keys
and values there; the model's `decode(tokens, cache, index)` runs every block that way and
returns the logits with the updated cache. The cache is one pair of arrays for all blocks,
stacked on a leading layers axis (L x B x S x K x E), so a scanned model scans it with its
blocks; it is sharded like the activations (batch over data and fsdp, heads over tensor).
Prefill is one call with the prompt (T = its length), each new token one more with T = 1:
two shapes, so two compiles for a whole generation. Prompts of several lengths go in one
batch left-padded: `starts_B` (each row's padding) gives each row its own positions and
keeps the padding out of attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from paisoar_jax.parallel.sharding import constrain


def empty_cache(config, batch: int, length: int, dtype) -> tuple[jax.Array, jax.Array]:
    """Zero keys and values (L x B x S x K x E) for `length` positions."""
    shape = (config.layers, batch, length, config.key_value_heads, config.head_size)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def cached_attention(q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, cache, index: jax.Array, valid_BxS=None):
    """Causal attention of T new positions over the cache, after writing theirs into it.

    `valid_BxS` (batched prompts, left-padded) marks each row's cache slots that hold its
    own tokens; the padding before a shorter prompt is never attended to.
    Returns (out_BxTxHxE, (keys, values) with the new ones at index .. index + T - 1).
    """
    keys_BxSxKxE, values_BxSxKxE = cache
    keys_BxSxKxE = jax.lax.dynamic_update_slice_in_dim(
        keys_BxSxKxE, k_BxTxKxE.astype(keys_BxSxKxE.dtype), index, axis=1
    )
    values_BxSxKxE = jax.lax.dynamic_update_slice_in_dim(
        values_BxSxKxE, v_BxTxKxE.astype(values_BxSxKxE.dtype), index, axis=1
    )
    heads = ("batch", "length", "act_heads", "head_dim")
    keys_BxSxKxE, values_BxSxKxE = constrain(keys_BxSxKxE, heads), constrain(values_BxSxKxE, heads)
    T, S = q_BxTxHxE.shape[1], keys_BxSxKxE.shape[1]
    visible_TxS = jnp.arange(S)[None, :] <= index + jnp.arange(T)[:, None]
    mask = visible_TxS[None, None]
    if valid_BxS is not None:
        mask = mask & valid_BxS[:, None, None, :]
    dtype = q_BxTxHxE.dtype
    out_BxTxHxE = jax.nn.dot_product_attention(
        q_BxTxHxE.astype(jnp.float32),
        keys_BxSxKxE.astype(jnp.float32),
        values_BxSxKxE.astype(jnp.float32),
        mask=mask,
        implementation="xla",
    )
    return out_BxTxHxE.astype(dtype), (keys_BxSxKxE, values_BxSxKxE)


def decode_blocks(blocks, x_BxTxD, rotary, cache, index: jax.Array, scanned: bool, valid_BxS=None):
    """The stream through every block's `decode`; (stream, the cache of every block)."""
    if scanned:
        graphdef, stacked_state = nnx.split(blocks)

        def step(x_BxTxD, layer):
            block_state, keys, values = layer
            block = nnx.merge(graphdef, block_state)
            out_BxTxD, written = block.decode(x_BxTxD, rotary, (keys, values), index, valid_BxS)
            # Back to the stream's dtype: a block forced to another policy stays a drop-in.
            return out_BxTxD.astype(x_BxTxD.dtype), written

        x_BxTxD, (keys, values) = jax.lax.scan(step, x_BxTxD, (stacked_state, *cache))
        return x_BxTxD, (keys, values)
    written = []
    for layer, block in enumerate(blocks):
        layer_cache = (cache[0][layer], cache[1][layer])
        x_BxTxD, pair = block.decode(x_BxTxD, rotary, layer_cache, index, valid_BxS)
        written.append(pair)
    return x_BxTxD, tuple(jnp.stack(arrays) for arrays in zip(*written, strict=True))
