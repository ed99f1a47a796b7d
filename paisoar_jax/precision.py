"""Mixed-precision policies: which dtype params are stored in and which dtype math runs in.

Params stay fp32 (the master weights); a module casts them to `compute_dtype` where it uses
them. Layer norm, attention softmax, the final logits and the loss run in fp32 whatever the
policy (the model does that explicitly with `float32_island`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paisoar_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes for parameter storage, compute and module outputs."""

    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    output_dtype: jnp.dtype = jnp.float32

    def cast_to_compute(self, x: jax.Array) -> jax.Array:
        """Casts a floating array to the compute dtype (integers pass unchanged)."""
        return x.astype(self.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x


PRESETS = {
    "fp32": Policy(),
    "bf16": Policy(compute_dtype=jnp.bfloat16),
}


def get_policy(name: str) -> Policy:
    """The preset policy called `name` (fp32, bf16)."""
    if name not in PRESETS:
        raise UserError(f"precision.policy={name!r} is not one of {', '.join(PRESETS)}")
    return PRESETS[name]


def float32_island(x: jax.Array) -> jax.Array:
    """Casts to fp32 for a numerically sensitive op (norms, softmax, logits, loss)."""
    return x.astype(jnp.float32)
