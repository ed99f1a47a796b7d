"""The model families: one module per Hugging Face architecture, and their registry.

Each family's slice (family.py says what one holds) names transformers' architecture, the
zoo decoder that runs it, its tensor table, its config.json both ways and its shipped
configs. `convert hf-import` finds a family by config.json's model_type
(`family_of_hf`), `hf-export` by our model section (`family_of`). A new family is a module
here and one line in FAMILIES.
"""

from __future__ import annotations

import pathlib

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.config.models import LLAMA_KEYS
from paisoar_jax.errors import UserError
from paisoar_jax.models.families import (
    deepseek_v2,
    deepseek_v3,
    gemma3,
    gpt2,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen3,
    qwen3_moe,
)
from paisoar_jax.models.families.family import MAX_TRAINING_WINDOW, Family, Tensor

__all__ = ["FAMILIES", "MAX_TRAINING_WINDOW", "Family", "Tensor", "family_of", "family_of_hf"]

FAMILIES: tuple[Family, ...] = (
    gpt2.FAMILY,
    llama.FAMILY,
    mistral.FAMILY,
    mixtral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    gemma3.FAMILY,
    gpt_oss.FAMILY,
    deepseek_v3.FAMILY,
    deepseek_v2.FAMILY,
)
# transformers' class of each family, by config.json's model_type.
ARCHITECTURES = {family.hf_type: family.architecture for family in FAMILIES}
# Architectures people fine-tune that no family imports yet, by model_type: what they have
# that the zoo's decoders do not compute (an import would give other logits).
NOT_YET = {
    "gemma": "Gemma's embeddings scaled by sqrt(width), (1 + w) RMSNorms and GeGLU MLP",
    "gemma2": "Gemma 2's sliding-window layers, pre- and post-norms and logit soft-capping",
    "gemma3": "Gemma 3's vision tower (its text model, Gemma3ForCausalLM, imports)",
    "phi3": "Phi-3's fused query-key-value and gate-up projections",
    "olmo2": "OLMo 2's norms after attention and the MLP, and its queries and keys normed "
    "over the whole width",
    "smollm3": "SmolLM3's layers without rotary positions (NoPE, every fourth layer)",
    "qwen3_next": "Qwen3-Next's gated DeltaNet linear-attention layers",
    "qwen3_5": "Qwen3.5's gated DeltaNet linear-attention layers and vision tower",
    "qwen3_5_text": "Qwen3.5's gated DeltaNet linear-attention layers",
    "llama4": "Llama 4's interleaved chunked attention layers without rotary positions",
}


def family_of_hf(hf: dict, where: pathlib.Path) -> Family:
    """The family of a config.json, by its model_type; any other is one line."""
    for family in FAMILIES:
        if family.hf_type == hf.get("model_type"):
            return family
    found = ", ".join(map(str, hf.get("architectures") or [hf.get("model_type")]))
    if hf.get("model_type") in NOT_YET:
        raise UserError(
            f"{where}: {found} does not import yet: the zoo's decoders do not compute "
            f"{NOT_YET[hf['model_type']]}"
        )
    known = sorted(ARCHITECTURES.values())
    raise UserError(
        f"{where}: {found} is not an architecture this imports "
        f"({', '.join(known[:-1])} or {known[-1]})"
    )


def family_of(model: LanguageModelConfig) -> Family:
    """The family whose Hugging Face form holds our model section (what it exports as).

    A llama with biased queries, keys and values is a Qwen2; with its heads' queries and keys
    normed a Qwen3, with experts too a Qwen3-MoE; with experts alone a Mixtral.
    """
    if model.qkv_bias and (model.qk_norm or model.experts) and not model.attention_sinks:
        raise UserError(
            "no Hugging Face architecture has biased queries, keys and values "
            "(model.qkv_bias, Qwen2's) with model.qk_norm or model.experts"
        )
    held = [family for family in FAMILIES if family.holds(model)]
    assert len(held) <= 1, [family.hf_type for family in held]  # the holds are exclusive
    if not held:
        defaults = LanguageModelConfig(name=model.name)
        settings = ", ".join(
            f"model.{key}={getattr(model, key)}"
            for key in LLAMA_KEYS + ("experts",)
            if getattr(model, key) != getattr(defaults, key)
        )
        raise UserError(
            f"no Hugging Face architecture exported here holds a {model.name} with {settings} "
            f"(Gemma 3 slides on all blocks but every n-th with all of Gemma's norms; the "
            f"others slide on every block or none)"
        )
    return held[0]


def model_config_from_hf(hf: dict, where: pathlib.Path) -> LanguageModelConfig:
    """Our model section for a config.json of a family here (UserError for any other).

    One without a setting its architecture has (a truncated or hand-made file) is one line
    naming the setting.
    """
    family = family_of_hf(hf, where)
    try:
        return family.from_hf(hf, where)
    except KeyError as error:
        raise UserError(
            f"{where} has no {error.args[0]!r}, which a {hf.get('model_type')} config.json "
            f"holds: not a whole transformers config (truncated or edited?)"
        ) from None


def hf_config(model: LanguageModelConfig) -> dict:
    """The config.json transformers reads for our model section."""
    family = family_of(model)
    assert family.to_hf is not None  # (a family that holds a section exports it)
    return family.to_hf(model)


def tensors_of(model: LanguageModelConfig) -> tuple[Tensor, ...]:
    """Every tensor of the Hugging Face form of our model section."""
    return family_of(model).tensors(model)
