"""The platform a step is compiled for: this process's devices, or a GPU target without one.

Model code that picks a kernel by platform (cuDNN attention on a GPU, fp32 attention for fp16
on a CPU) asks `compile_platform()`, not `jax.default_backend()`: `plan --target h200`
compiles on a CPU-only machine for compile-only GPU devices, and the step it builds must be
the one a GPU would run (tools/gpu_target.py).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("target", default=None)


def compile_platform() -> str:
    """The platform compiled for (gpu, cpu, tpu): the target's, else this process's backend."""
    return _TARGET.get() or jax.default_backend()


def is_target_compile() -> bool:
    """Whether the step is being compiled for devices this process does not have."""
    return _TARGET.get() is not None


@contextlib.contextmanager
def compiling_for(devices) -> Iterator[None]:
    """Inside: model code builds for the platform of `devices` (a target's, or this one's)."""
    platform = devices[0].platform
    token = _TARGET.set(platform if platform != jax.default_backend() else None)
    try:
        yield
    finally:
        _TARGET.reset(token)


def is_target_compile_of(devices) -> bool:
    """Whether `devices` are a compile target's, not this process's (plan --target)."""
    return devices[0].platform != jax.default_backend()
