"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): a Llama with biased queries, keys and values.

model.qkv_bias: one bias per head and feature on the q, k and v projections (none on the
output projection). A sliding window on every layer (use_sliding_window, max_window_layers
0) is model.sliding_window; on some layers only, one line.
"""

from __future__ import annotations

from paisoar_jax.models.families import llama
from paisoar_jax.models.families.family import Tensor

BIASES = tuple(
    Tensor(
        f"blocks.{kind}_bias",
        f"model.layers.{{i}}.self_attn.{kind}_proj.bias",
        lambda array, config: array.reshape(-1, config.head_size),
        lambda array, config: array.reshape(-1),
    )
    for kind in ("q", "k", "v")
)

FAMILY = llama.variant(
    "qwen2",
    "Qwen2ForCausalLM",
    keys=lambda hf: {"qkv_bias": True},
    # the window off on every layer
    json=lambda model: {
        "use_sliding_window": False,
        "max_window_layers": model.layers,
        "attention_bias": None,
    },
    tensors=lambda model: llama.ATTENTION + BIASES + llama.MLP,
    holds=lambda model: model.name == "llama" and model.qkv_bias,
)
