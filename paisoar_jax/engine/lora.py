"""LoRA: low-rank adapters on a model's projections, every other weight frozen.

A projection y = x W that a `lora.targets` regex names gains y += (alpha / r) dropout(x) A B,
with A (W's input axes x r) and B (r x W's output axes) in fp32, A drawn as PEFT draws it
and B zero, so training starts from the base model's outputs. The adapter runs on the
activations, never as W + A B: the frozen W then gets no gradient, so the backward pass
skips its weight gradient (a third of a dense step's FLOPs) and builds no weight-sized
buffer.

Where adapters go (`add_adapters`, run on the traced model after it is built):
- a zoo decoder block's projections, those in its `LORA_KERNELS` table: the adapter of
  `q_kernel` is the block's `q_kernel_lora`, which the block's `_project` adds;
- an `nnx.Linear` of a model of one's own: its class gains the adapter (`kernel_lora`) in
  its call, its parameters stay where they were.
Stacked blocks (model.scan_layers) get stacked adapters, a leading `layers` axis, so the
scan and a pipeline slice them per layer as they slice the kernels.

What trains: the adapters' `LoraParam`s (`trainable_paths`). The state keeps every parameter
in one dict; the step differentiates and updates only the trainable part (`split`, `join`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
import string
import zlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

from paisoar_jax.config import LoraConfig
from paisoar_jax.errors import UserError


class LoraParam(nnx.Param):
    """An adapter's weight: what a LoRA run trains (every other nnx.Param is frozen)."""


# The step's random key while it computes the loss (`dropout_key`); None outside it (eval,
# decoding), where dropout is off.
_DROPOUT_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "lora_dropout_key", default=None
)


@contextlib.contextmanager
def dropout_key(key: jax.Array) -> Iterator[None]:
    """The adapters draw their dropout masks from `key` inside this block."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


class Adapter(nnx.Module):
    """A and B of one projection, and the product they add to its output."""

    def __init__(
        self,
        kernel: nnx.Param,
        input_axes: int,
        settings: LoraConfig,
        key: jax.Array,
    ):
        names = kernel.get_metadata().get("out_sharding") or (None,) * kernel.ndim
        stacked = 1 if names[0] == "layers" else 0
        inputs = kernel.shape[stacked : stacked + input_axes]
        outputs = kernel.shape[stacked + input_axes :]
        layers, rank = kernel.shape[:stacked], settings.rank
        # PEFT's draw: kaiming_uniform(a=sqrt(5)) over the fan-in, U(-1/sqrt(in), 1/sqrt(in)).
        bound = 1 / math.sqrt(math.prod(inputs))
        a_value = jax.random.uniform(key, (*layers, *inputs, rank), jnp.float32, -bound, bound)
        a_names = (*names[: stacked + input_axes], None)
        b_names = (*names[:stacked], None, *names[stacked + input_axes :])
        self.a = LoraParam(a_value, out_sharding=a_names)
        self.b = LoraParam(jnp.zeros((*layers, rank, *outputs), jnp.float32), out_sharding=b_names)
        self.scale = settings.alpha / rank
        self.dropout = settings.dropout

    def __call__(self, equation: str, x: jax.Array) -> jax.Array:
        """Scale x dropout(x) A B, shaped as `einsum(equation, x, kernel)` is, in x's dtype.

        `equation` is the projection's: x's last axes contracted with the kernel's first
        ones, the rest kept in order (fp8.matmul's form).
        """
        inputs, output = equation.split("->")
        x_axes, kernel_axes = inputs.split(",")
        input_axes = self.a.ndim - 1
        free = x_axes[: len(x_axes) - input_axes]
        rank = next(letter for letter in string.ascii_letters if letter not in equation)
        a, b = self.a[...].astype(x.dtype), self.b[...].astype(x.dtype)
        key = _DROPOUT_KEY.get()
        if self.dropout and key is not None:
            # Each layer of a stack runs this same traced code, so the mask's key also takes
            # bits of this layer's A (drawn apart per layer): independent masks per layer.
            salt = jax.lax.bitcast_convert_type(
                jax.lax.stop_gradient(self.a[...].reshape(-1)[0]), jnp.int32
            )
            keep = jax.random.bernoulli(jax.random.fold_in(key, salt), 1 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1 - self.dropout), 0).astype(x.dtype)
        low = jnp.einsum(f"{x_axes},{kernel_axes[:input_axes]}{rank}->{free}{rank}", x, a)
        out = jnp.einsum(f"{free}{rank},{rank}{kernel_axes[input_axes:]}->{output}", low, b)
        return out * jnp.asarray(self.scale, out.dtype)


def add(module: nnx.Module, kernel_name: str, equation: str, x: jax.Array, y: jax.Array):
    """`y` (the projection `kernel_name` of `x`) plus its adapter's output, if it has one."""
    adapter = getattr(module, f"{kernel_name}_lora", None)
    return y if adapter is None else y + adapter(equation, x).astype(y.dtype)


_LINEAR_CLASSES: dict[type, type] = {}


def _adapted_linear(cls: type) -> type:
    """A subclass of the nnx.Linear class `cls` whose call adds its `kernel_lora`."""
    if cls not in _LINEAR_CLASSES:
        call = cls.__call__

        def call_with_adapter(self, inputs, *args, **kwargs):
            y = call(self, inputs, *args, **kwargs)
            return add(self, "kernel", "...i,io->...o", inputs.astype(y.dtype), y)

        # The same metaclass and flags as `cls` (flax's pytree=False modules stay so).
        flags = {"pytree": cls._pytree__is_pytree} if hasattr(cls, "_pytree__is_pytree") else {}
        namespace = {"__call__": call_with_adapter, "__qualname__": cls.__qualname__}
        _LINEAR_CLASSES[cls] = type(cls)(cls.__name__, (cls,), namespace, **flags)
    return _LINEAR_CLASSES[cls]


def adaptable(model: nnx.Module) -> dict[str, tuple[nnx.Module, str, int]]:
    """{dotted kernel path: (its module, its attribute, its input axes)} LoRA can adapt.

    A zoo block's kernels in its LORA_KERNELS table; the kernel of every nnx.Linear.
    """
    found = {}
    for path, module in nnx.iter_modules(model):
        prefix = "".join(f"{part}." for part in path)
        if isinstance(module, nnx.Linear):
            found[f"{prefix}kernel"] = (module, "kernel", 1)
        for name, input_axes in getattr(module, "LORA_KERNELS", {}).items():
            if getattr(module, name, None) is not None:
                found[f"{prefix}{name}"] = (module, name, input_axes)
    return found


def add_adapters(model: nnx.Module, settings: LoraConfig, seed: int) -> list[str]:
    """Gives each projection a target names an adapter; returns their kernels' paths.

    Empty `settings.targets`: every projection of a zoo model's table. One line (UserError)
    for a target that matches no projection, or a model with none to adapt.
    """
    candidates = adaptable(model)
    zoo = any(hasattr(module, "LORA_KERNELS") for _, module in nnx.iter_modules(model))
    if not settings.targets and not zoo:
        raise UserError(
            "lora.targets is needed for a model of your own: regexes of the nnx.Linear "
            f"kernels to adapt ({_listing(candidates)})"
        )
    aliases = peft_aliases(model)
    chosen = {}
    for pattern in settings.targets or (".",):
        regex = aliases.get(pattern, pattern)
        matched = {path: found for path, found in candidates.items() if re.search(regex, path)}
        if not matched:
            named = f"; or PEFT's names: {', '.join(sorted(aliases))}" if aliases else ""
            raise UserError(
                f"lora.targets: {pattern!r} matches no projection LoRA can adapt "
                f"({_listing(candidates)}{named})"
            )
        chosen.update(matched)
    for path, (module, name, input_axes) in sorted(chosen.items()):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), zlib.crc32(path.encode()))
        # The logical axis names are metadata: the trainer gives jit the shardings.
        with nnx.use_eager_sharding(False):
            adapter = Adapter(getattr(module, name), input_axes, settings, key)
        setattr(module, f"{name}_lora", adapter)
        if isinstance(module, nnx.Linear) and type(module) not in _LINEAR_CLASSES.values():
            module.__class__ = _adapted_linear(type(module))
    return sorted(chosen)


def peft_aliases(model: nnx.Module) -> dict[str, str]:
    """{PEFT module name: the regex of our kernels it stands for} of a zoo model's blocks.

    PEFT's target_modules name transformers' modules (`q_proj`, GPT-2's `c_attn`) and
    `all-linear`; a zoo block's PEFT_NAMES table says which of its kernels each one is. A
    model of one's own names its own modules, so it has none.
    """
    aliases = {}
    for _, module in nnx.iter_modules(model):
        for name, kernels in getattr(module, "PEFT_NAMES", {}).items():
            aliases[name] = rf"(^|\.)({'|'.join(kernels)})$"
    return aliases | {"all-linear": "."} if aliases else {}


def _listing(candidates: dict) -> str:
    if not candidates:
        return "this model has none: LoRA adapts nnx.Linear layers and the zoo's decoders"
    shown = ", ".join(sorted(candidates))
    return f"those are: {shown[:300]}{'...' if len(shown) > 300 else ''}"


def trainable_paths(abstract_variables: nnx.State) -> frozenset[tuple]:
    """The key paths (in the params' pure dict) of the adapters' weights."""
    adapters = nnx.to_pure_dict(abstract_variables.filter(LoraParam))
    return frozenset(traverse_util.flatten_dict(adapters))


def split(params: dict, trainable: frozenset[tuple]) -> tuple[dict, dict]:
    """(the trainable leaves, the frozen ones) of `params`, each a nested dict of its own."""
    flat = traverse_util.flatten_dict(params)
    chosen = {path: leaf for path, leaf in flat.items() if path in trainable}
    rest = {path: leaf for path, leaf in flat.items() if path not in trainable}
    return traverse_util.unflatten_dict(chosen), traverse_util.unflatten_dict(rest)


def join(trainable: dict, frozen: dict) -> dict:
    """The params again from `split`'s two parts."""
    flat = traverse_util.flatten_dict(frozen) | traverse_util.flatten_dict(trainable)
    return traverse_util.unflatten_dict(flat)
