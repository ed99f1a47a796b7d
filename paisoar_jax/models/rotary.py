"""Rotary position embeddings, both conventions, with their scalings.

Hugging Face's Llama-family convention (`halves_tables`, `rotate_halves`) pairs feature i
with feature i + E/2 of each head, its frequencies scaled as model.rope_scaling says
(Llama 3's band, or linear) and, for sliding-window blocks with a base of their own
(model.local_rope_theta, Gemma 3), a second set of tables. GPT's with model.position=rotary
(`pairs_tables`, `rotate_pairs`) pairs neighbouring features. Every rotation runs in fp32.
Shape suffixes: B batch, T time, H heads, E head width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from paisoar_jax.config import LanguageModelConfig
from paisoar_jax.numerics.precision import float32_island


def inverse_frequencies(config: LanguageModelConfig, local: bool = False) -> jax.Array:
    """The E/2 rotary frequencies, with the scaling model.rope_scaling says.

    Llama 3: wavelengths longer than original_length / low_freq_factor are slowed by
    `factor`, those shorter than original_length / high_freq_factor are kept, and the band
    between blends the two. linear: every frequency divided by `factor`. yarn: `_yarn`.
    `local`: the sliding blocks' own base (model.local_rope_theta), never scaled (Gemma
    3's).
    """
    head_width = config.rotary_width
    theta = config.local_rope_theta if local else config.rope_theta
    inverse = 1.0 / (theta ** (jnp.arange(0, head_width, 2) / head_width))
    if config.rope_scaling == "none" or local:
        return inverse
    factor, original = config.rope_factor, config.rope_original_length
    if config.rope_scaling == "linear":
        return inverse / factor
    if config.rope_scaling == "yarn":
        return _yarn(config, inverse)
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    wavelength = 2 * math.pi / inverse
    slowed = jnp.where(wavelength > original / low, inverse / factor, inverse)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    in_band = (wavelength >= original / high) & (wavelength <= original / low)
    return jnp.where(in_band, blended, slowed)


def _yarn(config: LanguageModelConfig, inverse_E2: jax.Array) -> jax.Array:
    """YaRN's frequencies: the slow dimensions interpolated (/ factor), the fast kept.

    A dimension that turns fewer than beta_slow times over the original context is
    interpolated, one that turns more than beta_fast times kept, the dimensions between a
    linear blend (bounds rounded to whole dimensions where model.rope_truncate).
    """
    head_width, theta = config.rotary_width, config.rope_theta

    def dimension(rotations: float) -> float:  # the dimension that turns this many times
        wavelengths = config.rope_original_length / (rotations * 2 * math.pi)
        return head_width * math.log(wavelengths) / (2 * math.log(theta))

    low, high = dimension(config.rope_beta_fast), dimension(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_width - 1)
    high = high + 0.001 if low == high else high
    ramp_E2 = jnp.clip((jnp.arange(head_width // 2) - low) / (high - low), 0, 1)
    return inverse_E2 / config.rope_factor * ramp_E2 + inverse_E2 * (1 - ramp_E2)


def attention_factor(config: LanguageModelConfig) -> float:
    """The scale of the rotary tables: YaRN's (model.rope_attention_factor or its own), else 1."""
    if config.rope_scaling != "yarn":
        return 1.0
    if config.rope_attention_factor:
        return config.rope_attention_factor
    return 0.1 * math.log(config.rope_factor) + 1.0 if config.rope_factor > 1 else 1.0


def halves_tables(config: LanguageModelConfig, positions_T: jax.Array) -> tuple:
    """((sin, cos), the sliding blocks' (sin, cos) or None) at the positions.

    Each table is T x E/2 (B x T x E/2 for positions per row); the second pair exists
    where the sliding blocks have a rotary base of their own (model.local_rope_theta).
    """

    def tables(local: bool) -> tuple[jax.Array, jax.Array]:
        frequencies = inverse_frequencies(config, local)
        angles_TxE2 = positions_T[..., None].astype(jnp.float32) * frequencies
        scale = 1.0 if local else attention_factor(config)
        return jnp.sin(angles_TxE2) * scale, jnp.cos(angles_TxE2) * scale

    return tables(False), tables(True) if config.local_rope_theta else None


def rotate_halves(x_BxTxHxE: jax.Array, sin_TxE2: jax.Array, cos_TxE2: jax.Array) -> jax.Array:
    """Rotary positions, HF's convention: the first and second half of a head form the pairs."""
    x = float32_island(x_BxTxHxE)
    first, second = jnp.split(x, 2, axis=-1)
    sin, cos = sin_TxE2[..., None, :], cos_TxE2[..., None, :]  # over the heads
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x_BxTxHxE.dtype)


def pairs_tables(
    positions_T: jax.Array, head_width: int, theta: float = 10000.0
) -> tuple[jax.Array, jax.Array]:
    """Sine and cosine tables (T x E/2, or B x T x E/2 for positions per row) at `positions_T`."""
    inverse_frequency = 1.0 / (theta ** (jnp.arange(0, head_width, 2) / head_width))
    angles_TxE2 = positions_T[..., None] * inverse_frequency
    return jnp.sin(angles_TxE2), jnp.cos(angles_TxE2)


def rotate_pairs(x_BxTxHxE: jax.Array, sin_TxE2: jax.Array, cos_TxE2: jax.Array) -> jax.Array:
    """Rotates pairs of features by position-dependent angles (computed in fp32).

    The features are the last axis, the positions the second; the axes between (heads, or
    queries-and-keys then heads) share the angles.
    """
    x = float32_island(x_BxTxHxE)
    even, odd = x[..., 0::2], x[..., 1::2]
    between = (1,) * (x.ndim - 3)  # the angles broadcast over the heads
    sin = sin_TxE2.reshape(*sin_TxE2.shape[:-1], *between, sin_TxE2.shape[-1])
    cos = cos_TxE2.reshape(*cos_TxE2.shape[:-1], *between, cos_TxE2.shape[-1])
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x_BxTxHxE.dtype)
