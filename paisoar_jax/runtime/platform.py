"""The platform this process runs on, and the one a step is compiled for.

`choose_platform` runs where a run or a command starts (startup.py, the command line's
exit_status, the library's calls, Generator), never at import: on a machine with jax's
CUDA plugin (the gpu-aot extra) and no NVIDIA driver it picks the CPU before jax starts a
backend, so no run prints the plugin's driver error and traceback.

Model code that picks a kernel by platform (cuDNN attention on a GPU, fp32 attention for fp16
on a CPU) asks `compile_platform()`, not `jax.default_backend()`: `plan --target h200`
compiles on a CPU-only machine for compile-only GPU devices, and the step it builds must be
the one a GPU would run (tools/plan/gpu_target.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
from collections.abc import Iterator

import jax

CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
NVIDIA_DRIVER = "/proc/driver/nvidia/version"


def choose_platform() -> None:
    """The CPU for jax where its CUDA plugin is installed and no NVIDIA driver is.

    The plugin would otherwise call the driver when jax starts, print an error and a
    traceback in every run, and fall back to the CPU; with jax_platforms=cpu it loads
    quietly and still compiles for GPU targets (plan --target). A machine with a driver,
    or a platform the user chose (JAX_PLATFORMS or jax.config), is left as it is. It sets
    jax's config, not the environment, and only until jax's backends have started.
    """
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return
    if os.path.exists(NVIDIA_DRIVER):
        return
    try:
        installed = any(importlib.util.find_spec(name) for name in CUDA_PLUGINS)
    except (ImportError, ValueError):
        installed = False
    if installed:
        jax.config.update("jax_platforms", "cpu")


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("target", default=None)
# One of the target's devices, for code that asks a device what it is (a kernel library).
_TARGET_DEVICE: contextvars.ContextVar = contextvars.ContextVar("target_device", default=None)


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
    target = platform != jax.default_backend()
    token = _TARGET.set(platform if target else None)
    device_token = _TARGET_DEVICE.set(devices[0] if target else None)
    try:
        yield
    finally:
        _TARGET.reset(token)
        _TARGET_DEVICE.reset(device_token)


def target_device():
    """A device of the compile target (plan --target), or None when compiling for this one."""
    return _TARGET_DEVICE.get()


def is_target_compile_of(devices) -> bool:
    """Whether `devices` are a compile target's, not this process's (plan --target)."""
    return devices[0].platform != jax.default_backend()
