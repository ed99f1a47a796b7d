"""A Llama-family decoder in Flax NNX: RMSNorm, SwiGLU, rotary positions, grouped-query attention.

The same math as Hugging Face's LlamaForCausalLM, so its checkpoints load as they are
(paisoar_jax/models/families/): rotary positions rotate the two halves of each head (HF's
`rotate_half`, models/rotary.py), with HF's `rope_theta` and its scalings; no biases;
embeddings tied or not. Its options make the other families' blocks (Qwen's biases and
head norms, experts, Gemma's norms, GeGLU and sliding windows). Attention
(models/attention.py), scan over stacked blocks, remat and fp8 matmuls are GPT's
(models/gpt.py). Every parameter carries logical axis names:
tensor parallelism splits the query heads and the key/value heads. Shape suffixes: B batch,
T time, D width, H query heads, K key/value heads, E head width, F MLP width, V vocab.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.errors import UserError
from paisoar_jax.models.attention import resolve_attention
from paisoar_jax.models.gpt import (
    Decoder,
    DecoderBlock,
    experts_of,
    mlp_width,
)
from paisoar_jax.models.latent import LatentAttention
from paisoar_jax.models.layers import gated_activation, norm_of, param
from paisoar_jax.models.rotary import halves_tables, rotate_halves
from paisoar_jax.numerics import fp8
from paisoar_jax.numerics.precision import Policy
from paisoar_jax.numerics.remat import recomputed_activation
from paisoar_jax.parallel.sharding import constrain

MATMULS = ("q", "k", "v", "out", "gate", "up", "down")  # each keeps its own fp8 scales
ATTENTION_MATMULS = MATMULS[:4]  # with experts as the MLP: theirs run in bf16


class Block(DecoderBlock):
    """x + attention(rmsnorm(x)), then x + down(silu(gate(h)) * up(h)) with h = rmsnorm(x).

    With experts (model.experts: Mixtral, Qwen3-MoE), they take the SwiGLU MLP's place.
    Gemma's options: a sliding window on some blocks (model.sliding_window, global_every)
    with their own rotary base, RMSNorms on the attention's and MLP's outputs too
    (post_norms), GeGLU (mlp_activation), queries scaled by query_scale_width.
    """

    LORA_KERNELS = {
        **{f"{name}_kernel": 1 for name in ("q", "k", "v", "gate", "up", "down")},
        "out_kernel": 2,
    }
    # lora.targets may name them as PEFT does (target_modules: transformers' module names).
    PEFT_NAMES = {
        **{f"{name}_proj": (f"{name}_kernel",) for name in ("q", "k", "v", "gate", "up", "down")},
        "o_proj": ("out_kernel",),
    }

    MATMULS = MATMULS  # each its own fp8 scales: the dense block's, then with experts
    ATTENTION_MATMULS = ATTENTION_MATMULS

    def __init__(self, config: LanguageModelConfig, policy: Policy, rngs: nnx.Rngs, layer: int):
        D, F = config.width, mlp_width(config)
        normal = nnx.initializers.normal(config.init_std)
        residual = nnx.initializers.normal(config.init_std / math.sqrt(2 * config.layers))
        norm = norm_of(config)
        self.policy = policy
        self.attention_impl = resolve_attention(config.attention, policy, config.query_head_size)
        self.context = config.context_attention  # gather or ring, with mesh.context > 1
        self.window = config.window_of(layer)  # 0: every earlier token
        self.activation = config.mlp_activation
        # Queries scaled so that attention's own 1 / sqrt(E) makes 1 / sqrt(query_scale_width):
        # every attention path (cuDNN, context-parallel, cached) then stays as it is.
        E = config.query_head_size
        self.query_scale = math.sqrt(E / (config.query_scale_width or E))
        self.attention_norm = norm(D, config.norm_eps, rngs)
        self._build_attention(config, rngs, normal, residual)
        if config.post_norms:  # Gemma 2 and 3: the outputs normed before they join the stream
            self.post_attention_norm = norm(D, config.norm_eps, rngs)
            self.post_mlp_norm = norm(D, config.norm_eps, rngs)
        self.mlp_norm = norm(D, config.norm_eps, rngs)
        self.moe = experts_of(config, policy, rngs, layer)
        if self.moe is None:
            self.gate_kernel = param(rngs, normal, (D, F), ("embed", "mlp"))
            self.up_kernel = param(rngs, normal, (D, F), ("embed", "mlp"))
            self.down_kernel = param(rngs, residual, (F, D), ("mlp", "embed"))
        dots = self.ATTENTION_MATMULS if self.moe is not None else self.MATMULS
        self.fp8 = fp8.block_dots(policy, dots)

    def _build_attention(self, config: LanguageModelConfig, rngs: nnx.Rngs, normal, residual):
        """The attention's projections (and their biases, head norms and sinks)."""
        D, H, K, E = config.width, config.heads, config.key_value_heads, config.head_size
        norm = norm_of(config)
        self.q_kernel = param(rngs, normal, (D, H, E), ("embed", "heads", "head_dim"))
        self.k_kernel = param(rngs, normal, (D, K, E), ("embed", "kv_heads", "head_dim"))
        self.v_kernel = param(rngs, normal, (D, K, E), ("embed", "kv_heads", "head_dim"))
        self.out_kernel = param(rngs, residual, (H, E, D), ("heads", "head_dim", "embed"))
        if config.qkv_bias:  # Qwen2: the query, key and value projections have biases
            self.q_bias = param(rngs, nnx.initializers.zeros, (H, E), ("heads", "head_dim"))
            self.k_bias = param(rngs, nnx.initializers.zeros, (K, E), ("kv_heads", "head_dim"))
            self.v_bias = param(rngs, nnx.initializers.zeros, (K, E), ("kv_heads", "head_dim"))
        if config.out_bias:  # GPT-OSS: the output projection has a bias too
            self.out_bias = param(rngs, nnx.initializers.zeros, (D,), ("embed",))
        if config.attention_sinks:  # GPT-OSS: a logit per head that attends to nothing
            self.sinks = param(rngs, nnx.initializers.zeros, (H,), ("heads",))
        if config.qk_norm:  # Qwen3: each head's queries and keys normed, before the rotation
            self.q_norm = norm(E, config.norm_eps, rngs, axis="head_dim")
            self.k_norm = norm(E, config.norm_eps, rngs, axis="head_dim")

    def _queries_keys_values(self, x_BxTxD: jax.Array, rotary: tuple) -> tuple:
        h_BxTxD = self.policy.cast_to_compute(self.attention_norm(x_BxTxD))
        heads = ("batch", "length", "act_heads", "head_dim")
        q_BxTxHxE = constrain(self._project("btd,dhe->bthe", h_BxTxD, "q_kernel", "q"), heads)
        k_BxTxKxE = constrain(self._project("btd,dke->btke", h_BxTxD, "k_kernel", "k"), heads)
        v_BxTxKxE = constrain(self._project("btd,dke->btke", h_BxTxD, "v_kernel", "v"), heads)
        if hasattr(self, "q_bias"):
            cast = self.policy.cast_to_compute
            q_BxTxHxE = q_BxTxHxE + cast(self.q_bias[...])
            k_BxTxKxE = k_BxTxKxE + cast(self.k_bias[...])
            v_BxTxKxE = v_BxTxKxE + cast(self.v_bias[...])
        if hasattr(self, "q_norm"):
            q_BxTxHxE = self.policy.cast_to_compute(self.q_norm(q_BxTxHxE))
            k_BxTxKxE = self.policy.cast_to_compute(self.k_norm(k_BxTxKxE))
        if self.query_scale != 1.0:
            q_BxTxHxE = q_BxTxHxE * jnp.asarray(self.query_scale, q_BxTxHxE.dtype)
        global_tables, local_tables = rotary
        tables = local_tables if self.window and local_tables is not None else global_tables
        return rotate_halves(q_BxTxHxE, *tables), rotate_halves(k_BxTxKxE, *tables), v_BxTxKxE

    def _after_attention(self, x_BxTxD: jax.Array, attention_BxTxHxE: jax.Array) -> tuple:
        attention_BxTxHxE = checkpoint_name(attention_BxTxHxE, "attention_out")
        cast = self.policy.cast_to_compute
        out_BxTxD = self._project("bthe,hed->btd", attention_BxTxHxE, "out_kernel", "out")
        if hasattr(self, "out_bias"):
            out_BxTxD = out_BxTxD + cast(self.out_bias[...])
        if hasattr(self, "post_attention_norm"):
            out_BxTxD = cast(self.post_attention_norm(out_BxTxD))
        x_BxTxD = constrain(x_BxTxD + out_BxTxD, ("batch", "length", "act_embed"))
        out_BxTxD, statistics = self._feed_forward(cast(self.mlp_norm(x_BxTxD)))
        if hasattr(self, "post_mlp_norm"):
            out_BxTxD = cast(self.post_mlp_norm(out_BxTxD))
        return constrain(x_BxTxD + out_BxTxD, ("batch", "length", "act_embed")), statistics

    def _mlp(self, h_BxTxD: jax.Array) -> jax.Array:
        gate_BxTxF = self._project("btd,df->btf", h_BxTxD, "gate_kernel", "gate")
        up_BxTxF = self._project("btd,df->btf", h_BxTxD, "up_kernel", "up")
        hidden_BxTxF = recomputed_activation(
            gated_activation(self.activation), gate_BxTxF, up_BxTxF
        )
        hidden_BxTxF = constrain(hidden_BxTxF, ("batch", "length", "act_mlp"))
        hidden_BxTxF = checkpoint_name(hidden_BxTxF, "mlp_hidden")
        return self._project("btf,fd->btd", hidden_BxTxF, "down_kernel", "down")


class LatentBlock(LatentAttention, Block):
    """A llama block whose attention is multi-head latent attention (model.kv_latent_width)."""


class Llama(Decoder):
    """Decoder-only Llama language model returning logits (B x T x V), fp32 by default."""

    def __init__(
        self, config: LanguageModelConfig, policy: Policy, remat_policy: str, rngs: nnx.Rngs
    ):
        _check_tensor_split(config)
        block_class = LatentBlock if config.kv_latent_width else Block
        self._build(config, policy, remat_policy, rngs, block_class, norm_of(config))

    def _embed(
        self, tokens_BxT: jax.Array, start, positions_BxT: jax.Array | None = None
    ) -> tuple[jax.Array, tuple]:
        """The tokens' embeddings, and the rotary tables of positions start.."""
        del positions_BxT  # rotary positions only: the blocks make them (rotary_function)
        x_BxTxD = self._token_embeddings(tokens_BxT)
        if self.config.embed_scale:  # Gemma: sqrt(width) in the compute dtype, as HF rounds it
            x_BxTxD = x_BxTxD * jnp.asarray(math.sqrt(self.config.width), x_BxTxD.dtype)
        rotary = halves_tables(self.config, start + jnp.arange(tokens_BxT.shape[1]))
        return constrain(x_BxTxD, ("batch", "length", "act_embed")), rotary

    def rotary_function(self) -> Callable:
        """Maps positions to their (sin, cos) rotary tables (HF's, with the scaling)."""
        return functools.partial(halves_tables, self.config)


def _check_tensor_split(config: LanguageModelConfig) -> None:
    """Tensor parallelism splits the kv heads: their count must divide by mesh.tensor.

    A sliding window or attention sinks are refused with the sequence split over
    mesh.context (its attention reaches every earlier token and has no sink).
    """
    mesh = jax.sharding.get_abstract_mesh()
    tensor = 1 if mesh.empty else dict(mesh.shape).get("tensor", 1)
    context = 1 if mesh.empty else dict(mesh.shape).get("context", 1)
    if config.sliding_window and context > 1:
        raise UserError(
            f"model.sliding_window={config.sliding_window} with mesh.context > 1 is not "
            "supported yet: context-parallel attention reaches every earlier token (use "
            "mesh.context=1)"
        )
    if config.kv_latent_width and context > 1:
        raise UserError(
            "model.kv_latent_width (multi-head latent attention) with mesh.context > 1 is not "
            "supported yet: its keys are wider than its values (use mesh.context=1)"
        )
    if config.attention_sinks and context > 1:
        raise UserError(
            "model.attention_sinks with mesh.context > 1 is not supported yet: "
            "context-parallel attention has no sink logit (use mesh.context=1)"
        )
    if config.key_value_heads % tensor:
        raise UserError(
            f"model.kv_heads={config.key_value_heads} is not divisible by mesh.tensor={tensor}: "
            f"tensor parallelism splits the key/value heads (use a tensor size that divides it)"
        )
