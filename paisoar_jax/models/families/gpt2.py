"""GPT-2 (GPT2LMHeadModel): the zoo's gpt decoder with learned positions.

Pre-LayerNorm blocks with biases and a tanh-GELU MLP (models/gpt.py); transformers' Conv1D
stores its kernels in x out, as ours are, and fuses the queries, keys and values.
"""

from __future__ import annotations

import pathlib

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.errors import UserError
from paisoar_jax.models.families.family import (
    MAX_TRAINING_WINDOW,
    Family,
    Tensor,
    norm,
    transposed,
)


def _split_qkv(array, model):
    """GPT-2's fused (D, 3D) queries, keys and values as (D, 3, heads, E)."""
    return array.reshape(*array.shape[:-1], 3, model.heads, -1)


TENSORS = (
    Tensor("token_embedding", "transformer.wte.weight"),
    Tensor("position_embedding", "transformer.wpe.weight"),
    *norm("blocks.attention_norm", "transformer.h.{i}.ln_1"),
    Tensor(
        "blocks.qkv_kernel",
        "transformer.h.{i}.attn.c_attn.weight",
        _split_qkv,
        lambda array, config: array.reshape(config.width, -1),
    ),
    Tensor(
        "blocks.qkv_bias",
        "transformer.h.{i}.attn.c_attn.bias",
        _split_qkv,
        lambda array, config: array.reshape(-1),
    ),
    Tensor(
        "blocks.out_kernel",
        "transformer.h.{i}.attn.c_proj.weight",
        lambda array, config: array.reshape(config.heads, -1, config.width),
        lambda array, config: array.reshape(-1, config.width),
    ),
    Tensor("blocks.out_bias", "transformer.h.{i}.attn.c_proj.bias"),
    *norm("blocks.mlp_norm", "transformer.h.{i}.ln_2"),
    Tensor("blocks.mlp_in_kernel", "transformer.h.{i}.mlp.c_fc.weight"),
    Tensor("blocks.mlp_in_bias", "transformer.h.{i}.mlp.c_fc.bias"),
    Tensor("blocks.mlp_out_kernel", "transformer.h.{i}.mlp.c_proj.weight"),
    Tensor("blocks.mlp_out_bias", "transformer.h.{i}.mlp.c_proj.bias"),
    *norm("final_norm", "transformer.ln_f"),
    transposed("head", "lm_head.weight"),  # untied embeddings only
)


def from_hf(hf: dict, where: pathlib.Path) -> LanguageModelConfig:
    """Our model section for a GPT-2 config.json (refusing what changes its math)."""
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserError(f"{where}: activation_function {hf['activation_function']} is not GPT-2's")
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise UserError(
            f"{where}: scale_attn_by_inverse_layer_idx / scale_attn_weights change GPT-2's "
            f"attention scale, which this model does not"
        )
    return LanguageModelConfig(
        name="gpt",
        vocab_size=hf["vocab_size"],
        seq_len=min(hf["n_positions"], MAX_TRAINING_WINDOW),
        max_positions=hf["n_positions"],
        layers=hf["n_layer"],
        width=hf["n_embd"],
        heads=hf["n_head"],
        mlp_width=hf.get("n_inner") or 0,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        position="learned",
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


def to_hf(model: LanguageModelConfig) -> dict:
    """The GPT2LMHeadModel config.json of a gpt model section."""
    if model.position != "learned":
        raise UserError(
            f"an HF GPT-2 has learned positions: this model has model.position={model.position}"
        )
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_positions": model.positions,
        "n_embd": model.width,
        "n_layer": model.layers,
        "n_head": model.heads,
        "n_inner": model.mlp_width or None,
        "layer_norm_epsilon": model.norm_eps,
        "activation_function": "gelu_new",
        "tie_word_embeddings": model.tie_embeddings,
    }


FAMILY = Family(
    hf_type="gpt2",
    architecture="GPT2LMHeadModel",
    model="paisoar_jax.models.gpt.GPT",
    zoo_name="gpt",
    tensors=lambda model: TENSORS,
    from_hf=from_hf,
    to_hf=to_hf,
    holds=lambda model: model.name == "gpt",
    configs=("default", "gpt2_124m", "gpt_1b"),
)
