"""GPT-OSS (GptOssForCausalLM): the zoo's llama with GPT-OSS's options set.

What differs from a Mixtral, each a model key (models/llama.py, models/moe.py): biases on
the queries, keys, values (qkv_bias) and the output projection (out_bias); a learned sink
logit per head in each softmax (attention_sinks); sliding-window layers alternating with
global ones (sliding_window, global_every=2, from layer_types); YaRN rotary scaling
(rope_scaling=yarn); a router with a bias, softmax over the chosen experts; experts with
biases (expert_bias) and the clamped SwiGLU (expert_activation=clamped_swiglu, swiglu_alpha,
swiglu_limit), their gate and up interleaved in one HF tensor. The published checkpoints'
experts in MXFP4 are decoded as they are read (tools/hf/reader.py); training is in bf16 and
the export writes bf16.
"""

from __future__ import annotations

import pathlib

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.errors import UserError
from paisoar_jax.models.families import llama, qwen2
from paisoar_jax.models.families.family import (
    Family,
    Tensor,
    interleaved,
    transposed,
)

LAYER = "model.layers.{i}"
EXPERTS = f"{LAYER}.mlp.experts"
TENSORS = (
    *llama.ATTENTION,
    *qwen2.BIASES,
    Tensor("blocks.out_bias", f"{LAYER}.self_attn.o_proj.bias"),
    Tensor("blocks.sinks", f"{LAYER}.self_attn.sinks"),
    transposed("blocks.moe.router_kernel", f"{LAYER}.mlp.router.weight"),
    Tensor("blocks.moe.router_logit_bias", f"{LAYER}.mlp.router.bias"),
    # HF's experts are (experts, in, out) already, the gate and up interleaved.
    interleaved("blocks.moe.gate_kernel", f"{EXPERTS}.gate_up_proj", 0, 2),
    interleaved("blocks.moe.up_kernel", f"{EXPERTS}.gate_up_proj", 1, 2),
    interleaved("blocks.moe.gate_bias", f"{EXPERTS}.gate_up_proj_bias", 0, 2),
    interleaved("blocks.moe.up_bias", f"{EXPERTS}.gate_up_proj_bias", 1, 2),
    Tensor("blocks.moe.down_kernel", f"{EXPERTS}.down_proj"),
    Tensor("blocks.moe.down_bias", f"{EXPERTS}.down_proj_bias"),
)


def _rope(hf: dict, where: pathlib.Path) -> dict:
    """Our rotary keys of config.json's rope_parameters: default or YaRN."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    keys = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta") or 150_000.0))}
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return keys
    if kind != "yarn" or rope.get("mscale") or rope.get("mscale_all_dim"):
        raise UserError(f"{where}: rope {rope} is not the default or GPT-OSS's YaRN")
    return keys | dict(
        rope_scaling="yarn",
        rope_factor=float(rope["factor"]),
        rope_original_length=int(rope["original_max_position_embeddings"]),
        rope_truncate=bool(rope.get("truncate", True)),
        rope_attention_factor=float(rope.get("attention_factor") or 0.0),
        rope_beta_fast=float(rope.get("beta_fast") or 32.0),
        rope_beta_slow=float(rope.get("beta_slow") or 1.0),
    )


def _layer_types(hf: dict) -> list[str]:
    """config.json's layer_types, or transformers' default: sliding first, alternating."""
    layers = range(hf["num_hidden_layers"])
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in layers]
    return hf.get("layer_types") or alternating


def config_from_hf(hf: dict, where: pathlib.Path) -> LanguageModelConfig:
    """Our model section for a GPT-OSS config.json; what differs is one line."""
    quantization = (hf.get("quantization_config") or {}).get("quant_method")
    if quantization not in (None, "mxfp4"):  # MXFP4's experts decode as they are read
        raise UserError(
            f"{where}: the experts are stored in {quantization}, which this import does not "
            "read (it reads bf16, fp32 and MXFP4): dequantise them with transformers first"
        )
    if not hf.get("attention_bias", True):
        raise UserError(f"{where}: attention_bias=False is not a GPT-OSS this model reads")
    return LanguageModelConfig(
        **llama.shape_keys(hf, positions=131_072, epsilon=1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=True,
        out_bias=True,
        attention_sinks=True,
        experts=hf["num_local_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        router_aux_loss=float(hf.get("router_aux_loss_coef", 0.001)),
        expert_bias=True,
        expert_activation="clamped_swiglu",
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        **_rope(hf, where),
        **llama.window_keys(hf | {"layer_types": _layer_types(hf)}, where),
    )


def to_hf(model: LanguageModelConfig) -> dict:
    """The GptOssForCausalLM config.json of a GPT-OSS model section."""
    llama.check_routing(model, "GPT-OSS", renormalized=True)
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling == "yarn":
        rope |= {
            "rope_type": "yarn",
            "factor": model.rope_factor,
            "beta_fast": model.rope_beta_fast,
            "beta_slow": model.rope_beta_slow,
            "truncate": model.rope_truncate,
            "original_max_position_embeddings": model.rope_original_length,
        }
        if model.rope_attention_factor:
            rope["attention_factor"] = model.rope_attention_factor
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.positions,
        "hidden_size": model.width,
        "intermediate_size": model.expert_width,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.key_value_heads,
        "head_dim": model.head_size,
        "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": True,
        "num_local_experts": model.experts,
        "num_experts_per_tok": model.experts_per_token,
        "router_aux_loss_coef": model.router_aux_loss,
        "swiglu_alpha": model.swiglu_alpha,
        "swiglu_limit": model.swiglu_limit,
        "sliding_window": model.sliding_window or model.positions,
        "layer_types": llama.layer_types(model),
        "rope_parameters": rope,
        "hidden_act": "silu",
    }


def is_gpt_oss(model: LanguageModelConfig) -> bool:
    """A llama section with GPT-OSS's sinks, biases and clamped experts."""
    return (
        model.name == "llama"
        and model.attention_sinks
        and model.out_bias
        and model.qkv_bias
        and model.expert_bias
        and model.expert_activation == "clamped_swiglu"
        and model.rope_scaling in ("none", "yarn")
        and not (model.qk_norm or llama.is_gemma(model))
    )


FAMILY = Family(
    hf_type="gpt_oss",
    architecture="GptOssForCausalLM",
    model=llama.FAMILY.model,
    zoo_name="llama",
    tensors=lambda model: TENSORS,
    from_hf=config_from_hf,
    to_hf=to_hf,
    holds=is_gpt_oss,
    configs=("gpt_oss_20b", "gpt_oss_120b"),
)
