"""A short text sample from the trained byte-level model, to see what it learned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from paisoar_jax.parallel import sharding
from paisoar_jax.precision import float32_island
from paisoar_jax.state import StateLayout


def generate(
    layout: StateLayout,
    params,
    model_state,
    mesh: Mesh,
    prompt: bytes,
    length: int,
    seq_len: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> bytes:
    """Samples `length` bytes after `prompt`, attending to at most the last seq_len bytes."""
    # One row per batch shard, so the batch splits over (data, fsdp) like in training.
    rows = sharding.batch_shards(mesh)

    @jax.jit
    def next_token(params, model_state, window_RxT, index, key):
        # model_state: the fp8 scales of an fp8 model; empty for other language models.
        logits_RxTxV = nnx.merge(layout.graphdef, params, model_state)(window_RxT)
        logits_V = float32_island(logits_RxTxV[0, index]) / temperature
        return jax.random.categorical(key, logits_V)

    tokens = list(prompt)
    key = jax.random.key(seed)
    for _ in range(length):
        window = tokens[-seq_len:]
        window_RxT = np.zeros((rows, seq_len), np.int32)
        window_RxT[:, : len(window)] = window
        key, subkey = jax.random.split(key)
        batch = jax.device_put(window_RxT, sharding.batch_sharding(mesh))
        index = jnp.int32(len(window) - 1)
        tokens.append(int(next_token(params, model_state, batch, index, subkey)))
    return bytes(tokens)
