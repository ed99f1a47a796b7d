"""A short text sample from the trained byte-level model, to see what it learned.

Decoded with the key/value cache loop of models/decoding.py, the one `paisoar_jax.generate`
runs, on the training run's own mesh and weights (in every process of a multi-process
run). A sample longer than the trained window (model.seq_len) goes on in windows: once the
cache is full, the last half of the text so far is the next prompt (the default model
trains on 128 bytes; its sample is 160).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.engine.state import StateLayout
from paisoar_jax.models.decoding import generate_rows, pick_token
from paisoar_jax.parallel import sharding


def generate(
    layout: StateLayout,
    params,
    model_state,
    mesh: Mesh,
    prompt: bytes,
    length: int,
    model_config: LanguageModelConfig,
    dtype,
    temperature: float = 0.8,
    seed: int = 0,
) -> bytes:
    """`prompt` and `length` bytes sampled after it at `temperature`, in the compute `dtype`."""
    # The windows the model trained on (never past the positions it holds), and their halves.
    positions = min(model_config.positions, model_config.seq_len)
    half = max(1, positions // 2)
    rows = sharding.batch_shards(mesh)  # one row per batch shard: the batch splits as in training
    pick = functools.partial(pick_token, greedy=False, temperature=temperature, top_k=0, top_p=1.0)
    decode = functools.partial(
        generate_rows, graphdef=layout.graphdef, model_config=model_config, dtype=dtype
    )
    compiled = {}  # max_new -> the loop, jitted (the windows after the first are alike)
    text = list(prompt)
    made = 0
    with jax.set_mesh(mesh):
        while made < length:
            window = text[-positions:] if made == 0 else text[-half:]
            # The last new token is never fed back: the window and the new ones but one fit.
            new = min(length - made, positions - len(window) + 1)
            tokens_RxP = np.tile(np.asarray(window, np.int32), (rows, 1))
            starts_R = np.zeros(rows, np.int32)
            placed = jax.device_put((tokens_RxP, starts_R), sharding.batch_sharding(mesh))
            key = jax.random.fold_in(jax.random.key(seed), made)
            if new not in compiled:
                # Whole on every device: each process of a multi-process run reads the text.
                compiled[new] = jax.jit(
                    functools.partial(decode, pick=pick, stop_at=(), max_new=new),
                    out_shardings=sharding.replicated(mesh),
                )
            new_RxN, _ = jax.device_get(compiled[new](params, model_state, *placed, key))
            text += new_RxN[0].tolist()
            made += new
    return bytes(text)
