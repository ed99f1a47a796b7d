"""Mixtral (MixtralForCausalLM): a Llama whose MLPs are experts (model.experts > 0).

Softmax top-k routing, the chosen weights renormalised, every layer a mixture of experts as
wide as the dense MLP would be (models/moe.py); transformers (4.x and 5.x alike) saves each
expert's w1 (gate), w3 (up) and w2 (down) as Linears.
"""

from __future__ import annotations

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.errors import UserError
from paisoar_jax.models.families import llama
from paisoar_jax.models.families.family import Tensor, transposed


def _expert(ours: str, weight: str) -> Tensor:
    """One expert matrix (w1 gate, w3 up, w2 down), an (out, in) Linear each."""
    moe = "model.layers.{i}.block_sparse_moe"
    return transposed(f"blocks.moe.{ours}", f"{moe}.experts.{{j}}.{weight}.weight")


EXPERTS = (
    transposed("blocks.moe.router_kernel", "model.layers.{i}.block_sparse_moe.gate.weight"),
    _expert("gate_kernel", "w1"),
    _expert("up_kernel", "w3"),
    _expert("down_kernel", "w2"),
)


def _keys(hf: dict) -> dict:
    """Our MoE keys of a Mixtral's config.json."""
    return dict(
        experts=hf["num_local_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        router_aux_loss=float(hf.get("router_aux_loss_coef", 0.02)),
    )


def _json(model: LanguageModelConfig) -> dict:
    """Mixtral's expert keys, once its experts are Mixtral's."""
    llama.check_routing(model, "Mixtral", renormalized=True)
    if model.expert_mlp_width not in (0, model.mlp_width):
        raise UserError(
            f"an HF Mixtral's experts are model.mlp_width={model.mlp_width} wide: this model "
            f"has model.expert_mlp_width={model.expert_mlp_width}"
        )
    return {
        "num_local_experts": model.experts,
        "num_experts_per_tok": model.experts_per_token,
        "router_aux_loss_coef": model.router_aux_loss,
    }


FAMILY = llama.variant(
    "mixtral",
    "MixtralForCausalLM",
    keys=_keys,
    json=_json,
    tensors=lambda model: llama.ATTENTION + EXPERTS,
    holds=lambda model: model.name == "llama" and bool(model.experts) and not model.qk_norm,
    configs=("moe_tiny", "mixtral_8x7b"),
)
