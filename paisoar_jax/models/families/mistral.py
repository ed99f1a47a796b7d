"""Mistral (MistralForCausalLM): a Llama whose every layer attends over a sliding window.

model.sliding_window: a token attends to the sliding_window tokens ending at itself
(transformers' window, the token included). A Mistral without one (v0.2 on, or a window
no shorter than its positions) imports as a llama and exports as a Llama.
"""

from __future__ import annotations

from paisoar_jax.models.families import llama

FAMILY = llama.variant(
    "mistral",
    "MistralForCausalLM",
    keys=lambda hf: {},
    json=lambda model: {},  # the window: variant() writes it
    tensors=lambda model: llama.ATTENTION + llama.MLP,
    holds=lambda model: (
        model.name == "llama"
        and bool(model.sliding_window)
        and not (model.experts or model.qk_norm or model.qkv_bias)
    ),
)
