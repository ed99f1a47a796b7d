"""A mixture-of-experts feed-forward: a router sends each token to its k best experts.

Routing (`route`). The router's fp32 logits score every expert for every token: a softmax
over the experts (Mixtral, Qwen3-MoE) or a sigmoid per expert (DeepSeek). Each token takes
its `experts_per_token` best experts; their weights are the scores, renormalised to sum to 1
over the chosen when `renormalize` (Mixtral always; Qwen3-MoE's norm_topk_prob), times
`scale` (DeepSeek-V3's routed_scaling_factor). Group-limited routing (DeepSeek-V3): the
experts in `groups` equal groups, each ranked by the sum of its two best scores (its best
with a softmax router, DeepSeek-V2's), a token choosing only within its `top_groups` best
(on a real cluster, a group is a node's experts).

Capacity (`seats`). An expert takes at most C tokens of each group (a group is one row of the
batch, so the groups follow the batch's sharding): C = ceil(capacity_factor x T x K / X), or
C = T when capacity_factor is 0, where no token is ever dropped (a token picks an expert at
most once). Seats go in order of choice rank, then of position: every token's first choice
is seated before any second choice (GShard's order). A choice that finds its expert full is
dropped: it adds nothing, and the token keeps its residual stream and its other choices.

Compute (`MoeFeedForward`). Each kept choice has a slot, expert x C + seat, in its row's
buffers: the tokens are scattered into X x B x C x D expert buffers (memory linear in the
tokens, no one-hot over tokens and seats), every expert runs its SwiGLU on its buffer as
one batched matmul, and each token gathers its choices' outputs back, weighted by the
router. Dropless (C = T) therefore computes X / K times the tokens' work: fine for few
experts; many want a capacity factor. (`jax.lax.ragged_dot`, the grouped matmul that would
compute only the routed tokens, compiles at jax 0.10.2 to one dense matmul over every
expert, for the H200 as for the CPU: no saving.) Shared experts (DeepSeek) are one more
SwiGLU every token goes through, unweighted.

Expert parallelism (mesh.expert). The experts' weights are split over the `expert` axis,
and the batch too; the buffers are pinned to experts over `expert` and rows over the other
batch axes (BUFFERS), so XLA moves each expert's tokens to its devices and the outputs back
by two all-to-alls, capacity-padded.

Bias balancing (model.router_bias_rate, DeepSeek-V3's loss-free balancing): a per-expert
bias is added to the scores that choose the experts, not to the weights that combine them;
after each batch every expert's bias moves by the rate toward the even load (up for an expert
below the mean load, down above it). The bias is model state, not a parameter: the layer
returns its next value among its statistics ("router_bias") and the decoder writes it back.
A sigmoid router always holds the bias (DeepSeek-V3's e_score_correction_bias, which an
import reads): with router_bias_rate 0 it stays where it is, as a fine-tune usually wants.

Losses (`balance_loss`, `z_loss`), over every token of the batch: the balance loss is
Switch's, as Hugging Face's Mixtral computes it for one layer: X x sum over experts of (the
expert's share of the choices made, before capacity) x (its mean router probability); 1 x K
when balanced. The z-loss is the mean squared log-sum-exp of the router logits (ST-MoE).

Shape suffixes: B batch rows (groups), T tokens per row, D width, X experts, K experts per
token, C seats per expert and row, F an expert's MLP width.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from paisoar_jax.models import dropless
from paisoar_jax.models.layers import gated_activation, param
from paisoar_jax.numerics.precision import Policy, float32_island
from paisoar_jax.numerics.remat import recomputed_activation
from paisoar_jax.parallel.sharding import constrain

# The expert buffers' layout: experts over `expert`, the rows over the other batch axes.
BUFFERS = ("act_experts", "batch_within_expert", None, "act_embed")


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """What one MoE feed-forward is: its experts, its router and its capacity."""

    experts: int
    experts_per_token: int = 2
    mlp_width: int = 0  # each expert's SwiGLU hidden width (0: 4 x the model's width)
    capacity_factor: float = 0.0  # 0: dropless (C = T)
    # capacity: X x C buffers (above); dropless: grouped matmuls over the sorted choices
    # (models/dropless.py), every choice computed and nothing padded
    impl: Literal["capacity", "dropless"] = "capacity"
    router: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True  # the chosen experts' weights sum to 1
    shared_experts: int = 0  # DeepSeek: this many experts' width of SwiGLU every token takes
    bias_rate: float = 0.0  # DeepSeek-V3: the choosing bias's step toward even load (0: none)
    biases: bool = False  # GPT-OSS: biases on the router's logits and the experts' matmuls
    activation: Literal["silu", "clamped_swiglu"] = "silu"  # the experts' gated activation
    alpha: float = 1.702  # clamped_swiglu: the sigmoid's slope
    limit: float = 7.0  # clamped_swiglu: the gate's cap, the up's bound
    groups: int = 1  # DeepSeek-V3: the experts in this many groups ...
    top_groups: int = 0  # ... a token's chosen within its this many best (0: every group)
    scale: float = 1.0  # the chosen experts' weights times this

    def capacity(self, tokens: int) -> int:
        """Seats per expert for a group of `tokens` tokens."""
        if self.capacity_factor <= 0:
            return tokens
        wanted = self.capacity_factor * tokens * self.experts_per_token / self.experts
        return max(1, min(tokens, math.ceil(wanted)))


def shape_of(model_config) -> MoeShape:
    """The MoE feed-forward a LanguageModelConfig with model.experts > 0 describes."""
    return MoeShape(
        experts=model_config.experts,
        experts_per_token=model_config.experts_per_token,
        mlp_width=model_config.expert_width,
        capacity_factor=model_config.expert_capacity_factor,
        impl=model_config.moe_impl,
        router=model_config.router,
        renormalize=model_config.router_renormalize,
        shared_experts=model_config.shared_experts,
        bias_rate=model_config.router_bias_rate,
        biases=model_config.expert_bias,
        activation=model_config.expert_activation,
        alpha=model_config.swiglu_alpha,
        limit=model_config.swiglu_limit,
        groups=model_config.router_groups,
        top_groups=model_config.router_top_groups,
        scale=model_config.router_scale,
    )


def inactive_parameters(model_config) -> int:
    """The expert weights a token does not use: (experts - experts_per_token) per MoE layer.

    6 x (all parameters - these) per token is what a MoE model's MFU counts (its active
    parameters), as MaxText and Megatron count it.
    """
    if not model_config.experts:
        return 0
    expert_parameters = 3 * model_config.width * model_config.expert_width
    moe_layers = sum(model_config.is_moe_layer(layer) for layer in range(model_config.layers))
    if model_config.is_moe_layer(model_config.layers - 1):  # multi-token prediction's blocks
        moe_layers += model_config.mtp_depth
    return moe_layers * (model_config.experts - model_config.experts_per_token) * expert_parameters


def auxiliary_loss(statistics: dict[str, jax.Array], model_config) -> jax.Array:
    """What the router adds to the loss: each loss's weight x its mean over the MoE layers.

    `statistics`: per layer (a leading axis of the MoE layers), as the decoder returns them.
    """
    return model_config.router_aux_loss * jnp.mean(
        statistics["balance_loss"]
    ) + model_config.router_z_loss * jnp.mean(statistics["z_loss"])


# The metrics.jsonl fields of a mixture of experts that summarise its MoE layers.
SUMMARY_NAMES = ("moe_balance_loss", "moe_z_loss", "moe_expert_load", "moe_dropped_fraction")
SUMMARY_NAMES += ("moe_router_entropy",)


def moe_layers(model_config) -> list[int]:
    """The layers (from 0) that have experts."""
    return [layer for layer in range(model_config.layers) if model_config.is_moe_layer(layer)]


def metric_names(model_config) -> tuple[str, ...]:
    """Every metrics.jsonl field of a mixture of experts: the summary, then per layer."""
    layers = moe_layers(model_config)
    loads = tuple(f"moe_layer_load/{layer}" for layer in layers)
    dropped = tuple(f"moe_layer_dropped/{layer}" for layer in layers)
    return SUMMARY_NAMES + loads + dropped + tuple(f"moe_layer_entropy/{layer}" for layer in layers)


def metrics_of(statistics: dict[str, jax.Array], model_config) -> dict[str, jax.Array]:
    """The MoE layers' statistics as metrics (`metric_names`), each an fp32 scalar.

    moe_expert_load is the busiest expert's tokens over the mean expert's in the worst
    layer (1 is even), moe_dropped_fraction the share of choices capacity dropped over
    every MoE layer, moe_router_entropy the lowest layer's `router_entropy` (1: the router
    spreads each row's tokens evenly, 0: all to one expert); moe_layer_load/L,
    moe_layer_dropped/L and moe_layer_entropy/L are layer L's own.
    """
    metrics = {
        "moe_balance_loss": jnp.mean(statistics["balance_loss"]),
        "moe_z_loss": jnp.mean(statistics["z_loss"]),
        "moe_expert_load": jnp.max(statistics["expert_load"]),
        "moe_dropped_fraction": jnp.mean(statistics["dropped_fraction"]),
        "moe_router_entropy": jnp.min(statistics["router_entropy"]),
    }
    for index, layer in enumerate(moe_layers(model_config)):
        metrics[f"moe_layer_load/{layer}"] = statistics["expert_load"][index]
        metrics[f"moe_layer_dropped/{layer}"] = statistics["dropped_fraction"][index]
        metrics[f"moe_layer_entropy/{layer}"] = statistics["router_entropy"][index]
    return metrics


def route(
    logits_BxTxX: jax.Array, shape: MoeShape, bias_X: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(weights B x T x K, chosen experts B x T x K, probabilities B x T x X), all fp32.

    The probabilities are what the balance loss averages: the softmax, or the sigmoid
    scores normalised to sum to 1 per token. `bias_X` (bias balancing) shifts the scores
    that choose, not the weights of the chosen.
    """
    logits = float32_island(logits_BxTxX)
    if shape.router == "softmax":
        scores_BxTxX = jax.nn.softmax(logits, axis=-1)
        probabilities_BxTxX = scores_BxTxX
    else:
        scores_BxTxX = jax.nn.sigmoid(logits)
        probabilities_BxTxX = scores_BxTxX / jnp.sum(scores_BxTxX, axis=-1, keepdims=True)
    choosing_BxTxX = scores_BxTxX if bias_X is None else scores_BxTxX + bias_X
    if shape.groups > 1 and (shape.top_groups or shape.groups) < shape.groups:
        pair = shape.router == "sigmoid"
        choosing_BxTxX = _within_best_groups(choosing_BxTxX, shape.groups, shape.top_groups, pair)
    _, chosen_BxTxK = jax.lax.top_k(choosing_BxTxX, shape.experts_per_token)
    weights_BxTxK = jnp.take_along_axis(scores_BxTxX, chosen_BxTxK, axis=-1)
    if shape.renormalize:
        weights_BxTxK = weights_BxTxK / jnp.sum(weights_BxTxK, axis=-1, keepdims=True)
    return weights_BxTxK * shape.scale, chosen_BxTxK, probabilities_BxTxX


def _within_best_groups(
    choosing_BxTxX: jax.Array, groups: int, top_groups: int, pair: bool
) -> jax.Array:
    """The scores that choose, -inf outside each token's `top_groups` best expert groups.

    A group's rank is the sum of its two best scores (`pair`: DeepSeek-V3's sigmoid
    routing), or its best score (DeepSeek-V2's softmax routing), as transformers ranks them.
    """
    B, T, X = choosing_BxTxX.shape
    grouped_BxTxGxN = choosing_BxTxX.reshape(B, T, groups, X // groups)
    rank_BxTxG = jnp.sum(jax.lax.top_k(grouped_BxTxGxN, 2 if pair else 1)[0], axis=-1)
    _, best_BxTxP = jax.lax.top_k(rank_BxTxG, top_groups)
    kept_BxTxG = jnp.sum(jax.nn.one_hot(best_BxTxP, groups, dtype=jnp.int32), axis=2) > 0
    kept_BxTxGxN = jnp.broadcast_to(kept_BxTxG[..., None], grouped_BxTxGxN.shape)
    return jnp.where(kept_BxTxGxN, grouped_BxTxGxN, -jnp.inf).reshape(B, T, X)


def seats(chosen_BxTxK: jax.Array, experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """(seat of each choice B x T x K, kept B x T x K): choice rank first, then position."""
    B, T, K = chosen_BxTxK.shape
    picks_BxTxKxX = jax.nn.one_hot(chosen_BxTxK, experts, dtype=jnp.int32)
    # Rank-major order: all first choices of the row, then all second choices, ...
    ordered_BxKTxX = picks_BxTxKxX.transpose(0, 2, 1, 3).reshape(B, K * T, experts)
    taken_BxKTxX = jnp.cumsum(ordered_BxKTxX, axis=1) - ordered_BxKTxX  # seats before this one
    taken_BxTxKxX = taken_BxKTxX.reshape(B, K, T, experts).transpose(0, 2, 1, 3)
    seat_BxTxK = jnp.sum(taken_BxTxKxX * picks_BxTxKxX, axis=-1)
    return seat_BxTxK, seat_BxTxK < capacity


def balance_loss(chosen_BxTxK: jax.Array, probabilities_BxTxX: jax.Array) -> jax.Array:
    """Switch's balance loss over every token (HF Mixtral's for one layer): K when balanced."""
    experts = probabilities_BxTxX.shape[-1]
    picks_BxTxX = jnp.sum(jax.nn.one_hot(chosen_BxTxK, experts, dtype=jnp.float32), axis=2)
    share_X = jnp.mean(picks_BxTxX, axis=(0, 1))  # choices per token that went to each expert
    probability_X = jnp.mean(probabilities_BxTxX, axis=(0, 1))
    return experts * jnp.sum(share_X * probability_X)


def router_entropy(probabilities_BxTxX: jax.Array) -> jax.Array:
    """The entropy of each row's mean routing probabilities over ln(experts), averaged.

    1: the router spreads a row's tokens evenly over the experts; 0: it sends them all to
    one (a collapsed router). A row is a token group, as for the capacity.
    """
    experts = probabilities_BxTxX.shape[-1]
    mean_BxX = jnp.mean(probabilities_BxTxX, axis=1)
    entropy_B = -jnp.sum(mean_BxX * jnp.log(jnp.maximum(mean_BxX, 1e-12)), axis=-1)
    return jnp.mean(entropy_B) / math.log(experts)


def z_loss(logits_BxTxX: jax.Array) -> jax.Array:
    """The router's z-loss: the mean over tokens of logsumexp(logits) squared."""
    return jnp.mean(jax.nn.logsumexp(float32_island(logits_BxTxX), axis=-1) ** 2)


SWIGLU = gated_activation("silu")  # the experts' and shared experts' unless they say otherwise


def swiglu(
    x_NxD: jax.Array,
    gate_DxF,
    up_DxF,
    down_FxD,
    subscripts: tuple[str, str],
    activation: Callable = SWIGLU,
    biases: tuple | None = None,
):
    """down(silu(x gate) * (x up)); `subscripts`: the in and out einsums (batched experts).

    `activation` another gated one (layers.gated_activation: clamped_swiglu is GPT-OSS's)
    and `biases` (gate, up, down, each broadcast against its product) where the experts
    have them.
    """
    into, out = subscripts
    gate, up = jnp.einsum(into, x_NxD, gate_DxF), jnp.einsum(into, x_NxD, up_DxF)
    if biases is not None:
        gate, up = gate + biases[0], up + biases[1]
    y = jnp.einsum(out, recomputed_activation(activation, gate, up), down_FxD)
    return y if biases is None else y + biases[2]


class MoeFeedForward(nnx.Module):
    """The feed-forward of a MoE block: B x T x D in, B x T x D out, and its statistics."""

    def __init__(self, width: int, shape: MoeShape, policy: Policy, init_std: float, rngs):
        X, D, F = shape.experts, width, shape.mlp_width or 4 * width
        if shape.impl == "dropless":
            dropless.check_mesh()
        normal = nnx.initializers.normal(init_std)
        self.shape, self.policy = shape, policy
        self.router_kernel = param(rngs, normal, (D, X), ("embed", "router"))
        self.gate_kernel = param(rngs, normal, (X, D, F), ("experts", "embed", "mlp"))
        self.up_kernel = param(rngs, normal, (X, D, F), ("experts", "embed", "mlp"))
        self.down_kernel = param(rngs, normal, (X, F, D), ("experts", "mlp", "embed"))
        if shape.biases:  # GPT-OSS: the router's logits and every expert matmul biased
            zeros = nnx.initializers.zeros
            self.router_logit_bias = param(rngs, zeros, (X,), ("router",))
            self.gate_bias = param(rngs, zeros, (X, F), ("experts", "mlp"))
            self.up_bias = param(rngs, zeros, (X, F), ("experts", "mlp"))
            self.down_bias = param(rngs, zeros, (X, D), ("experts", "embed"))
        if shape.bias_rate or shape.router == "sigmoid":  # state, moved by bias balancing
            self.router_bias = nnx.BatchStat(jnp.zeros((X,)), out_sharding=("router",))
        if shape.shared_experts:
            S = shape.shared_experts * F
            self.shared_gate_kernel = param(rngs, normal, (D, S), ("embed", "mlp"))
            self.shared_up_kernel = param(rngs, normal, (D, S), ("embed", "mlp"))
            self.shared_down_kernel = param(rngs, normal, (S, D), ("mlp", "embed"))

    def __call__(self, h_BxTxD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(the experts' output, B x T x D in the compute dtype; the layer's statistics)."""
        cast, shape = self.policy.cast_to_compute, self.shape
        X = shape.experts
        logits_BxTxX = jnp.einsum("btd,dx->btx", float32_island(h_BxTxD), self.router_kernel[...])
        if shape.biases:
            logits_BxTxX = logits_BxTxX + self.router_logit_bias[...]
        bias_X = self.router_bias[...] if hasattr(self, "router_bias") else None
        weights_BxTxK, chosen_BxTxK, probabilities_BxTxX = route(logits_BxTxX, shape, bias_X)
        activation = gated_activation(shape.activation, shape.alpha, shape.limit)
        kernels = tuple(cast(kernel[...]) for kernel in (self.gate_kernel, self.up_kernel))
        kernels += (cast(self.down_kernel[...]),)
        if shape.impl == "dropless":
            y_BxTxD = dropless.dropless_experts(
                cast(h_BxTxD),
                chosen_BxTxK,
                cast(weights_BxTxK),
                kernels,
                self._expert_biases(),
                activation,
            )
            kept_BxTxK = jnp.ones(chosen_BxTxK.shape, bool)
        else:
            y_BxTxD, kept_BxTxK = self._through_buffers(
                cast(h_BxTxD), chosen_BxTxK, cast(weights_BxTxK), kernels, activation
            )
        if shape.shared_experts:
            y_BxTxD = y_BxTxD + swiglu(
                cast(h_BxTxD),
                cast(self.shared_gate_kernel[...]),
                cast(self.shared_up_kernel[...]),
                cast(self.shared_down_kernel[...]),
                ("btd,df->btf", "btf,fd->btd"),
            )
        picks_BxTxKxX = jax.nn.one_hot(chosen_BxTxK, X)
        load_X = jnp.sum(picks_BxTxKxX * kept_BxTxK[..., None], axis=(0, 1, 2))
        statistics = {
            "balance_loss": balance_loss(chosen_BxTxK, probabilities_BxTxX),
            "z_loss": z_loss(logits_BxTxX),
            "expert_load": jnp.max(load_X) / jnp.maximum(jnp.mean(load_X), 1e-9),
            "dropped_fraction": jnp.mean(jnp.logical_not(kept_BxTxK).astype(jnp.float32)),
            "router_entropy": router_entropy(probabilities_BxTxX),
        }
        if shape.bias_rate:  # each expert's bias a step toward the mean load of the choices
            chosen_X = jnp.sum(picks_BxTxKxX, axis=(0, 1, 2))  # before capacity drops
            step_X = shape.bias_rate * jnp.sign(jnp.mean(chosen_X) - chosen_X)
            statistics["router_bias"] = jax.lax.stop_gradient(bias_X + step_X)
        return y_BxTxD, statistics

    def _through_buffers(self, h_BxTxD, chosen_BxTxK, weights_BxTxK, kernels, activation):
        """(the experts' weighted outputs B x T x D, kept B x T x K) through X x C buffers."""
        B, T, D = h_BxTxD.shape
        X, C = self.shape.experts, self.shape.capacity(T)
        seat_BxTxK, kept_BxTxK = seats(chosen_BxTxK, X, C)
        # Each kept choice's slot in its row's X x C buffer; a dropped one goes to slot X C,
        # a spill row past the buffers that no expert reads and that gives back zeros.
        slot_BxTxK = jnp.where(kept_BxTxK, chosen_BxTxK * C + seat_BxTxK, X * C)
        inputs_BxSxD = jax.vmap(_dispatch, in_axes=(0, 0, None))(h_BxTxD, slot_BxTxK, X * C)
        inputs_XxBxCxD = inputs_BxSxD[:, : X * C].reshape(B, X, C, D).swapaxes(0, 1)
        # Expert parallelism (mesh.expert): each expert's buffers go to its devices, which
        # held other rows of the batch until now: XLA makes this reshard an all-to-all.
        inputs_XxBxCxD = constrain(inputs_XxBxCxD, BUFFERS)
        biases = self._expert_biases()
        if biases is not None:  # each broadcast against the X x B x C buffers
            biases = tuple(bias[:, None, None, :] for bias in biases)
        outputs_XxBxCxD = swiglu(
            inputs_XxBxCxD, *kernels, ("xbcd,xdf->xbcf", "xbcf,xfd->xbcd"), activation, biases
        )
        outputs_XxBxCxD = constrain(outputs_XxBxCxD, BUFFERS)
        outputs_BxSxD = outputs_XxBxCxD.swapaxes(0, 1).reshape(B, X * C, D)
        outputs_BxSxD = constrain(outputs_BxSxD, ("batch", None, "act_embed"))  # back: all-to-all
        spill_Bx1xD = jnp.zeros((B, 1, D), outputs_BxSxD.dtype)
        outputs_BxSxD = jnp.concatenate([outputs_BxSxD, spill_Bx1xD], axis=1)
        chosen_outputs_BxTxKxD = jax.vmap(lambda rows, slots: rows[slots])(
            outputs_BxSxD, slot_BxTxK
        )
        return jnp.einsum("btkd,btk->btd", chosen_outputs_BxTxKxD, weights_BxTxK), kept_BxTxK

    def _expert_biases(self) -> tuple | None:
        """The experts' (gate X x F, up X x F, down X x D) biases, or None."""
        if not self.shape.biases:
            return None
        cast = self.policy.cast_to_compute
        return tuple(
            cast(getattr(self, name)[...]) for name in ("gate_bias", "up_bias", "down_bias")
        )


def _dispatch(h_TxD: jax.Array, slot_TxK: jax.Array, slots: int) -> jax.Array:
    """One row's tokens copied into their choices' slots: (slots + 1) x D, the last a spill."""
    T, K = slot_TxK.shape
    buffer_SxD = jnp.zeros((slots + 1, h_TxD.shape[-1]), h_TxD.dtype)
    return buffer_SxD.at[slot_TxK.reshape(T * K)].set(jnp.repeat(h_TxD, K, axis=0))
