"""Llama (LlamaForCausalLM): the zoo's llama decoder, and what its variants share.

RMSNorm, a SwiGLU MLP, rotary positions (with Llama 3's long-context scaling) and
grouped-query attention, no biases (models/llama.py). Mistral, Mixtral, Qwen2, Qwen3 and
Qwen3-MoE are Llamas with one or two differences each: their slices beside this one build
on the table and the config.json mapping here.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.errors import UserError
from paisoar_jax.models.families.family import (
    MAX_TRAINING_WINDOW,
    Family,
    Tensor,
    refuse_differences,
    refuse_settings,
    transposed,
)


def _linear_in_heads(kind: str) -> Tensor:
    """An HF Linear (heads x E, D) as our D x heads x E kernel; `kind` q, k or v."""

    def count(config: LanguageModelConfig) -> int:
        return config.heads if kind == "q" else config.key_value_heads

    return Tensor(
        f"blocks.{kind}_kernel",
        f"model.layers.{{i}}.self_attn.{kind}_proj.weight",
        lambda array, config: array.T.reshape(config.width, count(config), -1),
        lambda array, config: array.reshape(config.width, -1).T,
    )


# Every Llama-family model's: embeddings, attention, norms and head.
ATTENTION = (
    Tensor("token_embedding", "model.embed_tokens.weight"),
    Tensor("blocks.attention_norm.scale", "model.layers.{i}.input_layernorm.weight"),
    _linear_in_heads("q"),
    _linear_in_heads("k"),
    _linear_in_heads("v"),
    Tensor(
        "blocks.out_kernel",
        "model.layers.{i}.self_attn.o_proj.weight",
        lambda array, config: array.T.reshape(config.heads, -1, config.width),
        lambda array, config: array.reshape(-1, config.width).T,
    ),
    Tensor("blocks.mlp_norm.scale", "model.layers.{i}.post_attention_layernorm.weight"),
    Tensor("final_norm.scale", "model.norm.weight"),
    transposed("head", "lm_head.weight"),
)
# A dense Llama MLP (SwiGLU).
MLP = (
    transposed("blocks.gate_kernel", "model.layers.{i}.mlp.gate_proj.weight"),
    transposed("blocks.up_kernel", "model.layers.{i}.mlp.up_proj.weight"),
    transposed("blocks.down_kernel", "model.layers.{i}.mlp.down_proj.weight"),
)


def rope_scaling_keys(rope: dict, where: pathlib.Path) -> dict:
    """The model keys of HF's rope_parameters (or rope_scaling): {}, linear's or Llama-3's."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise UserError(f"{where}: rope type {rope_type!r} is not default, linear or llama3")
    if rope_type == "linear":
        return dict(rope_scaling="linear", rope_factor=float(rope["factor"]))
    if rope_type != "llama3":
        return {}
    return dict(
        rope_scaling="llama3",
        rope_factor=float(rope["factor"]),
        rope_low_freq_factor=float(rope["low_freq_factor"]),
        rope_high_freq_factor=float(rope["high_freq_factor"]),
        rope_original_length=int(rope["original_max_position_embeddings"]),
    )


def config_from_hf(
    hf: dict, where: pathlib.Path, variant: dict | None = None
) -> LanguageModelConfig:
    """Our model section for a Llama-family config.json; `variant`: a variant's own keys.

    What the zoo's llama cannot compute is refused in one line naming the setting: another
    activation, biases (but a variant's biased queries, keys and values: model.qkv_bias),
    a sliding window, dense layers between experts.
    """
    variant = variant or {}
    refused = {
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        # (Qwen2's are on q, k and v alone, always: model.qkv_bias; a Llama's on o too)
        "attention_bias": not variant.get("qkv_bias") and hf.get("attention_bias", False),
        "mlp_bias": hf.get("mlp_bias", False),
        "mlp_only_layers": bool(hf.get("mlp_only_layers")),
    }
    refuse_settings(refused, hf, where, "Llama")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return LanguageModelConfig(
        **shape_keys(hf),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        **rope_scaling_keys(rope, where),
        **window_keys(hf, where),
        **variant,
    )


def shape_keys(hf: dict, positions: int = 2048, epsilon: float = 1e-6) -> dict:
    """The model keys of a decoder's shape in config.json, what every family reads alike.

    `positions` and `epsilon`: the architecture's defaults where config.json has none.
    """
    width, heads = hf["hidden_size"], hf["num_attention_heads"]
    positions = hf.get("max_position_embeddings", positions)
    head_width = hf.get("head_dim") or width // heads
    return dict(
        name="llama",
        vocab_size=hf["vocab_size"],
        seq_len=min(positions, MAX_TRAINING_WINDOW),
        max_positions=positions,
        layers=hf["num_hidden_layers"],
        width=width,
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        head_width=0 if head_width * heads == width else head_width,  # 0: width / heads
        mlp_width=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", epsilon),
    )


def window_keys(hf: dict, where: pathlib.Path) -> dict:
    """The model keys of config.json's sliding window: {} where it never binds.

    The zoo's llama slides on every block, or on all but every n-th (model.global_every,
    Gemma's pattern); another pattern (Qwen2's max_window_layers > 0) is one line.
    """
    sliding, layers = _sliding_layers(hf), hf["num_hidden_layers"]
    if not sliding:
        return {}
    window = hf["sliding_window"]
    if len(sliding) == layers:
        return {"sliding_window": window}
    every = min(set(range(layers)) - set(sliding)) + 1
    if sliding == [i for i in range(layers) if (i + 1) % every]:
        # blocks that differ are unrolled: one scanned stack holds identical blocks
        return {"sliding_window": window, "global_every": every, "scan_layers": False}
    raise UserError(
        f"{where}: sliding_window={window} on layers {sliding} of {layers}: the zoo's llama "
        f"slides on every layer or on all but every n-th (model.global_every)"
    )


def layer_types(model: LanguageModelConfig) -> list[str]:
    """The layer_types transformers reads for a model section: each block sliding or full."""
    return [
        "sliding_attention" if model.window_of(layer) else "full_attention"
        for layer in range(model.layers)
    ]


def _sliding_layers(hf: dict) -> list[int]:
    """The layers whose sliding window binds: shorter than the positions the model holds.

    A window at least as long as max_position_embeddings never binds (the same logits as
    full attention), nor one that config.json turns off (use_sliding_window false, Qwen2's
    max_window_layers, or transformers 5's layer_types).
    """
    window, layers = hf.get("sliding_window"), range(hf["num_hidden_layers"])
    if window is None or window >= hf.get("max_position_embeddings", 2048):
        return []
    if hf.get("layer_types"):
        return [i for i in layers if hf["layer_types"][i] == "sliding_attention"]
    if hf.get("use_sliding_window") is False:
        return []
    return [i for i in layers if i >= (hf.get("max_window_layers") or 0)]


def to_hf(model: LanguageModelConfig) -> dict:
    """The LlamaForCausalLM config.json of a llama model section (variants add theirs)."""
    rope_scaling = None
    if model.rope_scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": model.rope_factor}
    if model.rope_scaling == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": model.rope_factor,
            "low_freq_factor": model.rope_low_freq_factor,
            "high_freq_factor": model.rope_high_freq_factor,
            "original_max_position_embeddings": model.rope_original_length,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "max_position_embeddings": (
            max(model.positions, model.rope_original_length)
            if model.rope_scaling == "llama3"
            else model.positions
        ),
        "hidden_size": model.width,
        "intermediate_size": model.mlp_width or 4 * model.width,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.key_value_heads,
        "head_dim": model.head_size,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": model.tie_embeddings,
    }


def is_llama(model: LanguageModelConfig) -> bool:
    """A llama section with none of the variants' differences."""
    return model.name == "llama" and not (
        model.experts
        or model.qk_norm
        or model.qkv_bias
        or model.sliding_window
        or is_gemma(model)
        or is_gpt_oss_like(model)
        or model.kv_latent_width
    )


def is_gpt_oss_like(model: LanguageModelConfig) -> bool:
    """A llama section with any of GPT-OSS's differences (sinks, biases, clamped experts)."""
    return model.name == "llama" and bool(
        model.attention_sinks
        or model.out_bias
        or model.expert_bias
        or model.expert_activation != "silu"
        or model.rope_scaling == "yarn"
    )


def is_gemma(model: LanguageModelConfig) -> bool:
    """A llama section with any of Gemma's differences (norms, embeddings, GeGLU, scale)."""
    return model.name == "llama" and bool(
        model.norm_offset
        or model.post_norms
        or model.embed_scale
        or model.mlp_activation != "silu"
        or model.query_scale_width
        or model.local_rope_theta
    )


def check_routing(
    model: LanguageModelConfig, name: str, renormalized: bool, dense_between: bool = False
) -> None:
    """HF's MoE routes softmax top-k with no shared experts: refuses others.

    Every layer has experts, or (`dense_between`, Qwen3-MoE's decoder_sparse_step) every
    model.moe_every-th.
    """
    differences = {
        "model.router": model.router != "softmax",
        "model.router_renormalize": model.router_renormalize != renormalized,
        "model.shared_experts": model.shared_experts != 0,
        "model.moe_every": model.moe_every != 1 and not dense_between,
    }
    renormalizes = " (and renormalises the chosen)" if name == "Mixtral" else ""
    refuse_differences(
        model,
        differences,
        f"an HF {name} routes softmax top-k{renormalizes} on every layer with no shared experts",
    )


def variant(
    hf_type: str,
    architecture: str,
    *,
    keys: Callable[[dict], dict],
    json: Callable[[LanguageModelConfig], dict] | None,
    tensors: Callable[[LanguageModelConfig], tuple[Tensor, ...]],
    holds: Callable[[LanguageModelConfig], bool],
    configs: tuple[str, ...] = (),
) -> Family:
    """The family of a Llama variant: Llama's config.json mapping and its own differences.

    Args:
        hf_type: its config.json model_type.
        architecture: its transformers class.
        keys: our model keys its config.json sets beyond a Llama's (hf -> keys).
        json: what its config.json adds to a Llama's (model -> settings); None: it exports
            as a Llama.
        tensors: its tensor table.
        holds: whether a model section exports as it.
        configs: its shipped configs.

    Returns:
        The Family, run by the zoo's llama.
    """

    def from_hf(hf: dict, where: pathlib.Path) -> LanguageModelConfig:
        return config_from_hf(hf, where, keys(hf))

    def variant_json(model: LanguageModelConfig) -> dict:
        window = model.sliding_window or None
        named = {"architectures": [architecture], "model_type": hf_type, "sliding_window": window}
        settings = to_hf(model) | named | json(model)
        if window and "use_sliding_window" in settings:  # Qwen's: on, from the first layer
            settings |= {"use_sliding_window": True, "max_window_layers": 0}
        return settings

    def variant_holds(model: LanguageModelConfig) -> bool:
        # Every block slides or none: the pattern of some is Gemma's alone; latent attention
        # is DeepSeek's.
        own = is_gemma(model) or is_gpt_oss_like(model) or model.kv_latent_width
        return holds(model) and not own and model.global_every <= 1

    return Family(
        hf_type=hf_type,
        architecture=architecture,
        model=FAMILY.model,
        zoo_name="llama",
        tensors=tensors,
        from_hf=from_hf,
        to_hf=variant_json if json else None,
        holds=variant_holds,
        configs=configs,
    )


FAMILY = Family(
    hf_type="llama",
    architecture="LlamaForCausalLM",
    model="paisoar_jax.models.llama.Llama",
    zoo_name="llama",
    tensors=lambda model: ATTENTION + MLP,
    from_hf=config_from_hf,
    to_hf=to_hf,
    holds=is_llama,
    configs=(
        "llama_tiny",
        "llama_long_tiny",
        "llama3_1b",
        "llama3_8b",
        "llama3_8b_32k",
        "llama3_8b_128k",
        "llama3_8b_lora",
    ),
)
