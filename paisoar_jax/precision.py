"""Mixed-precision policies: which dtype params are stored in and which dtype math runs in.

Params stay fp32 (the master weights); a module casts them to `compute_dtype` where it uses
them. Layer norm, attention logits and softmax, the final logits (unless
model.fp32_logits=false) and the loss run in fp32 whatever the policy. fp8 is bf16 with the
transformer blocks' matmuls in fp8 (fp8.py). To keep more in fp32 (what PyTorch's
autocast(enabled=False) or custom_fwd do):

- a function: decorate it with `@fp32_function`; its floating inputs arrive in fp32;
- a submodule: `force_policy(model.blocks, "fp32")` before training (for a model of one's
  own, in the factory given to fit); every module under it computes in fp32 from then on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from paisoar_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes for parameter storage, compute and module outputs."""

    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    output_dtype: jnp.dtype = jnp.float32
    # The transformer blocks' matmuls in fp8 with delayed scaling (fp8.py); the rest of the
    # math in compute_dtype.
    fp8: bool = False

    def cast_to_compute(self, x: jax.Array) -> jax.Array:
        """Casts a floating array to the compute dtype (integers pass unchanged)."""
        return x.astype(self.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x


PRESETS = {
    "fp32": Policy(),
    "bf16": Policy(compute_dtype=jnp.bfloat16),
    "fp16": Policy(compute_dtype=jnp.float16),
    "fp8": Policy(compute_dtype=jnp.bfloat16, fp8=True),
}


def get_policy(name: str) -> Policy:
    """The preset policy called `name` (fp32, bf16, fp16, fp8)."""
    if name not in PRESETS:
        raise UserError(f"precision.policy={name!r} is not one of {', '.join(PRESETS)}")
    return PRESETS[name]


def fp32_function(function: Callable) -> Callable:
    """Decorator: runs `function` with every floating array argument cast to fp32."""

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        cast = lambda x: float32_island(x) if _is_floating_array(x) else x
        return function(*jax.tree.map(cast, args), **jax.tree.map(cast, kwargs))

    return wrapped


def _is_floating_array(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def force_policy(module, name: str) -> None:
    """Makes `module` and every module under it compute with the preset policy `name`."""
    policy = get_policy(name)
    for _, submodule in nnx.iter_modules(module):
        # The zoo's modules read `policy`; in a model of one's own it marks the weights the
        # step casts to this policy's dtype (state.compute_casts). Another `policy` stays.
        if isinstance(submodule, nnx.Dict):  # an attribute of a Dict is one of its entries
            continue
        if isinstance(getattr(submodule, "policy", None), Policy | None):
            submodule.policy = policy


def float32_island(x: jax.Array) -> jax.Array:
    """Casts to fp32 for a numerically sensitive op (norms, softmax, logits, loss)."""
    return x.astype(jnp.float32)
