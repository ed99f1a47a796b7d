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

`generate_rows` is the one generation loop, prefill then a token at a time in one compiled
program, with `pick_token` choosing each (greedy, or sampled from `filtered_logits`):
`paisoar_jax.generate` (tools/generate.py) and the closing sample of a training run
(sample.py) both decode with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from paisoar_jax.models.attention import padded_values, sink_attention, visible
from paisoar_jax.parallel.sharding import constrain


def empty_cache(model_config, batch: int, length: int, dtype) -> tuple:
    """Zero keys and values (L x B x S x K x E) for `length` positions.

    A sliding-window block's cache is a ring of its window's slots (position p in slot
    p mod window) when the window is shorter than `length`: Gemma 3's local blocks hold 1024
    positions of a 128k generation. Where the blocks' slots differ (global and local blocks)
    the keys and values are each a tuple of the blocks' arrays (B x S x K x E), not stacked.
    With multi-head latent attention they are each position's latent and rotated key
    instead (L x B x S x 1 x R, and x P: models/latent.py widens them at each step).
    """
    if model_config.kv_latent_width:
        latents = (model_config.layers, batch, length, 1)
        return (
            jnp.zeros((*latents, model_config.kv_latent_width), dtype),
            jnp.zeros((*latents, model_config.rope_head_width), dtype),
        )
    heads = (model_config.key_value_heads, model_config.head_size)
    slots = [
        min(model_config.window_of(layer) or length, length) for layer in range(model_config.layers)
    ]
    if len(set(slots)) == 1:
        shape = (model_config.layers, batch, slots[0], *heads)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    keys = tuple(jnp.zeros((batch, held, *heads), dtype) for held in slots)
    return keys, tuple(jnp.zeros_like(array) for array in keys)


def cached_attention(
    q_BxTxHxE,
    k_BxTxKxE,
    v_BxTxKxE,
    cache,
    index: jax.Array,
    starts_B=None,
    window: int = 0,
    sinks_H=None,
):
    """Causal attention of T new positions over the cache, with theirs written into it.

    `starts_B` (batched prompts, left-padded): each row's first position of its own; the
    padding before a shorter prompt is never attended to. `window` > 0: a sliding-window
    block's, each position seeing the `window` ending at its own, its cache a ring
    (`empty_cache`). `sinks_H`: each head's sink logit.
    Returns (out_BxTxHxE, (keys, values) with the new ones written: at index .. index + T - 1,
    or in the ring).
    """
    if window:
        keys_BxAxKxE, values_BxAxKxE, mask_TxA, positions_A, cache = _through_ring(
            cache, k_BxTxKxE, v_BxTxKxE, index, window
        )
    else:
        keys_BxAxKxE, values_BxAxKxE = (
            jax.lax.dynamic_update_slice_in_dim(held, new.astype(held.dtype), index, axis=1)
            for held, new in zip(cache, (k_BxTxKxE, v_BxTxKxE), strict=True)
        )
        cache = (keys_BxAxKxE, values_BxAxKxE)
        positions_A = jnp.arange(keys_BxAxKxE.shape[1])
        mask_TxA = visible(index, q_BxTxHxE.shape[1], keys_BxAxKxE.shape[1])
    heads = ("batch", "length", "act_heads", "head_dim")
    keys_BxAxKxE, values_BxAxKxE = constrain(keys_BxAxKxE, heads), constrain(values_BxAxKxE, heads)
    mask = mask_TxA[None, None]
    if starts_B is not None:
        mask = mask & (positions_A[None, :] >= starts_B[:, None])[:, None, None, :]
    dtype = q_BxTxHxE.dtype
    if sinks_H is not None:  # GPT-OSS's sinks (models/attention.py)
        fp32 = [array.astype(jnp.float32) for array in (q_BxTxHxE, keys_BxAxKxE, values_BxAxKxE)]
        out_BxTxHxE = sink_attention(*fp32, mask, sinks_H)
        return out_BxTxHxE.astype(dtype), cache
    out_BxTxHxE = jax.nn.dot_product_attention(
        q_BxTxHxE.astype(jnp.float32),
        keys_BxAxKxE.astype(jnp.float32),
        padded_values(values_BxAxKxE, q_BxTxHxE.shape[-1]).astype(jnp.float32),
        mask=mask,
        implementation="xla",
    )
    out_BxTxHxE = out_BxTxHxE[..., : values_BxAxKxE.shape[-1]]
    return out_BxTxHxE.astype(dtype), cache


def _through_ring(cache, k_BxTxKxE, v_BxTxKxE, index, window: int) -> tuple:
    """A sliding-window block's keys and values to attend over, and its ring written.

    The new positions attend over the ring as it was (the S positions before `index`) and
    over themselves: A = S + T keys, each with its position (negative: a slot not yet
    written). Then the last S of the new keys and values replace what their slots held.
    Returns (keys B x A x K x E, values, mask T x A, positions A, the written cache).
    """
    ring_keys, ring_values = cache
    S, T = ring_keys.shape[1], k_BxTxKxE.shape[1]
    slots_S = jnp.arange(S)
    # Slot s holds the latest position before `index` that is s modulo S.
    held_S = index - 1 - jnp.mod(index - 1 - slots_S, S)
    positions_A = jnp.concatenate([held_S, index + jnp.arange(T)])
    queries_T = index + jnp.arange(T)
    distance_TxA = queries_T[:, None] - positions_A[None, :]
    mask_TxA = (positions_A[None, :] >= 0) & (distance_TxA >= 0) & (distance_TxA < window)
    keys, values = (
        jnp.concatenate([held, new.astype(held.dtype)], axis=1)
        for held, new in ((ring_keys, k_BxTxKxE), (ring_values, v_BxTxKxE))
    )
    kept = min(S, T)  # (of more than S new positions, only the last S stay)
    written_slots = jnp.mod(index + jnp.arange(T - kept, T), S)
    written = tuple(
        held.at[:, written_slots].set(new[:, T - kept :].astype(held.dtype))
        for held, new in ((ring_keys, k_BxTxKxE), (ring_values, v_BxTxKxE))
    )
    return keys, values, mask_TxA, positions_A, written


def decode_blocks(blocks, x_BxTxD, rotary, cache, index: jax.Array, scanned: bool, starts_B=None):
    """The stream through every block's `decode`; (stream, the cache of every block).

    The cache comes back in the form it came: stacked, or a tuple of the blocks' arrays.
    """
    if scanned:
        graphdef, stacked_state = nnx.split(blocks)

        def step(x_BxTxD, layer):
            block_state, keys, values = layer
            block = nnx.merge(graphdef, block_state)
            out_BxTxD, written = block.decode(x_BxTxD, rotary, (keys, values), index, starts_B)
            # Back to the stream's dtype: a block forced to another policy stays a drop-in.
            return out_BxTxD.astype(x_BxTxD.dtype), written

        x_BxTxD, (keys, values) = jax.lax.scan(step, x_BxTxD, (stacked_state, *cache))
        return x_BxTxD, (keys, values)
    written = []
    for layer, block in enumerate(blocks):
        layer_cache = (cache[0][layer], cache[1][layer])
        x_BxTxD, pair = block.decode(x_BxTxD, rotary, layer_cache, index, starts_B)
        written.append(pair)
    keys, values = zip(*written, strict=True)
    if isinstance(cache[0], tuple):  # blocks of different slots (empty_cache)
        return x_BxTxD, (keys, values)
    return x_BxTxD, (jnp.stack(keys), jnp.stack(values))


def generate_rows(
    params,
    model_state,
    tokens_RxP,
    starts_R,
    key,
    *,
    graphdef,
    model_config,
    dtype,
    pick,
    stop_at,
    max_new,
):
    """(new tokens R x max_new, how many were made), in one compiled program.

    The prefill, then a loop of next tokens that ends after max_new or once every row has
    made one of `stop_at`.
    """
    rows, length = tokens_RxP.shape
    keys = jax.random.split(key, max_new)
    stops = jnp.asarray(stop_at or (-1,), jnp.int32)
    model = nnx.merge(graphdef, params, model_state)
    cache = empty_cache(model_config, rows, length + max_new, dtype)
    logits_RxPxV, cache = model.decode(tokens_RxP, cache, 0, starts_R)
    token_R = pick(logits_RxPxV[:, -1], keys[0])
    new_RxN = jnp.zeros((rows, max_new), jnp.int32).at[:, 0].set(token_R)

    def going_on(carry) -> jax.Array:
        made, _, _, _, ended_R = carry
        return (made < max_new) & ~jnp.all(ended_R)

    def next_token(carry):
        made, token_R, cache, new_RxN, ended_R = carry
        model = nnx.merge(graphdef, params, model_state)
        logits_Rx1xV, cache = model.decode(token_R[:, None], cache, length + made - 1, starts_R)
        token_R = pick(logits_Rx1xV[:, -1], keys[made])
        new_RxN = jax.lax.dynamic_update_slice_in_dim(new_RxN, token_R[:, None], made, axis=1)
        return made + 1, token_R, cache, new_RxN, ended_R | jnp.isin(token_R, stops)

    carry = (jnp.int32(1), token_R, cache, new_RxN, jnp.isin(token_R, stops))
    made, _, _, new_RxN, _ = jax.lax.while_loop(going_on, next_token, carry)
    return new_RxN, made


def filtered_logits(logits_RxV, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The logits a sample is drawn from, as transformers' warpers make them, in their order.

    Divided by `temperature`; then all but the `top_k` likeliest at -inf (0: all kept); then
    all outside the smallest set whose probability reaches `top_p` (1: all kept; the
    likeliest token always stays).
    """
    logits_RxV = logits_RxV.astype(jnp.float32) / temperature
    if top_k:
        threshold_Rx1 = jax.lax.top_k(logits_RxV, top_k)[0][:, -1:]
        logits_RxV = jnp.where(logits_RxV < threshold_Rx1, -jnp.inf, logits_RxV)
    if top_p < 1.0:
        sorted_RxV = jnp.sort(logits_RxV, axis=-1)[:, ::-1]  # likeliest first
        probabilities_RxV = jax.nn.softmax(sorted_RxV, axis=-1)
        before_RxV = jnp.cumsum(probabilities_RxV, axis=-1) - probabilities_RxV
        # The least likely logit still inside the set: the set's cut-off.
        inside_RxV = before_RxV < top_p
        threshold_Rx1 = jnp.min(jnp.where(inside_RxV, sorted_RxV, jnp.inf), -1, keepdims=True)
        logits_RxV = jnp.where(logits_RxV < threshold_Rx1, -jnp.inf, logits_RxV)
    return logits_RxV


def pick_token(logits_RxV, key, *, greedy: bool, temperature: float, top_k: int, top_p: float):
    """The next token of each row: the likeliest, or a sample of the filtered logits."""
    if greedy or temperature == 0:
        return jnp.argmax(logits_RxV.astype(jnp.float32), axis=-1).astype(jnp.int32)
    logits_RxV = filtered_logits(logits_RxV, temperature, top_k, top_p)
    return jax.random.categorical(key, logits_RxV, axis=-1).astype(jnp.int32)
