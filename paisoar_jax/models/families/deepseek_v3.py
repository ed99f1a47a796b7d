"""DeepSeek-V3 (DeepseekV3ForCausalLM): latent attention, routed and shared experts.

The zoo's llama with DeepSeek's options, each a model key: multi-head latent attention
(kv_latent_width, q_latent_width, rope_head_width, value_head_width; models/latent.py)
with rotary pairs (rope_interleave) and YaRN (its mscale on the softmax folded into
query_scale_width); the first dense_layers blocks dense, then experts chosen by sigmoid
scores within the best groups (router=sigmoid, router_groups, router_top_groups), their
weights renormalised and scaled (router_scale), beside shared experts every token takes
(shared_experts); the router's balancing bias (HF's e_score_correction_bias) is model
state that bias balancing moves (router_bias_rate: 0 on import, the bias held as trained).
transformers' DeepSeek-V3 has no multi-token prediction modules: a checkpoint's MTP layers
(past num_hidden_layers) are not read, and an export has none.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.errors import UserError
from paisoar_jax.models.families import llama, qwen3_moe
from paisoar_jax.models.families.family import (
    Family,
    Tensor,
    refuse_differences,
    refuse_settings,
    transposed,
)

LAYER = "model.layers.{i}"
ATTENTION = f"{LAYER}.self_attn"
# The bias balancing moves: model state, at the layers with experts.
ROUTER_BIAS = dataclasses.replace(
    Tensor("blocks.moe.router_bias", f"{LAYER}.mlp.gate.e_score_correction_bias", state=True),
    on_layer=qwen3_moe.on_experts,
)
SHARED = tuple(
    dataclasses.replace(
        transposed(
            f"blocks.moe.shared_{name}_kernel", f"{LAYER}.mlp.shared_experts.{name}_proj.weight"
        ),
        on_layer=qwen3_moe.on_experts,
    )
    for name in ("gate", "up", "down")
)


def _in_heads(ours: str, theirs: str) -> Tensor:
    """An HF Linear (heads x width, in) as our in x heads x width kernel."""
    return Tensor(
        ours,
        theirs,
        lambda array, config: array.T.reshape(array.shape[1], config.heads, -1),
        lambda array, config: array.reshape(array.shape[0], -1).T,
    )


COMMON = tuple(
    tensor
    for tensor in llama.ATTENTION
    if tensor.ours not in ("blocks.q_kernel", "blocks.k_kernel", "blocks.v_kernel")
) + (
    transposed("blocks.kv_down_kernel", f"{ATTENTION}.kv_a_proj_with_mqa.weight"),
    Tensor("blocks.kv_latent_norm.scale", f"{ATTENTION}.kv_a_layernorm.weight"),
    _in_heads("blocks.kv_up_kernel", f"{ATTENTION}.kv_b_proj.weight"),
)
QUERY_LATENT = (
    transposed("blocks.q_kernel", f"{ATTENTION}.q_a_proj.weight"),
    Tensor("blocks.q_latent_norm.scale", f"{ATTENTION}.q_a_layernorm.weight"),
    _in_heads("blocks.q_up_kernel", f"{ATTENTION}.q_b_proj.weight"),
)
QUERY = (_in_heads("blocks.q_kernel", f"{ATTENTION}.q_proj.weight"),)


def tensors(model: LanguageModelConfig) -> tuple[Tensor, ...]:
    """The DeepSeek-V3 tensors of a model section: its query's form, dense and MoE layers."""
    query = QUERY_LATENT if model.q_latent_width else QUERY
    moe = qwen3_moe.EXPERTS + SHARED + (ROUTER_BIAS,)
    return COMMON + query + moe + qwen3_moe.DENSE


def _mscale(factor: float, scale: float) -> float:
    """YaRN's magnitude scale of a context `factor` times longer: 0.1 x scale x ln f + 1."""
    return 0.1 * scale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _rope(hf: dict, where: pathlib.Path, query_width: int) -> dict:
    """Our rotary keys of config.json's rope_parameters: the default or DeepSeek's YaRN.

    YaRN's mscale_all_dim scales the softmax by mscale^2 (transformers' yarn_apply_mscale):
    query_scale_width, the width whose 1 / sqrt gives that scale.
    """
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    keys = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta") or 10000.0))}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return keys
    if kind != "yarn":
        raise UserError(f"{where}: rope type {kind!r} is not the default or DeepSeek's yarn")
    original = int(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or hf["max_position_embeddings"] / original)
    attention_factor = rope.get("attention_factor")
    mscale, all_dims = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        scales = _mscale(factor, mscale) / _mscale(factor, all_dims) if mscale and all_dims else 0
        attention_factor = scales or _mscale(factor, 1.0)
    softmax = _mscale(factor, all_dims) ** 2 if all_dims else 1.0
    return keys | dict(
        rope_scaling="yarn",
        rope_factor=factor,
        rope_original_length=original,
        rope_truncate=bool(rope.get("truncate", True)),
        rope_attention_factor=float(attention_factor),
        rope_beta_fast=float(rope.get("beta_fast") or 32.0),
        rope_beta_slow=float(rope.get("beta_slow") or 1.0),
        query_scale_width=query_width / softmax**2 if softmax != 1.0 else 0.0,
    )


# transformers' defaults where a config.json leaves a key out (save_pretrained writes all)
DEFAULTS = {
    "DeepSeek-V3": dict(
        q_lora_rank=1536,
        n_shared_experts=1,
        first_k_dense_replace=3,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
    ),
    "DeepSeek-V2": dict(
        q_lora_rank=1536, n_shared_experts=2, first_k_dense_replace=0, routed_scaling_factor=1.0
    ),
}


def latent_keys(hf: dict, where: pathlib.Path, name: str) -> dict:
    """The model keys DeepSeek-V2 and V3 read alike: the shape, latent attention, experts.

    `name`: the architecture's, for the line that refuses what it does not read, and for
    transformers' defaults of the keys config.json leaves out.
    """
    hf = DEFAULTS[name] | hf
    refused = {
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "attention_bias": hf.get("attention_bias", False),
        "mlp_bias": hf.get("mlp_bias", False),
        "quantization_config": bool(hf.get("quantization_config")),
    }
    hints = {"quantization_config": " (dequantise it to bf16 first)"}
    refuse_settings(refused, hf, where, name, hints)
    nope, rotated = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    dense = min(hf["first_k_dense_replace"] or 0, hf["num_hidden_layers"])
    return dict(
        **(llama.shape_keys(hf, positions=4096) | {"head_width": nope}),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        kv_latent_width=hf["kv_lora_rank"],
        q_latent_width=hf.get("q_lora_rank") or 0,
        rope_head_width=rotated,
        value_head_width=hf["v_head_dim"],
        **_rope(hf, where, nope + rotated),
        experts=hf.get("n_routed_experts") or hf["num_local_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        expert_mlp_width=hf["moe_intermediate_size"],
        shared_experts=hf["n_shared_experts"] or 0,
        router_scale=float(hf["routed_scaling_factor"] or 1.0),
        # DeepSeek's weight of its balance loss (its own config.json's aux_loss_alpha)
        router_aux_loss=float(hf.get("aux_loss_alpha") or 0.0001),
        dense_layers=dense,
        scan_layers=not dense,  # dense blocks before the experts: unrolled
    )


def config_from_hf(hf: dict, where: pathlib.Path) -> LanguageModelConfig:
    """Our model section for a DeepSeek-V3 config.json; what differs is one line."""
    groups = DEFAULTS["DeepSeek-V3"] | hf
    return LanguageModelConfig(
        **latent_keys(hf, where, "DeepSeek-V3"),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        router="sigmoid",
        router_renormalize=bool(hf.get("norm_topk_prob", True)),
        router_groups=groups["n_group"] or 1,
        router_top_groups=groups["topk_group"] or 0,
        # the balancing bias held where its training left it: a fine-tune's routing stays
        # the checkpoint's (DeepSeek-V3 pretrained with 0.001)
        router_bias_rate=0.0,
    )


def check_latent(model: LanguageModelConfig, name: str, router: str) -> None:
    """What an HF DeepSeek holds: experts routed by `router` on every block after the dense."""
    differences = {
        "model.experts": model.experts == 0,
        "model.router": model.router != router,
        "model.moe_every": model.moe_every != 1,
        "model.expert_bias": model.expert_bias,
        "model.expert_activation": model.expert_activation != "silu",
        "model.mlp_activation": model.mlp_activation != "silu",
        "model.post_norms": model.post_norms,
        "model.embed_scale": model.embed_scale,
        "model.rope_scaling": model.rope_scaling not in ("none", "yarn"),
        # the softmax's own scale is written only as YaRN's mscale_all_dim
        "model.query_scale_width": model.query_scale_width and model.rope_scaling != "yarn",
    }
    refuse_differences(
        model,
        differences,
        f"an HF {name} has {router}-routed SwiGLU experts on every block after its dense ones, "
        "pre-norms only, and YaRN (the softmax scaled by its mscale) or no rotary scaling",
    )


def latent_json(model: LanguageModelConfig) -> dict:
    """The config.json settings DeepSeek-V2 and V3 write alike."""
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling == "yarn":
        query_width = model.query_head_size
        softmax = math.sqrt(query_width / (model.query_scale_width or query_width))
        log_factor = math.log(model.rope_factor) if model.rope_factor > 1 else 0.0
        all_dims = (math.sqrt(softmax) - 1) / (0.1 * log_factor) if log_factor else 0.0
        rope |= {
            "rope_type": "yarn",
            "factor": model.rope_factor,
            "original_max_position_embeddings": model.rope_original_length,
            "beta_fast": model.rope_beta_fast,
            "beta_slow": model.rope_beta_slow,
            "truncate": model.rope_truncate,
            "attention_factor": model.rope_attention_factor or _mscale(model.rope_factor, 1.0),
            "mscale_all_dim": all_dims,
        }
    return {
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.positions,
        "hidden_size": model.width,
        "intermediate_size": model.mlp_width or 4 * model.width,
        "moe_intermediate_size": model.expert_width,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.heads,
        "kv_lora_rank": model.kv_latent_width,
        "q_lora_rank": model.q_latent_width or None,
        "qk_nope_head_dim": model.head_size,
        "qk_rope_head_dim": model.rope_head_width,
        "v_head_dim": model.value_head_size,
        "rope_parameters": rope,
        "n_routed_experts": model.experts,
        "num_experts_per_tok": model.experts_per_token,
        "n_shared_experts": model.shared_experts,
        "routed_scaling_factor": model.router_scale,
        "first_k_dense_replace": model.dense_layers,
        "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": False,
        "hidden_act": "silu",
    }


def to_hf(model: LanguageModelConfig) -> dict:
    """The DeepseekV3ForCausalLM config.json of a latent-attention model section."""
    check_latent(model, "DeepSeek-V3", "sigmoid")
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **latent_json(model),
        "rope_interleave": model.rope_interleave,
        "norm_topk_prob": model.router_renormalize,
        "n_group": model.router_groups,
        "topk_group": model.router_top_groups or model.router_groups,
        "num_nextn_predict_layers": 0,
    }


def is_deepseek_v3(model: LanguageModelConfig) -> bool:
    """A llama section with multi-head latent attention and sigmoid routing."""
    return model.name == "llama" and bool(model.kv_latent_width) and model.router == "sigmoid"


FAMILY = Family(
    hf_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    model=llama.FAMILY.model,
    zoo_name="llama",
    tensors=tensors,
    from_hf=config_from_hf,
    to_hf=to_hf,
    holds=is_deepseek_v3,
    configs=("deepseek_v3_tiny", "deepseek_v3_671b"),
)
