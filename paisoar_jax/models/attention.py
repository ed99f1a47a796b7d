"""Attention for the zoo's decoders: causal attention, its sliding window and its kernel.

`attention` runs jax.nn.dot_product_attention (logits and softmax in fp32), so cuDNN flash
attention serves on GPU; `resolve_attention` says which implementation model.attention
runs (auto: cuDNN where it compiles, else XLA's) and `check_attention` refuses what cuDNN
cannot run. Rotary positions are models/rotary.py's. Shape suffixes: B batch, T time, H
heads, E head width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from paisoar_jax import output
from paisoar_jax.errors import UserError
from paisoar_jax.numerics.precision import Policy, float32_island
from paisoar_jax.runtime.platform import compile_platform, is_target_compile


def attention(
    q_BxTxHxE,
    k_BxTxHxE,
    v_BxTxHxE,
    implementation: str,
    segments_BxT: jax.Array | None = None,
    window: int = 0,
    sinks_H: jax.Array | None = None,
) -> jax.Array:
    """Causal attention via jax.nn.dot_product_attention; logits and softmax in fp32.

    With `segments_BxT` (packed documents), a token attends only to the tokens of its own
    segment (cuDNN takes the mask as a dense bias). `window` > 0: only to the `window`
    tokens ending at itself (a sliding window; cuDNN skips the blocks outside it).
    `sinks_H`: each head's sink logit (`sink_attention`, XLA's math). XLA on CPU has no
    fp16 matmul with fp32 accumulation, which jax's fp16 attention asks for, so fp16
    attention on CPU runs in fp32 (GPUs keep fp16).
    """
    dtype = q_BxTxHxE.dtype
    if dtype == jnp.float16 and compile_platform() == "cpu":
        q_BxTxHxE, k_BxTxHxE, v_BxTxHxE = map(float32_island, (q_BxTxHxE, k_BxTxHxE, v_BxTxHxE))
    mask_Bx1xTxT = None
    if segments_BxT is not None:
        mask_Bx1xTxT = (segments_BxT[:, :, None] == segments_BxT[:, None, :])[:, None]
    if sinks_H is not None:
        T = q_BxTxHxE.shape[1]
        visible_TxT = visible(0, T, T, window)
        mask = visible_TxT[None, None] if mask_Bx1xTxT is None else mask_Bx1xTxT & visible_TxT
        out_BxTxHxE = sink_attention(q_BxTxHxE, k_BxTxHxE, v_BxTxHxE, mask, sinks_H)
        return out_BxTxHxE.astype(dtype)
    out_BxTxHxE = jax.nn.dot_product_attention(
        q_BxTxHxE,
        k_BxTxHxE,
        padded_values(v_BxTxHxE, q_BxTxHxE.shape[-1]),
        mask=mask_Bx1xTxT,
        is_causal=True,
        local_window_size=(window - 1, 0) if window else None,
        implementation=implementation,
    )
    return out_BxTxHxE[..., : v_BxTxHxE.shape[-1]].astype(dtype)


def padded_values(v_BxSxKxW: jax.Array, width: int) -> jax.Array:
    """The values as wide as the queries and keys, with zero features after their own.

    jax.nn.dot_product_attention takes one head width for all three; multi-head latent
    attention's values are narrower (models/latent.py). The padding's outputs are zeros,
    which the caller slices off: the same result, for that share of the second matmul.
    """
    extra = width - v_BxSxKxW.shape[-1]
    return v_BxSxKxW if extra == 0 else jnp.pad(v_BxSxKxW, ((0, 0),) * 3 + ((0, extra),))


def visible(first, queries: int, keys: int, window: int = 0) -> jax.Array:
    """What queries at positions first.. see of keys at positions 0.. (queries x keys).

    Every key at or before the query; with `window` > 0 only the `window` ending at it
    (transformers' sliding window: query - key < window).
    """
    distance_TxS = first + jnp.arange(queries)[:, None] - jnp.arange(keys)[None, :]
    seen_TxS = distance_TxS >= 0
    return seen_TxS & (distance_TxS < window) if window else seen_TxS


def sink_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask, sinks_H: jax.Array) -> jax.Array:
    """Attention with a sink: each head's learned logit joins the softmax's denominator.

    The sink attends to nothing (GPT-OSS's): a head can give a token little weight on every
    key. `mask` (B or 1, 1, T, S) says what each query sees; the H query heads share the K
    key/value heads in groups. The matmuls take the compute dtype and sum in fp32; logits
    and softmax are fp32. (XLA's math, T x S logits in memory: cuDNN's kernel has no sink.)
    """
    H, K = q_BxTxHxE.shape[2], k_BxSxKxE.shape[2]
    k_BxSxHxE = jnp.repeat(k_BxSxKxE, H // K, axis=2)
    v_BxSxHxE = jnp.repeat(v_BxSxKxE, H // K, axis=2)
    scale = q_BxTxHxE.shape[-1] ** -0.5
    logits_BxHxTxS = jnp.einsum(
        "bthe,bshe->bhts", q_BxTxHxE, k_BxSxHxE, preferred_element_type=jnp.float32
    )
    logits_BxHxTxS = jnp.where(mask, logits_BxHxTxS * scale, -jnp.inf)
    B, _, T, _ = logits_BxHxTxS.shape
    sink_BxHxTx1 = jnp.broadcast_to(float32_island(sinks_H)[None, :, None, None], (B, H, T, 1))
    weights = jax.nn.softmax(jnp.concatenate([logits_BxHxTxS, sink_BxHxTx1], axis=-1), axis=-1)
    weights_BxHxTxS = weights[..., :-1].astype(v_BxSxHxE.dtype)
    return jnp.einsum(
        "bhts,bshe->bthe", weights_BxHxTxS, v_BxSxHxE, preferred_element_type=jnp.float32
    )


def check_attention(implementation: str, policy: Policy) -> None:
    """Refuses up front what cuDNN flash attention cannot run: non-GPU devices, fp32."""
    if implementation != "cudnn":
        return
    if compile_platform() != "gpu":
        raise UserError(
            f"model.attention=cudnn needs an NVIDIA GPU, and this run has "
            f"{compile_platform()} devices (use auto or xla)"
        )
    if not _is_half(policy):
        raise UserError("model.attention=cudnn needs precision.policy=bf16 or fp16")


def _is_half(policy: Policy) -> bool:
    return jnp.dtype(policy.compute_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def resolve_attention(name: str, policy: Policy, head_width: int) -> str:
    """The attention implementation model.attention=`name` runs: "cudnn" or "xla".

    auto takes cuDNN flash attention where it can run (an NVIDIA GPU, bf16 or fp16, a head
    width that is a multiple of 8 up to 128, and a cuDNN that compiles it): on the H200 this
    project measures on, a plain JAX GPT-2 124M step ran at 467k tokens/s with it against
    251k with XLA's attention (benchmarks/RESULTS.md). Everywhere else auto is XLA's.
    """
    check_attention(name, policy)
    if name != "auto":
        return name
    shape_fits = head_width % 8 == 0 and head_width <= 128
    if compile_platform() == "gpu" and _is_half(policy) and shape_fits:
        # A GPU target without a GPU (plan --target) cannot try it: the step's compile will.
        if is_target_compile() or cudnn_attention_compiles(
            jnp.dtype(policy.compute_dtype).name, head_width
        ):
            return "cudnn"
    return "xla"


@functools.cache
def cudnn_attention_compiles(dtype: str, head_width: int) -> bool:
    """Whether cuDNN flash attention (forward and backward) compiles here for this head.

    Checked once per process, dtype and head width, from abstract inputs.
    """
    q_BxTxHxE = jax.ShapeDtypeStruct((1, 128, 1, head_width), jnp.dtype(dtype))

    def loss(q_BxTxHxE):
        out = jax.nn.dot_product_attention(
            q_BxTxHxE, q_BxTxHxE, q_BxTxHxE, is_causal=True, implementation="cudnn"
        )
        return out.astype(jnp.float32).sum()

    try:
        jax.jit(jax.grad(loss)).lower(q_BxTxHxE).compile()
    except Exception as error:  # any failure means: use XLA's attention, and say why
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        if jax.process_index() == 0:  # stderr: bench's stdout carries its JSON line
            output.note(f"cuDNN attention unavailable ({reason}); using XLA attention", stderr=True)
        return False
    return True
