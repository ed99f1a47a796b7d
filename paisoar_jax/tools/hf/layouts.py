"""The Hugging Face forms of our decoders: each tensor's name and layout, and config.json.

GPT-2 (GPT2LMHeadModel), Llama (LlamaForCausalLM; a Mistral imports as one), Mixtral (a
Llama whose MLPs are experts, model.experts > 0), Qwen2 (biased queries, keys and values,
model.qkv_bias), Qwen3 (normed heads, model.qk_norm) and Qwen3-MoE. `tensors_of(model)`
lists a model's `Tensor`s: our dotted parameter path, HF's name ({i}: the layer, {j}: the
expert) and the conversions each way (HF's Linear stores out x in, GPT-2's Conv1D in x out;
our kernels are in x out with heads as their own axis). `model_config_from_hf` and
`hf_config` map config.json to our model section and back, refusing in one line what the
other side cannot hold.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

import numpy as np

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.errors import UserError

ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# HF model_type -> model.name: Mistral is a Llama; Mixtral, Qwen2 and Qwen3 are Llamas with
# experts, biased queries, keys and values, or heads normed.
LLAMA_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")
FAMILY = {"gpt2": "gpt"} | dict.fromkeys(LLAMA_TYPES, "llama")
Convert = Callable[[np.ndarray, LanguageModelConfig], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter: our dotted path, HF's name, and the two conversions.

    In HF's name {i} is the layer and {j} the expert; the conversions take one HF tensor
    (a layer's, or a layer's expert's).
    """

    ours: str
    theirs: str
    to_ours: Convert = lambda array, config: array  # noqa: E731
    to_theirs: Convert = lambda array, config: array  # noqa: E731


def _heads(config: LanguageModelConfig) -> tuple[int, int, int, int]:
    """(D, H, K, E): width, query heads, key/value heads, head width."""
    return config.width, config.heads, config.key_value_heads, config.width // config.heads


def _linear_in_heads(kind: str) -> Tensor:
    """An HF Linear (heads x E, D) as our D x heads x E kernel; `kind` q, k or v."""
    count = (lambda config: _heads(config)[1]) if kind == "q" else (lambda c: _heads(c)[2])
    return Tensor(
        f"blocks.{kind}_kernel",
        f"model.layers.{{i}}.self_attn.{kind}_proj.weight",
        lambda array, config: array.T.reshape(config.width, count(config), -1),
        lambda array, config: array.reshape(config.width, -1).T,
    )


def _transposed(ours: str, theirs: str) -> Tensor:
    return Tensor(ours, theirs, lambda array, config: array.T, lambda array, config: array.T)


LLAMA = (
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
    _transposed("head", "lm_head.weight"),
)
LLAMA_MLP = (
    _transposed("blocks.gate_kernel", "model.layers.{i}.mlp.gate_proj.weight"),
    _transposed("blocks.up_kernel", "model.layers.{i}.mlp.up_proj.weight"),
    _transposed("blocks.down_kernel", "model.layers.{i}.mlp.down_proj.weight"),
)


def _expert(ours: str, weight: str) -> Tensor:
    """One of Mixtral's expert matrices (w1 gate, w3 up, w2 down), an (out, in) Linear each."""
    moe = "model.layers.{i}.block_sparse_moe"
    return _transposed(f"blocks.moe.{ours}", f"{moe}.experts.{{j}}.{weight}.weight")


# Mixtral's router and experts, as transformers (4.x and 5.x alike) saves them.
MIXTRAL_EXPERTS = (
    _transposed("blocks.moe.router_kernel", "model.layers.{i}.block_sparse_moe.gate.weight"),
    _expert("gate_kernel", "w1"),
    _expert("up_kernel", "w3"),
    _expert("down_kernel", "w2"),
)
# Qwen3-MoE's: a Llama MLP per expert.
QWEN3_EXPERTS = (
    _transposed("blocks.moe.router_kernel", "model.layers.{i}.mlp.gate.weight"),
    _transposed("blocks.moe.gate_kernel", "model.layers.{i}.mlp.experts.{j}.gate_proj.weight"),
    _transposed("blocks.moe.up_kernel", "model.layers.{i}.mlp.experts.{j}.up_proj.weight"),
    _transposed("blocks.moe.down_kernel", "model.layers.{i}.mlp.experts.{j}.down_proj.weight"),
)
# Qwen2's biases of the query, key and value projections (one per head and feature).
QKV_BIASES = tuple(
    Tensor(
        f"blocks.{kind}_bias",
        f"model.layers.{{i}}.self_attn.{kind}_proj.bias",
        lambda array, config: array.reshape(-1, config.head_size),
        lambda array, config: array.reshape(-1),
    )
    for kind in ("q", "k", "v")
)
# Qwen3's norms of each head's queries and keys.
QK_NORMS = (
    Tensor("blocks.q_norm.scale", "model.layers.{i}.self_attn.q_norm.weight"),
    Tensor("blocks.k_norm.scale", "model.layers.{i}.self_attn.k_norm.weight"),
)


def _split_qkv(array, config):
    return array.reshape(*array.shape[:-1], 3, config.heads, -1)


def _norm(ours: str, theirs: str) -> tuple[Tensor, Tensor]:
    return Tensor(f"{ours}.scale", f"{theirs}.weight"), Tensor(f"{ours}.bias", f"{theirs}.bias")


GPT2 = (
    Tensor("token_embedding", "transformer.wte.weight"),
    Tensor("position_embedding", "transformer.wpe.weight"),
    *_norm("blocks.attention_norm", "transformer.h.{i}.ln_1"),
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
    *_norm("blocks.mlp_norm", "transformer.h.{i}.ln_2"),
    Tensor("blocks.mlp_in_kernel", "transformer.h.{i}.mlp.c_fc.weight"),
    Tensor("blocks.mlp_in_bias", "transformer.h.{i}.mlp.c_fc.bias"),
    Tensor("blocks.mlp_out_kernel", "transformer.h.{i}.mlp.c_proj.weight"),
    Tensor("blocks.mlp_out_bias", "transformer.h.{i}.mlp.c_proj.bias"),
    *_norm("final_norm", "transformer.ln_f"),
    _transposed("head", "lm_head.weight"),  # untied embeddings only
)
# The training window (model.seq_len) an import starts with, at most; the model keeps all
# its positions (model.max_positions), which the export writes back.
MAX_TRAINING_WINDOW = 2048


def tensors_of(model: LanguageModelConfig) -> tuple[Tensor, ...]:
    """Every tensor of the HF form of `model`: GPT-2's, Llama's, or Mixtral's."""
    if model.name == "gpt":
        return GPT2
    mlp = {"mixtral": MIXTRAL_EXPERTS, "qwen3_moe": QWEN3_EXPERTS}.get(hf_type(model), LLAMA_MLP)
    biases = QKV_BIASES if model.qkv_bias else ()
    return LLAMA + biases + (QK_NORMS if model.qk_norm else ()) + mlp


def hf_type(model: LanguageModelConfig) -> str:
    """The HF model_type of our model section: gpt2, llama, mixtral, qwen2, qwen3 or qwen3_moe.

    A llama with biased queries, keys and values is a Qwen2; with its heads' queries and
    keys normed a Qwen3, with experts too a Qwen3-MoE. With experts alone it is a Mixtral.
    (A Mistral is a Llama: it exports as one, which transformers reads the same.)
    """
    if model.name == "gpt":
        return "gpt2"
    if model.qkv_bias:
        if model.qk_norm or model.experts:
            raise UserError(
                "no Hugging Face architecture has biased queries, keys and values "
                "(model.qkv_bias, Qwen2's) with model.qk_norm or model.experts"
            )
        return "qwen2"
    if model.qk_norm:
        return "qwen3_moe" if model.experts else "qwen3"
    return "mixtral" if model.experts else "llama"


def _gpt2_config(hf: dict, where: pathlib.Path) -> LanguageModelConfig:
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


def _rope_scaling(rope: dict, where: pathlib.Path) -> dict:
    """The model keys of HF's rope_parameters (or rope_scaling): {} or Llama-3's four."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise UserError(f"{where}: rope type {rope_type!r} is not default or llama3")
    if rope_type != "llama3":
        return {}
    return dict(
        rope_scaling="llama3",
        rope_factor=float(rope["factor"]),
        rope_low_freq_factor=float(rope["low_freq_factor"]),
        rope_high_freq_factor=float(rope["high_freq_factor"]),
        rope_original_length=int(rope["original_max_position_embeddings"]),
    )


def model_config_from_hf(hf: dict, where: pathlib.Path) -> LanguageModelConfig:
    """Our model section for the config.json of an architecture in ARCHITECTURES.

    Any other is one line naming those that import; one without a setting its architecture
    has (a truncated or hand-made file) is one line naming the setting.
    """
    try:
        return _model_config(hf, where)
    except KeyError as error:
        raise UserError(
            f"{where} has no {error.args[0]!r}, which a {hf.get('model_type')} config.json "
            f"holds: not a whole transformers config (truncated or edited?)"
        ) from None


def _model_config(hf: dict, where: pathlib.Path) -> LanguageModelConfig:
    """model_config_from_hf, with the settings read as hf[key]."""
    model_type = hf.get("model_type")
    if model_type not in FAMILY:
        found = hf.get("architectures") or [model_type]
        known = sorted(ARCHITECTURES.values())
        raise UserError(
            f"{where}: {', '.join(map(str, found))} is not an architecture this imports "
            f"({', '.join(known[:-1])} or {known[-1]})"
        )
    if model_type == "gpt2":
        return _gpt2_config(hf, where)
    width, heads = hf["hidden_size"], hf["num_attention_heads"]
    windowed = hf.get("use_sliding_window", hf.get("sliding_window") is not None)
    refused = {
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        # (Qwen2's are on q, k and v alone, always: model.qkv_bias; a Llama's on o too)
        "attention_bias": model_type != "qwen2" and hf.get("attention_bias", False),
        "mlp_bias": hf.get("mlp_bias", False),
        "sliding_window": windowed,  # every layer attends to all the window
        "decoder_sparse_step": hf.get("decoder_sparse_step", 1) != 1,  # Qwen3-MoE's
        "mlp_only_layers": bool(hf.get("mlp_only_layers")),
    }
    for key, bad in refused.items():
        if bad:
            raise UserError(f"{where}: {key}={hf[key]} is not a Llama this model reads")
    head_width = hf.get("head_dim") or width // heads
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    scaling = _rope_scaling(rope, where)
    return LanguageModelConfig(
        name="llama",
        vocab_size=hf["vocab_size"],
        seq_len=min(hf.get("max_position_embeddings", 2048), MAX_TRAINING_WINDOW),
        max_positions=hf.get("max_position_embeddings", 2048),
        layers=hf["num_hidden_layers"],
        width=width,
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        mlp_width=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        head_width=0 if head_width * heads == width else head_width,
        qk_norm=hf["model_type"] in ("qwen3", "qwen3_moe"),
        qkv_bias=hf["model_type"] == "qwen2",
        **scaling,
        **_experts_from_hf(hf),
    )


def _experts_from_hf(hf: dict) -> dict:
    """The MoE keys of a Mixtral's or Qwen3-MoE's config.json ({} for the others).

    Both route dropless, softmax top-k; Mixtral renormalises the chosen weights always,
    Qwen3-MoE where norm_topk_prob says so, and its experts have their own width.
    """
    if hf["model_type"] not in ("mixtral", "qwen3_moe"):
        return {}
    keys = dict(
        experts=hf.get("num_local_experts") or hf["num_experts"],  # Qwen3-MoE: 4.x's name
        experts_per_token=hf["num_experts_per_tok"],
        router_aux_loss=float(hf.get("router_aux_loss_coef", 0.02)),
    )
    if hf["model_type"] == "qwen3_moe":
        keys |= dict(
            expert_mlp_width=hf["moe_intermediate_size"],
            router_renormalize=bool(hf.get("norm_topk_prob", False)),
        )
    return keys


def _variant_json(model: LanguageModelConfig) -> dict:
    """What a Mixtral, Qwen3 or Qwen3-MoE adds to (or changes in) a Llama's config.json."""
    variant = hf_type(model)
    if variant == "llama":
        return {}
    settings = {
        "architectures": [ARCHITECTURES[variant]],
        "model_type": variant,
        "sliding_window": None,
    }
    if variant == "mixtral":
        return settings | _mixtral_experts(model)
    settings["use_sliding_window"] = False
    if variant == "qwen2":
        return settings | {"max_window_layers": model.layers, "attention_bias": None}
    if variant == "qwen3":
        return settings
    _check_routing(model, "Qwen3-MoE", renormalized=model.router_renormalize)
    return settings | {
        "num_experts": model.experts,  # transformers 4.x's name
        "num_local_experts": model.experts,  # 5.x's
        "num_experts_per_tok": model.experts_per_token,
        "moe_intermediate_size": model.expert_width,
        "norm_topk_prob": model.router_renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": model.router_aux_loss,
    }


def _check_routing(model: LanguageModelConfig, name: str, renormalized: bool) -> None:
    """HF's MoE routes softmax top-k on every layer, with no shared experts: refuses others."""
    differences = {
        "model.router": model.router != "softmax",
        "model.router_renormalize": model.router_renormalize != renormalized,
        "model.shared_experts": model.shared_experts != 0,
        "model.moe_every": model.moe_every != 1,
    }
    for key, differs in differences.items():
        if differs:
            value = getattr(model, key.removeprefix("model."))
            renormalizes = " (and renormalises the chosen)" if name == "Mixtral" else ""
            raise UserError(
                f"an HF {name} routes softmax top-k{renormalizes} on every layer with no "
                f"shared experts: this model has {key}={value}"
            )


def _mixtral_experts(model: LanguageModelConfig) -> dict:
    """A MixtralForCausalLM's expert keys, once HF's Mixtral can hold `model`'s experts."""
    _check_routing(model, "Mixtral", renormalized=True)
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


def hf_config(model: LanguageModelConfig) -> dict:
    """The config.json transformers reads for our model section."""
    if model.name == "gpt":
        if model.position != "learned":
            raise UserError(
                f"an HF GPT-2 has learned positions: this model has model.position={model.position}"
            )
        return {
            "architectures": [ARCHITECTURES["gpt2"]],
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
    rope_scaling = None
    if model.rope_scaling == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": model.rope_factor,
            "low_freq_factor": model.rope_low_freq_factor,
            "high_freq_factor": model.rope_high_freq_factor,
            "original_max_position_embeddings": model.rope_original_length,
        }
    return {
        "architectures": [ARCHITECTURES["llama"]],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "max_position_embeddings": (
            model.positions
            if model.rope_scaling == "none"
            else max(model.positions, model.rope_original_length)
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
    } | _variant_json(model)
