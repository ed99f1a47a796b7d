r"""Named activation-checkpointing (remat) policies, applied per transformer block.

Each policy says which of a block's intermediate values the backward pass finds saved; the
rest it recomputes from the block's input (which is always kept, by the scan over layers).

none           keep every activation. Fastest; use it whenever the batch fits.
full           keep only the block input, recompute the whole block in the backward pass
               (about one extra forward: ~33% more FLOPs). Least memory; use it for the
               largest models or batches, or when an OOM names activations.
dots           keep matmul outputs, recompute the cheap elementwise ops (norms, GELU,
               softmax). Most of `none`'s speed for much less memory: the first thing to try
               when `none` does not fit.
dots_no_batch  keep only matmuls without a batch dimension (weights x activations, not the
               attention scores): between dots and full.
minimal        keep the attention output and the MLP hidden activation of each block
               (tagged with checkpoint_name in the model), recompute the rest: close to
               full's memory at a smaller recompute cost.
offload_dots_no_batch   like dots_no_batch, but the saved values move to pinned host
               memory during the forward and come back for the backward: device memory
               of full, compute of dots_no_batch, paid in host-device bandwidth.
offload_minimal         like minimal, with the kept values offloaded to pinned host memory.

Inside every block, under any policy, the MLP's activation is `recomputed_activation`: its
backward recomputes it from its inputs (the matmul outputs, live anyway) rather than
keep what autodiff would save (GELU's tanh, a copy of x + bias).

Measured figures (compiled temporary memory, step time) are in benchmarks/RESULTS.md.

A model of one's own picks its blocks without edits: `remat.blocks=[blocks\\.\\d+]` names
them by module path, or the model wraps them itself with `paisoar_jax.remat_block(block)` (a
module, changed in place, or a function), which takes the run's remat.policy while the run
builds the model. Parameter paths stay as they were, so checkpoints and sharding rules do
not depend on remat.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx

from paisoar_jax.errors import UserError

# checkpoint_name tags the model puts on the values the `minimal` policy keeps.
SAVED_NAMES = ("attention_out", "mlp_hidden")

POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES),
    "offload_dots_no_batch": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host"
    ),
    "offload_minimal": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=SAVED_NAMES,
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


def wrap_block_call(block_call: Callable, policy_name: str, scanned: bool) -> Callable:
    """Wraps a block's forward function in jax.checkpoint with the named policy."""
    if policy_name == "none":
        return block_call
    # Under scan the loop already stops XLA from merging the recomputation back into the
    # forward pass, so the CSE barrier (which slows things down) is only needed unrolled.
    return jax.checkpoint(block_call, policy=POLICIES[policy_name], prevent_cse=not scanned)


@dataclasses.dataclass
class _Building:
    """The remat settings of the model being built, and how many blocks asked for them."""

    policy: str
    wrapped: int = 0


_BUILDING: contextvars.ContextVar[_Building | None] = contextvars.ContextVar(
    "paisoar_jax_remat", default=None
)
Target = TypeVar("Target")


def recomputed_activation(function: Callable, *inputs: jax.Array) -> jax.Array:
    """`function(*inputs)`, elementwise, whose backward recomputes it from `inputs` alone.

    Differentiated plainly, an activation keeps its own intermediates for the backward: GELU
    its tanh and its input plus the bias, SwiGLU its sigmoid, each a B x T x F tensor more
    written forward and read back, the widest of a block. Its inputs (the MLP's matmul
    outputs and the bias) are kept anyway, and one elementwise pass over them in the
    backward costs no more than reading a saved copy: GPT-2 on one H200 moves 2.4 GB less a
    step and holds 1.1 GiB fewer temporaries (plan --target h200). The values are the same.
    """
    return jax.checkpoint(function)(*inputs)


@contextlib.contextmanager
def building(policy_name: str) -> Iterator[_Building]:
    """While a run builds its model: `remat_block(block)` takes `policy_name`."""
    token = _BUILDING.set(_Building(policy_name))
    try:
        yield _BUILDING.get()
    finally:
        _BUILDING.reset(token)


def remat_block(target: Target, policy: str | None = None) -> Target:
    """Checkpoints a block with a named policy (default: the run's remat.policy).

    A module is changed in place (its class gains a checkpointed `__call__`; its
    parameters keep their paths) and returned; a function comes back wrapped. Under
    remat.policy=none (or outside a run with no policy given) the target is unchanged.

    Args:
        target: an nnx.Module (a block of the model) or a function.
        policy: a remat.policy name (`full`, `dots`, `minimal`, ...); None: the run's.

    Returns:
        `target`, checkpointed.

    Example:
        ```python
        import jax.numpy as jnp
        from flax import nnx

        import paisoar_jax


        class Tower(nnx.Module):
            def __init__(self, rngs):
                self.low = paisoar_jax.remat_block(nnx.Linear(64, 64, rngs=rngs))  # remat.policy
                top = nnx.Linear(64, 64, rngs=rngs)
                self.high = paisoar_jax.remat_block(top, policy="full")

            def __call__(self, x):
                return self.high(self.low(x))


        print(Tower(nnx.Rngs(0))(jnp.ones((2, 64))).shape)  # (2, 64)
        ```

    """
    context = _BUILDING.get()
    name = policy if policy is not None else (context.policy if context else "none")
    if name not in POLICIES:
        raise UserError(f"remat policy {name!r} is not one of {', '.join(POLICIES)}")
    if context is not None:
        context.wrapped += 1
    if name == "none":
        return target
    if isinstance(target, nnx.Module):
        if getattr(type(target), "_remat_policy", None) is None:
            target.__class__ = _checkpointed_class(type(target), name)
        return target
    return lambda *args, **kwargs: _checkpointed_call(target, name, args, kwargs)


def remat_blocks(model: nnx.Module, patterns: Sequence[str], policy_name: str) -> None:
    """Checkpoints every submodule whose dotted path a pattern is found in (re.search)."""
    modules = [(".".join(map(str, path)), module) for path, module in nnx.iter_modules(model)]
    chosen: dict[str, nnx.Module] = {}
    for pattern in patterns:
        matched = {path: module for path, module in modules if path and re.search(pattern, path)}
        if not matched:
            shown = ", ".join(path for path, _ in modules if path)[:200]
            raise UserError(f"remat.blocks: {pattern!r} matches no module (modules: {shown})")
        chosen.update(matched)
    # The outermost matches only: `blocks\.\d+` also finds blocks.0.mlp, whose checkpoint
    # inside block 0's would recompute it twice.
    for path, module in chosen.items():
        if not any(path.startswith(f"{outer}.") for outer in chosen):
            remat_block(module, policy_name)


_CLASSES: dict[tuple[type, str], type] = {}


def _checkpointed_class(cls: type, policy_name: str) -> type:
    """A subclass of `cls` whose `__call__` runs under jax.checkpoint (one per class)."""
    key = (cls, policy_name)
    if key not in _CLASSES:
        call = cls.__call__

        def checkpointed(self, *args, **kwargs):
            return _checkpointed_call(call, policy_name, (self, *args), kwargs)

        # The same metaclass and flags as `cls` (flax's pytree=False modules stay so).
        flags = {"pytree": cls._pytree__is_pytree} if hasattr(cls, "_pytree__is_pytree") else {}
        namespace = {
            "__call__": checkpointed,
            "__qualname__": cls.__qualname__,
            "_remat_policy": policy_name,
        }
        _CLASSES[key] = type(cls)(cls.__name__, (cls,), namespace, **flags)
    return _CLASSES[key]


def _is_traced(value: Any) -> bool:
    """Modules and trees of arrays go through the checkpoint; other values stay static."""
    if isinstance(value, nnx.Module):
        return True
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(isinstance(leaf, jax.Array | np.ndarray) for leaf in leaves)


def _checkpointed_call(function: Callable, policy_name: str, args: tuple, kwargs: dict):
    """function(*args, **kwargs) under nnx.remat; flags and other Python values closed over."""
    names = list(kwargs)
    values = [*args, *kwargs.values()]
    traced = [index for index, value in enumerate(values) if _is_traced(value)]

    def body(*traced_values):
        filled = list(values)
        for index, value in zip(traced, traced_values, strict=True):
            filled[index] = value
        positional, keyword = filled[: len(args)], filled[len(args) :]
        return function(*positional, **dict(zip(names, keyword, strict=True)))

    checkpointed = nnx.remat(body, policy=POLICIES[policy_name], prevent_cse=True)
    return checkpointed(*(values[index] for index in traced))
