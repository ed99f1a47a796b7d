"""Qwen3 (Qwen3ForCausalLM): a Llama whose heads' queries and keys are RMS-normed.

model.qk_norm: each head's queries and keys normed before the rotary positions, as
transformers does (torchtune#2809: after them gives other logits); heads may be wider than
width / heads (model.head_width).
"""

from __future__ import annotations

from paisoar_jax.models.families import llama
from paisoar_jax.models.families.family import Tensor

QK_NORMS = (
    Tensor("blocks.q_norm.scale", "model.layers.{i}.self_attn.q_norm.weight"),
    Tensor("blocks.k_norm.scale", "model.layers.{i}.self_attn.k_norm.weight"),
)

FAMILY = llama.variant(
    "qwen3",
    "Qwen3ForCausalLM",
    keys=lambda hf: {"qk_norm": True},
    json=lambda model: {"use_sliding_window": False},
    tensors=lambda model: llama.ATTENTION + QK_NORMS + llama.MLP,
    holds=lambda model: model.name == "llama" and model.qk_norm and not model.experts,
)
