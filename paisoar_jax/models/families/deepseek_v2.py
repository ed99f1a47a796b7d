"""DeepSeek-V2 (DeepseekV2ForCausalLM): DeepSeek-V3's latent attention, softmax routing.

What differs from DeepSeek-V3 (its slice holds the tensor table and the shared keys):
softmax scores (router=softmax), their chosen weights not renormalised, only scaled
(routed_scaling_factor: router_scale); topk_method group_limited_greedy ranks each group by
its best score (router_groups, router_top_groups; greedy is one group); no balancing bias;
the rotary pairs always neighbouring features (DeepSeek-V2's complex rotation).
DeepSeek-V2-Lite is this family.
"""

from __future__ import annotations

import pathlib

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.errors import UserError
from paisoar_jax.models.families import deepseek_v3
from paisoar_jax.models.families.family import Family, refuse_differences


def tensors(model: LanguageModelConfig):
    """DeepSeek-V3's table without the router's bias (a softmax router has none)."""
    return tuple(tensor for tensor in deepseek_v3.tensors(model) if not tensor.state)


def config_from_hf(hf: dict, where: pathlib.Path) -> LanguageModelConfig:
    """Our model section for a DeepSeek-V2 config.json; what differs is one line."""
    method = hf.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise UserError(f"{where}: topk_method={method} is not greedy or group_limited_greedy")
    grouped = method == "group_limited_greedy"  # (no group defaults: transformers' are None)
    return LanguageModelConfig(
        **deepseek_v3.latent_keys(hf, where, "DeepSeek-V2"),
        rope_interleave=True,
        router="softmax",
        router_renormalize=False,
        router_groups=(hf.get("n_group") or 1) if grouped else 1,
        router_top_groups=(hf.get("topk_group") or 0) if grouped else 0,
    )


def to_hf(model: LanguageModelConfig) -> dict:
    """The DeepseekV2ForCausalLM config.json of a latent-attention, softmax-routed section."""
    deepseek_v3.check_latent(model, "DeepSeek-V2", "softmax")
    differences = {
        "model.router_renormalize": model.router_renormalize,
        "model.rope_interleave": not model.rope_interleave,
        "model.router_bias_rate": model.router_bias_rate,  # a bias V2's router has not
    }
    refuse_differences(
        model,
        differences,
        "an HF DeepSeek-V2 scales its chosen experts' weights without renormalising them or "
        "a balancing bias, and rotates neighbouring features",
    )
    grouped = model.router_groups > 1
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        **deepseek_v3.latent_json(model),
        "topk_method": "group_limited_greedy" if grouped else "greedy",
        "n_group": model.router_groups if grouped else None,
        "topk_group": (model.router_top_groups or model.router_groups) if grouped else None,
        "mlp_bias": False,
    }


def is_deepseek_v2(model: LanguageModelConfig) -> bool:
    """A llama section with multi-head latent attention and softmax routing."""
    return model.name == "llama" and bool(model.kv_latent_width) and model.router == "softmax"


FAMILY = Family(
    hf_type="deepseek_v2",
    architecture="DeepseekV2ForCausalLM",
    model=deepseek_v3.FAMILY.model,
    zoo_name="llama",
    tensors=tensors,
    from_hf=config_from_hf,
    to_hf=to_hf,
    holds=is_deepseek_v2,
    configs=("deepseek_v2_lite_16b",),
)
