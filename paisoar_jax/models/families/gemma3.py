"""Gemma 3, text (Gemma3ForCausalLM): the zoo's llama with Gemma's options set.

What differs from a Llama, each a model key the llama block reads (models/llama.py):
sliding-window blocks with every n-th global (model.sliding_window, global_every, from
config.json's layer_types), the sliding blocks' own rotary base (local_rope_theta) and the
global ones' linear scaling (rope_scaling=linear), RMSNorms as (1 + w) (norm_offset) on
each head's queries and keys too (qk_norm) and on the attention's and MLP's outputs
(post_norms), GeGLU with tanh GELU (mlp_activation=gelu_tanh), embeddings times
sqrt(width) (embed_scale), logits divided by sqrt(query_pre_attn_scalar)
(query_scale_width), tied embeddings. Gemma 2's soft-capping and the multimodal Gemma 3
(model_type gemma3, a vision tower) are refused in one line.
"""

from __future__ import annotations

import math
import pathlib

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.errors import UserError
from paisoar_jax.models.families import llama, qwen3
from paisoar_jax.models.families.family import Family, Tensor, refuse_settings

LAYER = "model.layers.{i}"
NORMS = (
    Tensor("blocks.post_attention_norm.scale", f"{LAYER}.post_attention_layernorm.weight"),
    Tensor("blocks.mlp_norm.scale", f"{LAYER}.pre_feedforward_layernorm.weight"),
    Tensor("blocks.post_mlp_norm.scale", f"{LAYER}.post_feedforward_layernorm.weight"),
)
# A Llama's table with Gemma's names for the norms around the MLP (a Llama's
# post_attention_layernorm is the MLP's input norm; Gemma's is the attention's output norm).
TENSORS = (
    tuple(tensor for tensor in llama.ATTENTION if tensor.ours != "blocks.mlp_norm.scale")
    + qwen3.QK_NORMS
    + NORMS
    + llama.MLP
)


def _rope(hf: dict, where: pathlib.Path) -> dict:
    """Our rotary keys of config.json's rope_parameters, one entry per layer type.

    transformers 4.x wrote rope_theta, rope_local_base_freq and rope_scaling (the global
    layers') at the top level instead.
    """
    rope = hf.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    else:
        full, local = dict(rope or hf.get("rope_scaling") or {}), {}
    if local.get("rope_type", "default") != "default":
        raise UserError(
            f"{where}: the sliding layers' rope type {local['rope_type']!r} is not default"
        )
    return dict(
        rope_theta=float(full.get("rope_theta", hf.get("rope_theta") or 1_000_000.0)),
        local_rope_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq") or 10_000.0)),
        **llama.rope_scaling_keys(full, where),
    )


def config_from_hf(hf: dict, where: pathlib.Path) -> LanguageModelConfig:
    """Our model section for a Gemma 3 text config.json; what differs is one line."""
    refused = {
        "hidden_activation": hf.get("hidden_activation", "gelu_pytorch_tanh")
        != "gelu_pytorch_tanh",
        "final_logit_softcapping": hf.get("final_logit_softcapping") is not None,
        "attn_logit_softcapping": hf.get("attn_logit_softcapping") is not None,
        "attention_bias": hf.get("attention_bias", False),
        "use_bidirectional_attention": hf.get("use_bidirectional_attention", False),
    }
    refuse_settings(refused, hf, where, "Gemma 3")
    # The layer types kept even where the window never binds: a sliding layer's rotary
    # base is its own either way.
    # transformers 4.x wrote no layer_types: every sliding_window_pattern-th layer global.
    pattern = hf.get("sliding_window_pattern") or 6
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(hf["num_hidden_layers"])
    ]
    every = hf | {"max_position_embeddings": math.inf, "layer_types": types}
    keys = _rope(hf, where) | llama.window_keys(every, where)
    if not keys.get("sliding_window"):
        keys["local_rope_theta"] = 0.0  # no block slides: no second base
    return LanguageModelConfig(
        **llama.shape_keys(hf, positions=131_072),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        qk_norm=True,
        norm_offset=True,
        post_norms=True,
        mlp_activation="gelu_tanh",
        embed_scale=True,
        query_scale_width=float(hf.get("query_pre_attn_scalar", 256)),
        **keys,
    )


def to_hf(model: LanguageModelConfig) -> dict:
    """The Gemma3ForCausalLM config.json of a Gemma 3 model section."""
    llama_json = llama.to_hf(model)
    full = {"rope_type": "default", "rope_theta": model.rope_theta}
    if llama_json["rope_scaling"]:
        full |= llama_json["rope_scaling"]
    # Without a base of their own, the sliding blocks turn as the global ones, scaling too.
    local = {"rope_type": "default", "rope_theta": model.local_rope_theta}
    scale_width = float(model.query_scale_width or model.head_size)
    return {
        key: llama_json[key]
        for key in ("vocab_size", "max_position_embeddings", "hidden_size", "intermediate_size")
        + ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
        + ("rms_norm_eps", "tie_word_embeddings")
    } | {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int(scale_width) if scale_width.is_integer() else scale_width,
        "sliding_window": model.sliding_window or model.positions,
        "layer_types": llama.layer_types(model),
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": local if model.local_rope_theta else dict(full),
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
    }


def is_gemma3(model: LanguageModelConfig) -> bool:
    """A llama section with every one of Gemma 3's differences, and no experts or biases."""
    return (
        model.name == "llama"
        and model.norm_offset
        and model.post_norms
        and model.embed_scale
        and model.qk_norm
        and model.mlp_activation == "gelu_tanh"
        and not (model.experts or model.qkv_bias or llama.is_gpt_oss_like(model))
    )


FAMILY = Family(
    hf_type="gemma3_text",
    architecture="Gemma3ForCausalLM",
    model=llama.FAMILY.model,
    zoo_name="llama",
    tensors=lambda model: TENSORS,
    from_hf=config_from_hf,
    to_hf=to_hf,
    holds=is_gemma3,
    configs=("gemma3_tiny", "gemma3_27b"),
)
