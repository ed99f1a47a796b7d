"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention over a mixture of experts.

Softmax top-k routing (the chosen weights renormalised where norm_topk_prob says so),
experts of their own width (moe_intermediate_size), a Llama MLP each. decoder_sparse_step
> 1 puts the experts on every n-th layer and a dense MLP (intermediate_size) on the others:
model.moe_every, the blocks unrolled (model.scan_layers=false).
"""

from __future__ import annotations

import dataclasses

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.errors import UserError
from paisoar_jax.models.families import llama, qwen3
from paisoar_jax.models.families.family import transposed


def on_experts(model: LanguageModelConfig, layer: int) -> bool:
    """Whether block `layer` has experts (a table's tensor of the experts is there)."""
    return model.is_moe_layer(layer)


def on_dense(model: LanguageModelConfig, layer: int) -> bool:
    """Whether block `layer` has a dense MLP (between or before the experts)."""
    return not model.is_moe_layer(layer)


EXPERTS = tuple(
    dataclasses.replace(tensor, on_layer=on_experts)
    for tensor in (
        transposed("blocks.moe.router_kernel", "model.layers.{i}.mlp.gate.weight"),
        transposed("blocks.moe.gate_kernel", "model.layers.{i}.mlp.experts.{j}.gate_proj.weight"),
        transposed("blocks.moe.up_kernel", "model.layers.{i}.mlp.experts.{j}.up_proj.weight"),
        transposed("blocks.moe.down_kernel", "model.layers.{i}.mlp.experts.{j}.down_proj.weight"),
    )
)
# The dense layers between (decoder_sparse_step > 1): a Llama MLP at those layers only.
DENSE = tuple(dataclasses.replace(tensor, on_layer=on_dense) for tensor in llama.MLP)


def _keys(hf: dict) -> dict:
    """Qwen3's normed queries and keys, and our MoE keys of its experts."""
    if hf.get("mlp_only_layers"):
        raise UserError(
            f"mlp_only_layers={hf['mlp_only_layers']} is not a Qwen3-MoE this model reads "
            "(dense layers between the experts come every decoder_sparse_step-th)"
        )
    step = hf.get("decoder_sparse_step") or 1
    between = {"moe_every": step, "scan_layers": False} if step > 1 else {}
    return between | dict(
        qk_norm=True,
        experts=hf.get("num_local_experts") or hf["num_experts"],  # 5.x's name, then 4.x's
        experts_per_token=hf["num_experts_per_tok"],
        router_aux_loss=float(hf.get("router_aux_loss_coef", 0.02)),
        expert_mlp_width=hf["moe_intermediate_size"],
        router_renormalize=bool(hf.get("norm_topk_prob", False)),
    )


def _json(model: LanguageModelConfig) -> dict:
    """Qwen3-MoE's expert keys, once its routing is HF's."""
    llama.check_routing(
        model, "Qwen3-MoE", renormalized=model.router_renormalize, dense_between=True
    )
    return {
        "use_sliding_window": False,
        "num_experts": model.experts,  # transformers 4.x's name
        "num_local_experts": model.experts,  # 5.x's
        "num_experts_per_tok": model.experts_per_token,
        "moe_intermediate_size": model.expert_width,
        "norm_topk_prob": model.router_renormalize,
        "decoder_sparse_step": model.moe_every,
        "mlp_only_layers": [],
        "router_aux_loss_coef": model.router_aux_loss,
    }


FAMILY = llama.variant(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    keys=_keys,
    json=_json,
    tensors=lambda model: llama.ATTENTION + qwen3.QK_NORMS + EXPERTS + DENSE,
    holds=lambda model: model.name == "llama" and model.qk_norm and bool(model.experts),
    configs=("qwen3_30b_a3b",),
)
