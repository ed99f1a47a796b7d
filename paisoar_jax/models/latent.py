"""Multi-head latent attention (DeepSeek-V2 and V3's MLA): the llama block's other attention.

Keys and values are made from one small latent of the stream (model.kv_latent_width, HF's
kv_lora_rank), normed, then widened per head; the queries likewise through a latent of
their own where model.q_latent_width is set (q_lora_rank). Each query and key head has an
unrotated part (model.head_width, qk_nope_head_dim) and a rotated one (rope_head_width,
qk_rope_head_dim): the keys' rotated part comes straight from the stream and is one for
every head. The values have a width of their own (value_head_width, v_head_dim). What
follows the projections is the llama block's (models/llama.py makes its LatentBlock of
this): the same attention (models/attention.py), its output projection, norms and MLP or
experts. The rotation pairs neighbouring features (model.rope_interleave, DeepSeek's) or
the halves.

The HF tensors are kept fused as HF stores them (kv_a_proj_with_mqa holds the latent and the
shared rotated key; kv_b_proj every head's key and value parts), so an import is a
transpose and a reshape. At generation the cache holds each position's latent and rotated
key (R + P numbers, not H x (N + P + W)), widened again at each step. Shape suffixes as
llama.py's, with R the kv latent's width, Q the query latent's, N a head's unrotated
part, P its rotated part, W a value head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.models.decoding import cached_attention
from paisoar_jax.models.layers import RMSNorm, param
from paisoar_jax.models.rotary import rotate_halves, rotate_pairs
from paisoar_jax.parallel.sharding import constrain

# HF's latent norms keep their own epsilon (DeepseekV3RMSNorm's default), not rms_norm_eps.
LATENT_NORM_EPSILON = 1e-6


class LatentAttention:
    """Multi-head latent attention's projections, for the llama block (models/llama.py).

    A mixin: llama.py's LatentBlock is this over its Block, whose norms, `_project`, policy
    and query scale these methods use, and whose attention and MLP follow them.
    """

    MATMULS = ("q", "q_up", "kv_down", "kv_up", "out", "gate", "up", "down")
    ATTENTION_MATMULS = MATMULS[:5]
    LORA_KERNELS = {
        **{f"{name}_kernel": 1 for name in ("q", "q_up", "kv_down", "kv_up")},
        **{f"{name}_kernel": 1 for name in ("gate", "up", "down")},
        "out_kernel": 2,
    }
    PEFT_NAMES = {
        "q_proj": ("q_kernel",),
        "q_a_proj": ("q_kernel",),
        "q_b_proj": ("q_up_kernel",),
        "kv_a_proj_with_mqa": ("kv_down_kernel",),
        "kv_b_proj": ("kv_up_kernel",),
        "o_proj": ("out_kernel",),
        **{f"{name}_proj": (f"{name}_kernel",) for name in ("gate", "up", "down")},
    }

    def _build_attention(self, config: LanguageModelConfig, rngs: nnx.Rngs, normal, residual):
        """The latent projections: the query's (or its direct one), the keys' and values'."""
        D, H, R, Q = config.width, config.heads, config.kv_latent_width, config.q_latent_width
        N, P, W = config.head_size, config.rope_head_width, config.value_head_size
        self.rope_width, self.value_width, self.interleave = P, W, config.rope_interleave
        if Q:  # q_a_proj, its norm, then q_b_proj to every head
            self.q_kernel = param(rngs, normal, (D, Q), ("embed", "latent"))
            self.q_latent_norm = RMSNorm(Q, LATENT_NORM_EPSILON, rngs, axis="latent")
            self.q_up_kernel = param(rngs, normal, (Q, H, N + P), ("latent", "heads", "head_dim"))
        else:  # q_proj
            self.q_kernel = param(rngs, normal, (D, H, N + P), ("embed", "heads", "head_dim"))
        # kv_a_proj_with_mqa: the latent, then the rotated key every head shares
        self.kv_down_kernel = param(rngs, normal, (D, R + P), ("embed", "latent"))
        self.kv_latent_norm = RMSNorm(R, LATENT_NORM_EPSILON, rngs, axis="latent")
        # kv_b_proj: each head's unrotated key, then its value
        self.kv_up_kernel = param(rngs, normal, (R, H, N + W), ("latent", "heads", "head_dim"))
        self.out_kernel = param(rngs, residual, (H, W, D), ("heads", "head_dim", "embed"))

    def _queries_keys_values(self, x_BxTxD: jax.Array, rotary: tuple) -> tuple:
        q_BxTxHxE, latent_BxTxR, k_rope_BxTx1xP = self._latent_parts(x_BxTxD, rotary)
        k_BxTxHxE, v_BxTxHxW = self._widened(latent_BxTxR, k_rope_BxTx1xP)
        return q_BxTxHxE, k_BxTxHxE, v_BxTxHxW

    def decode(self, x_BxTxD, rotary, cache, index, starts_B=None) -> tuple[jax.Array, tuple]:
        """The block at positions index.., its cache the latents and rotated keys (L x R, P).

        Each step widens every cached position's latent into its keys and values (the
        latent is what is held: R + P numbers a position, not H x (N + P + W)).
        """
        q_BxTxHxE, latent_BxTxR, k_rope_BxTx1xP = self._latent_parts(x_BxTxD, rotary)
        latents_BxSx1xR, rotated_BxSx1xP = (
            jax.lax.dynamic_update_slice_in_dim(held, new[:, :, None].astype(held.dtype), index, 1)
            for held, new in ((cache[0], latent_BxTxR), (cache[1], k_rope_BxTx1xP[:, :, 0]))
        )
        keys_BxSxHxE, values_BxSxHxW = self._widened(
            latents_BxSx1xR[:, :, 0].astype(latent_BxTxR.dtype),
            rotated_BxSx1xP.astype(latent_BxTxR.dtype),
        )
        T = q_BxTxHxE.shape[1]
        k_BxTxHxE, v_BxTxHxW = (
            jax.lax.dynamic_slice_in_dim(array, index, T, axis=1)
            for array in (keys_BxSxHxE, values_BxSxHxW)
        )
        widened = (keys_BxSxHxE, values_BxSxHxW)  # (writing its own T again changes nothing)
        attention_BxTxHxW, _ = cached_attention(
            q_BxTxHxE, k_BxTxHxE, v_BxTxHxW, widened, index, starts_B
        )
        return self._after_attention(x_BxTxD, attention_BxTxHxW)[0], (
            latents_BxSx1xR,
            rotated_BxSx1xP,
        )

    def _latent_parts(self, x_BxTxD: jax.Array, rotary: tuple) -> tuple:
        """The rotated, scaled queries, the normed latent and the rotated key of every head.

        Shapes: B x T x H x (N + P), B x T x R and B x T x 1 x P.
        """
        cast = self.policy.cast_to_compute
        h_BxTxD = cast(self.attention_norm(x_BxTxD))
        if hasattr(self, "q_up_kernel"):
            latent_BxTxQ = self._project("btd,dq->btq", h_BxTxD, "q_kernel", "q")
            latent_BxTxQ = cast(self.q_latent_norm(latent_BxTxQ))
            q_BxTxHxE = self._project("btq,qhe->bthe", latent_BxTxQ, "q_up_kernel", "q_up")
        else:
            q_BxTxHxE = self._project("btd,dhe->bthe", h_BxTxD, "q_kernel", "q")
        q_BxTxHxE = constrain(q_BxTxHxE, ("batch", "length", "act_heads", "head_dim"))
        down_BxTxS = self._project("btd,ds->bts", h_BxTxD, "kv_down_kernel", "kv_down")
        P = self.rope_width
        latent_BxTxR = cast(self.kv_latent_norm(down_BxTxS[..., :-P]))
        tables = rotary[0]  # MLA has no sliding blocks: the global tables
        rotate = rotate_pairs if self.interleave else rotate_halves
        N = q_BxTxHxE.shape[-1] - P
        q_rope_BxTxHxP = rotate(q_BxTxHxE[..., N:], *tables)
        q_BxTxHxE = jnp.concatenate([q_BxTxHxE[..., :N], q_rope_BxTxHxP], axis=-1)
        if self.query_scale != 1.0:  # YaRN's mscale on the softmax (query_scale_width)
            q_BxTxHxE = q_BxTxHxE * jnp.asarray(self.query_scale, q_BxTxHxE.dtype)
        k_rope_BxTx1xP = rotate(down_BxTxS[:, :, None, -P:], *tables)
        return q_BxTxHxE, latent_BxTxR, k_rope_BxTx1xP.astype(latent_BxTxR.dtype)

    def _widened(self, latent_BxSxR: jax.Array, k_rope_BxSx1xP: jax.Array) -> tuple:
        """(keys B x S x H x (N + P), values B x S x H x W) of the latents and rotated keys."""
        kv_BxSxHxF = self._project("bsr,rhf->bshf", latent_BxSxR, "kv_up_kernel", "kv_up")
        P, W = self.rope_width, self.value_width
        k_nope_BxSxHxN, v_BxSxHxW = kv_BxSxHxF[..., :-W], kv_BxSxHxF[..., -W:]
        k_rope_BxSxHxP = jnp.broadcast_to(k_rope_BxSx1xP, (*k_nope_BxSxHxN.shape[:3], P))
        k_BxSxHxE = jnp.concatenate([k_nope_BxSxHxN, k_rope_BxSxHxP], axis=-1)
        heads = ("batch", "length", "act_heads", "head_dim")
        return constrain(k_BxSxHxE, heads), constrain(v_BxSxHxW, heads)
