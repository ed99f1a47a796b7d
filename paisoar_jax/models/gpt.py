"""A GPT decoder in Flax NNX: pre-LN blocks, learned or rotary positions, tied embeddings.

Every parameter carries logical axis names (see sharding.py for where they go). Attention
(models/attention.py) runs through jax.nn.dot_product_attention, so cuDNN flash attention
serves on GPU. Layers are
either stacked and scanned (one block compiled once; fast compile for deep models) or
unrolled. Shape suffixes: B batch, T time, D width, H heads, E head width, F MLP width,
V vocab, L layers.
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
from paisoar_jax.engine import lora
from paisoar_jax.errors import UserError
from paisoar_jax.models.attention import attention, resolve_attention
from paisoar_jax.models.decoding import cached_attention, decode_blocks
from paisoar_jax.models.layers import build_blocks, layer_norm, param
from paisoar_jax.models.moe import MoeFeedForward, inactive_parameters, shape_of
from paisoar_jax.models.mtp import PredictionModule, ahead
from paisoar_jax.models.rotary import pairs_tables, rotate_pairs
from paisoar_jax.models.stack import PackedRows, run_blocks, run_one_block, stream_of
from paisoar_jax.numerics import fp8
from paisoar_jax.numerics.precision import Policy, matmul_fp32_out
from paisoar_jax.numerics.remat import recomputed_activation
from paisoar_jax.parallel.context import split_attention
from paisoar_jax.parallel.sharding import constrain, context_shards, sequence_whole


def mlp_width(config: LanguageModelConfig) -> int:
    """The MLP hidden width: model.mlp_width, or 4 x width when that is 0."""
    return config.mlp_width or 4 * config.width


class DecoderBlock(nnx.Module):
    """What a GPT and a Llama block share: attention, plain or over a key/value cache.

    Each block supplies its own projections (`_queries_keys_values`), what follows the
    attention (`_after_attention`) and its dense MLP (`_mlp`); a block with experts
    (`self.moe`, models/moe.py) runs them in the MLP's place.
    """

    moe: MoeFeedForward | None = None
    window: int = 0  # attends to this many tokens ending at itself; 0: every earlier one
    # The projections LoRA may adapt (lora.py), each with its count of input axes: the
    # kernel's leading axes that the projection contracts.
    LORA_KERNELS: dict[str, int] = {}

    def __call__(
        self,
        x_BxTxD: jax.Array,
        rotary: tuple | None,
        segments_BxT: jax.Array | None = None,
        positions_BxT: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(the block's output, its router statistics: {} without experts).

        `rotary` holds (sin, cos) tables or None for learned positions; `segments_BxT`:
        packed documents, each attending only within itself. With the sequence split over
        mesh.context, `positions_BxT` says where each token is (the layout may be balanced):
        a token attends to those of its document at positions up to its own.
        """
        q_BxTxHxE, k_BxTxKxE, v_BxTxKxE = self._queries_keys_values(x_BxTxD, rotary)
        if context_shards() > 1:
            attention_BxTxHxE = split_attention(
                q_BxTxHxE,
                k_BxTxKxE,
                v_BxTxKxE,
                positions_BxT,
                segments_BxT,
                self.context,
                self.attention_impl,
            )
        else:
            # jax.nn.dot_product_attention groups H query heads over K < H kv heads itself.
            attention_BxTxHxE = attention(
                q_BxTxHxE,
                k_BxTxKxE,
                v_BxTxKxE,
                self.attention_impl,
                segments_BxT,
                self.window,
                self._sinks(),
            )
        return self._after_attention(x_BxTxD, attention_BxTxHxE)

    def decode(self, x_BxTxD, rotary, cache, index, starts_B=None) -> tuple[jax.Array, tuple]:
        """The block at positions index.., attending over the cache (models/decoding.py)."""
        q_BxTxHxE, k_BxTxKxE, v_BxTxKxE = self._queries_keys_values(x_BxTxD, rotary)
        attention_BxTxHxE, cache = cached_attention(
            q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, cache, index, starts_B, self.window, self._sinks()
        )
        return self._after_attention(x_BxTxD, attention_BxTxHxE)[0], cache

    def _sinks(self) -> jax.Array | None:
        """Each head's attention-sink logit (model.attention_sinks), or None."""
        return self.sinks[...] if hasattr(self, "sinks") else None

    def _feed_forward(self, h_BxTxD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The dense MLP of the normed stream, or the experts with their statistics."""
        if self.moe is not None:
            return self.moe(h_BxTxD)
        return self._mlp(h_BxTxD), {}

    def _project(self, equation: str, x: jax.Array, kernel_name: str, dot_name: str):
        """`einsum(equation, x, kernel)` (fp8.matmul's), plus the kernel's LoRA adapter."""
        kernel = getattr(self, kernel_name)[...]
        y = fp8.matmul(equation, x, kernel, dot_name, policy=self.policy, dots=self.fp8)
        return lora.add(self, kernel_name, equation, x, y)

    def _queries_keys_values(self, x_BxTxD: jax.Array, rotary: tuple | None) -> tuple:
        raise NotImplementedError

    def _after_attention(self, x_BxTxD: jax.Array, attention_BxTxHxE: jax.Array) -> tuple:
        raise NotImplementedError

    def _mlp(self, h_BxTxD: jax.Array) -> jax.Array:
        raise NotImplementedError


def experts_of(config: LanguageModelConfig, policy: Policy, rngs: nnx.Rngs, layer: int):
    """Block `layer`'s experts (models/moe.py), or None where it has a dense MLP."""
    if not config.is_moe_layer(layer):
        return None
    return MoeFeedForward(config.width, shape_of(config), policy, config.init_std, rngs)


ATTENTION_MATMULS = ("qkv", "out")  # a GPT block's fp8 matmuls when experts are its MLP


class Block(DecoderBlock):
    """One pre-LN transformer block: x + attention(norm(x)), then x + mlp(norm(x)).

    With experts (model.experts), SwiGLU experts take the GELU MLP's place.
    """

    LORA_KERNELS = {"qkv_kernel": 1, "out_kernel": 2, "mlp_in_kernel": 1, "mlp_out_kernel": 1}
    # lora.targets may name them as PEFT does (GPT-2's modules; c_proj is both projections).
    PEFT_NAMES = {
        "c_attn": ("qkv_kernel",),
        "c_proj": ("out_kernel", "mlp_out_kernel"),
        "c_fc": ("mlp_in_kernel",),
    }

    def __init__(self, config: LanguageModelConfig, policy: Policy, rngs: nnx.Rngs, layer: int):
        D, H, F = config.width, config.heads, mlp_width(config)
        E = D // H
        normal = nnx.initializers.normal(config.init_std)
        # GPT-2: residual projections scaled down by depth, so the stream's variance stays put.
        residual = nnx.initializers.normal(config.init_std / math.sqrt(2 * config.layers))
        zeros = nnx.initializers.zeros
        self.policy = policy
        self.attention_impl = resolve_attention(config.attention, policy, D // H)
        self.context = config.context_attention  # gather or ring, with mesh.context > 1
        self.attention_norm = layer_norm(D, config.norm_eps, rngs)
        self.qkv_kernel = param(rngs, normal, (D, 3, H, E), ("embed", "qkv", "heads", "head_dim"))
        self.qkv_bias = param(rngs, zeros, (3, H, E), ("qkv", "heads", "head_dim"))
        self.out_kernel = param(rngs, residual, (H, E, D), ("heads", "head_dim", "embed"))
        self.out_bias = param(rngs, zeros, (D,), ("embed",))
        self.mlp_norm = layer_norm(D, config.norm_eps, rngs)
        self.moe = experts_of(config, policy, rngs, layer)
        if self.moe is None:
            self.mlp_in_kernel = param(rngs, normal, (D, F), ("embed", "mlp"))
            self.mlp_in_bias = param(rngs, zeros, (F,), ("mlp",))
            self.mlp_out_kernel = param(rngs, residual, (F, D), ("mlp", "embed"))
            self.mlp_out_bias = param(rngs, zeros, (D,), ("embed",))
        # precision.policy=fp8: each of the four matmuls keeps its own fp8 scaling state (with
        # experts, the attention's two: the experts' matmuls run in bf16).
        self.fp8 = fp8.block_dots(
            policy, ATTENTION_MATMULS if self.moe is not None else fp8.BLOCK_MATMULS
        )

    def _queries_keys_values(self, x_BxTxD: jax.Array, rotary: tuple | None) -> tuple:
        cast = self.policy.cast_to_compute
        h_BxTxD = cast(self.attention_norm(x_BxTxD))
        qkv_BxTx3xHxE = self._project("btd,dkhe->btkhe", h_BxTxD, "qkv_kernel", "qkv")
        qkv_BxTx3xHxE = qkv_BxTx3xHxE + cast(self.qkv_bias[...])
        qk_BxTx2xHxE = qkv_BxTx3xHxE[:, :, :2]
        if rotary is not None:
            # Queries and keys turned together, in one kernel that reads the projection once
            # (gpt_1b on one H200: 9.7 GB less a step to move than one kernel each).
            qk_BxTx2xHxE = rotate_pairs(qk_BxTx2xHxE, *rotary)
        heads = ("batch", "length", "act_heads", "head_dim")
        q_BxTxHxE, k_BxTxHxE = (constrain(qk_BxTx2xHxE[:, :, i], heads) for i in range(2))
        return q_BxTxHxE, k_BxTxHxE, constrain(qkv_BxTx3xHxE[:, :, 2], heads)

    def _after_attention(self, x_BxTxD: jax.Array, attention_BxTxHxE: jax.Array) -> tuple:
        cast = self.policy.cast_to_compute
        attention_BxTxHxE = checkpoint_name(attention_BxTxHxE, "attention_out")
        out_BxTxD = self._project("bthe,hed->btd", attention_BxTxHxE, "out_kernel", "out")
        x_BxTxD = x_BxTxD + out_BxTxD + cast(self.out_bias[...])
        x_BxTxD = constrain(x_BxTxD, ("batch", "length", "act_embed"))
        out_BxTxD, statistics = self._feed_forward(cast(self.mlp_norm(x_BxTxD)))
        return constrain(x_BxTxD + out_BxTxD, ("batch", "length", "act_embed")), statistics

    def _mlp(self, h_BxTxD: jax.Array) -> jax.Array:
        cast = self.policy.cast_to_compute
        hidden_BxTxF = self._project("btd,df->btf", h_BxTxD, "mlp_in_kernel", "mlp_in")
        hidden_BxTxF = recomputed_activation(
            lambda x, bias: jax.nn.gelu(x + bias), hidden_BxTxF, cast(self.mlp_in_bias[...])
        )
        hidden_BxTxF = constrain(hidden_BxTxF, ("batch", "length", "act_mlp"))
        hidden_BxTxF = checkpoint_name(hidden_BxTxF, "mlp_hidden")
        out_BxTxD = self._project("btf,fd->btd", hidden_BxTxF, "mlp_out_kernel", "mlp_out")
        return out_BxTxD + cast(self.mlp_out_bias[...])


class Decoder(nnx.Module):
    """What GPT and Llama share: the forward pass, cached decoding and the FLOPs count.

    A subclass builds its layers with `_build` (its block class and final norm) and says in
    `_embed` how tokens at given positions enter the stream (`_token_embeddings` first).
    """

    def _build(
        self,
        config: LanguageModelConfig,
        policy: Policy,
        remat_policy: str,
        rngs: nnx.Rngs,
        block_class: type,
        final_norm: Callable[[int, float, nnx.Rngs], nnx.Module],
    ) -> None:
        """The token table, the blocks (`block_class`), the final norm and the untied head."""
        self.config, self.policy, self.remat_policy = config, policy, remat_policy
        normal = nnx.initializers.normal(config.init_std)
        D, V = config.width, config.vocab_size
        self.token_embedding = param(rngs, normal, (V, D), ("vocab", "embed"))
        if config.position == "learned":  # GPT's own; drawn here, as the first GPTs drew it
            table = (config.positions, D)  # every position the model holds, not the window
            self.position_embedding = param(rngs, normal, table, ("length", "embed"))
        self.blocks = build_blocks(
            lambda rngs, layer: block_class(config, policy, rngs, layer),
            config.layers,
            config.scan_layers,
            rngs,
        )
        self.final_norm = final_norm(D, config.norm_eps, rngs)
        if not config.tie_embeddings:
            self.head = param(rngs, normal, (D, V), ("embed", "vocab"))
        if config.mtp_depth and context_shards() > 1:
            raise UserError(
                "model.mtp_depth with mesh.context > 1 is not supported yet: its targets lie "
                "k tokens on, across the context split (use mesh.context=1)"
            )
        if config.mtp_depth:  # multi-token prediction's modules (models/mtp.py): training's
            self.mtp = nnx.List(
                [
                    PredictionModule(config, policy, rngs, block_class, final_norm)
                    for _ in range(config.mtp_depth)
                ]
            )

    def _token_embeddings(self, tokens_BxT: jax.Array) -> jax.Array:
        """The tokens' rows of the table, in the compute dtype."""
        # Gather the (cast) table whole before the lookup: a lookup into a table split over
        # vocab and embed makes XLA replicate it the slow way (SPMD full rematerialization).
        table_VxD = constrain(self.policy.cast_to_compute(self.token_embedding[...]), (None, None))
        return jnp.take(table_VxD, tokens_BxT, axis=0)

    def __call__(
        self,
        tokens_BxT: jax.Array,
        segments_BxT: jax.Array | None = None,
        positions_BxT: jax.Array | None = None,
    ) -> jax.Array:
        """Next-token logits for each position of `tokens_BxT`.

        Packed documents (data/documents.py): token t is of document `segments_BxT[:, t]`
        and attends within it alone, at position `positions_BxT[:, t]` of it.
        """
        return self.logits_and_statistics(tokens_BxT, segments_BxT, positions_BxT)[0]

    def logits_and_statistics(
        self,
        tokens_BxT: jax.Array,
        segments_BxT: jax.Array | None = None,
        positions_BxT: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(the logits, the router statistics of the MoE layers: {} for a dense model).

        Each statistic has a leading axis of the MoE layers (models/moe.py says what they
        are); the loss adds the router's losses from them (moe.auxiliary_loss).
        """
        h_BxTxD, statistics = self.stream_and_statistics(tokens_BxT, segments_BxT, positions_BxT)
        return output_logits(self, h_BxTxD), statistics

    def stream_and_statistics(
        self,
        tokens_BxT: jax.Array,
        segments_BxT: jax.Array | None = None,
        positions_BxT: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(the final-normed stream the head reads, in the compute dtype; the statistics).

        The chunked loss (model.loss_chunks) takes it with `output_head(model)` instead of
        the logits.
        """
        x, statistics, _ = self._through_blocks(tokens_BxT, segments_BxT, positions_BxT)
        x_BxTxD = stream_of(x)
        return self.policy.cast_to_compute(self.final_norm(x_BxTxD)), statistics

    def depth_streams_and_statistics(
        self,
        tokens_BxT: jax.Array,
        segments_BxT: jax.Array | None = None,
        positions_BxT: jax.Array | None = None,
    ) -> tuple[list[jax.Array], dict[str, jax.Array]]:
        """([the final-normed stream, then each multi-token prediction module's], statistics).

        Module k reads the embeddings of the tokens k ahead (models/mtp.py); the statistics
        of its experts, if it has them, follow the decoder's MoE layers'.
        """
        x, statistics, rotary = self._through_blocks(tokens_BxT, segments_BxT, positions_BxT)
        x_BxTxD = stream_of(x)
        streams = [self.policy.cast_to_compute(self.final_norm(x_BxTxD))]
        run_block = functools.partial(run_one_block, rotary=rotary, remat=self.remat_policy)
        for k, module in enumerate(self.mtp, start=1):
            embeddings_BxTxD = self._token_embeddings(ahead(tokens_BxT, k))
            x, normed_BxTxD, module_statistics = module(x, embeddings_BxTxD, run_block)
            streams.append(normed_BxTxD)
            if module_statistics:
                statistics = jax.tree.map(
                    lambda stacked, one: jnp.concatenate([stacked, one[None]]),
                    statistics,
                    module_statistics,
                )
        return streams, statistics

    def _through_blocks(self, tokens_BxT, segments_BxT, positions_BxT) -> tuple:
        """The last block's stream (or PackedRows of it), the statistics, the rotary input.

        The rotary input is what the blocks took: the tables, or the function of positions.
        """
        # Split over mesh.context, attention needs each token's position (the layout may
        # be balanced); packed documents bring theirs.
        if positions_BxT is None and (segments_BxT is not None or context_shards() > 1):
            positions_BxT = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
        if positions_BxT is None:
            x_BxTxD, rotary = self._embed(tokens_BxT, 0)
            x_BxTxD, statistics = run_blocks(
                self.blocks, x_BxTxD, rotary, self.remat_policy, self.config
            )
            return x_BxTxD, statistics, rotary
        x_BxTxD, _ = self._embed(tokens_BxT, 0, positions_BxT)
        rows = PackedRows(x_BxTxD, segments_BxT, positions_BxT)
        # Each block makes its rotary tables from the rows' positions (a function, not
        # tables, crosses into the scan: per-row tables would ride in every layer's carry).
        rotary_of = self.rotary_function()
        rows, statistics = run_blocks(self.blocks, rows, rotary_of, self.remat_policy, self.config)
        return rows, statistics, rotary_of

    def decode(self, tokens_BxT: jax.Array, cache: tuple, index: jax.Array, starts_B=None) -> tuple:
        """(logits, cache) for tokens at positions index.. with the cache of those before.

        `starts_B`: left-padded rows of prompts of several lengths, each row's padding; its
        tokens then sit at positions index - start.., and the padding is never attended.
        """
        with sequence_whole():  # decoding runs unsplit, whatever mesh.context is
            positions_BxT = None
            if starts_B is not None:
                T = tokens_BxT.shape[1]
                positions_BxT = index + jnp.arange(T)[None, :] - starts_B[:, None]
                positions_BxT = jnp.maximum(positions_BxT, 0)  # the padding's own: unused
            x_BxTxD, rotary = self._embed(tokens_BxT, index, positions_BxT)
            rotary_of = self.rotary_function()
            if positions_BxT is not None and rotary_of is not None:
                rotary = rotary_of(positions_BxT)  # each row's own positions
            scanned = self.config.scan_layers
            x_BxTxD, cache = decode_blocks(
                self.blocks, x_BxTxD, rotary, cache, index, scanned, starts_B
            )
            logits = output_logits(self, self.policy.cast_to_compute(self.final_norm(x_BxTxD)))
        return logits, cache

    def _embed(
        self, tokens_BxT: jax.Array, start, positions_BxT: jax.Array | None = None
    ) -> tuple[jax.Array, tuple | None]:
        raise NotImplementedError

    def rotary_function(self) -> Callable | None:
        """Maps positions to their (sin, cos) rotary tables; None for learned positions."""
        raise NotImplementedError

    @staticmethod
    def flops_per_token(config: LanguageModelConfig, param_count: int) -> float:
        """Training FLOPs per token: 6 N for the matmuls plus 12 L D T for attention.

        Grouped kv heads change the parameter count, not the attention's FLOPs. N counts
        the active parameters: a mixture of experts leaves out the experts a token skips.
        A sliding-window block attends over its window, not T.
        """
        active = param_count - inactive_parameters(config)
        # queries x keys, then weights x values: the width, unless heads are wider (or MLA's
        # keys wider than its values)
        attention_width = config.heads * (config.query_head_size + config.value_head_size)
        T = config.seq_len
        spans = [min(config.window_of(layer) or T, T) for layer in range(config.layers)]
        # Each multi-token prediction module: its block's attention, and the shared head
        # once more (its parameters are counted once in N).
        depth = config.mtp_depth * (
            6 * attention_width * spans[-1] + 6 * config.width * config.vocab_size
        )
        return 6 * active + 6 * attention_width * sum(spans) + depth


class GPT(Decoder):
    """Decoder-only transformer language model returning logits (B x T x V).

    The logits are fp32, or in the compute dtype with model.fp32_logits=false.
    """

    def __init__(
        self, config: LanguageModelConfig, policy: Policy, remat_policy: str, rngs: nnx.Rngs
    ):
        self._build(config, policy, remat_policy, rngs, Block, layer_norm)

    def _embed(
        self, tokens_BxT: jax.Array, start, positions_BxT: jax.Array | None = None
    ) -> tuple[jax.Array, tuple | None]:
        """The tokens' embeddings at positions start.. (or `positions_BxT`), and rotary tables.

        The tables are those of positions start.. (None for learned positions).
        """
        T = tokens_BxT.shape[1]
        x_BxTxD = self._token_embeddings(tokens_BxT)
        if self.config.position == "learned":
            if positions_BxT is None:
                table_TxD = jax.lax.dynamic_slice_in_dim(self.position_embedding[...], start, T)
            else:
                # Whole before the lookup, as the token table above (here in fp32: the table
                # is small, and a cast first would put the rounding before the gather).
                whole_PxD = constrain(self.position_embedding[...], (None, None))
                table_TxD = jnp.take(whole_PxD, positions_BxT, axis=0)
            x_BxTxD = x_BxTxD + self.policy.cast_to_compute(table_TxD)
        rotary_of = self.rotary_function()
        rotary = None if rotary_of is None else rotary_of(start + jnp.arange(T))
        return constrain(x_BxTxD, ("batch", "length", "act_embed")), rotary

    def rotary_function(self) -> Callable | None:
        """Maps positions to their (sin, cos) rotary tables; None for learned positions."""
        if self.config.position == "learned":
            return None
        head_width = self.config.width // self.config.heads
        return functools.partial(pairs_tables, head_width=head_width, theta=self.config.rope_theta)


def output_head(model: nnx.Module) -> jax.Array:
    """A decoder's head (D x V) in the compute dtype: the tied table's transpose, or its own."""
    head_DxV = model.token_embedding[...].T if model.config.tie_embeddings else model.head[...]
    return model.policy.cast_to_compute(head_DxV)


def output_logits(model: nnx.Module, h_BxTxD: jax.Array) -> jax.Array:
    """A decoder's logits from its normed stream: through the tied table or the head."""
    head_DxV = output_head(model)
    if model.config.fp32_logits:  # its backward in the compute dtype, not fp32 x fp32
        logits_BxTxV = matmul_fp32_out("btd,dv->btv", h_BxTxD, head_DxV)
    else:
        logits_BxTxV = jnp.einsum("btd,dv->btv", h_BxTxD, head_DxV)
    return constrain(logits_BxTxV, ("batch", "length", "act_vocab"))
