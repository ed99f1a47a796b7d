"""Mistral (MistralForCausalLM): a Llama, when every layer attends to the whole context.

It imports as a llama and exports as one (transformers reads a Llama the same). A
sliding window shorter than the model's positions is refused in one line: the zoo's llama
attends to every earlier token.
"""

from __future__ import annotations

from paisoar_jax.models.families import llama

FAMILY = llama.variant(
    "mistral",
    "MistralForCausalLM",
    keys=lambda hf: {},
    json=None,  # exports as a Llama
    tensors=lambda model: llama.ATTENTION + llama.MLP,
    holds=lambda model: False,
)
