"""NVIDIA GPUs as compile targets on a machine without one (deviceless ahead-of-time compiles).

XLA compiles for a GPU it is told about: a `GpuTargetConfigProto` (the device's cores,
memory, bandwidth, caches, compute capability and cuDNN version) and a topology (hosts x
devices per host) give compile-only devices, and `jit(...).lower(...).compile()` on arrays
placed on them returns the GPU compiler's own program: its kernels (cuDNN attention, cuBLAS
or Triton gemms), its collectives and their schedule, and its buffer assignment (memory).
Nothing runs: no autotuning happens, so times read from it are estimates.

The targets are built here from each device's published figures (`DEVICES`, after XLA's
device specs), written in the proto's text form for the jaxlib in use. The CUDA plugin
(`pip install "paisoar-jax[gpu-aot]"`) must be installed; it loads without a driver only
in a CPU process (JAX_PLATFORMS=cpu), which every target compile is (plan sets it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paisoar_jax.errors import UserError
from paisoar_jax.tools.plan import gpu_kernels

INSTALL = 'pip install "paisoar-jax[gpu-aot]" (the CUDA plugin at your jax version)'


@dataclasses.dataclass(frozen=True)
class Device:
    """The published figures of one NVIDIA GPU that XLA's GPU compiler reads."""

    name: str
    memory_bytes: int  # device memory
    memory_bandwidth: float  # bytes/s
    cores: int  # streaming multiprocessors
    clock_ghz: float
    l2_bytes: int
    compute_capability: tuple[int, int]
    peak_bf16_tflops: float  # dense
    shared_memory_per_core: int = 233_472  # 228 KiB
    shared_memory_per_block_optin: int = 232_448  # 227 KiB


DEVICES = {
    "h200": Device(
        name="NVIDIA H200 141GB HBM3e",
        memory_bytes=151_397_597_184,
        memory_bandwidth=4.8e12,
        cores=132,
        clock_ghz=1.98,
        l2_bytes=50 * 2**20,
        compute_capability=(9, 0),
        peak_bf16_tflops=989.0,
    ),
    "h100": Device(
        name="NVIDIA H100 80GB HBM3",
        memory_bytes=84_942_979_072,
        memory_bandwidth=3.35e12,
        cores=132,
        clock_ghz=1.98,
        l2_bytes=50 * 2**20,
        compute_capability=(9, 0),
        peak_bf16_tflops=989.0,
    ),
}
CUDNN_VERSION = (9, 8, 0)  # what the target says it links: cuDNN flash attention needs >= 9


def target_config(device: Device) -> str:
    """The device as a GpuTargetConfigProto in text form."""
    major, minor = device.compute_capability
    cudnn_major, cudnn_minor, cudnn_patch = CUDNN_VERSION
    fields = {
        "threads_per_block_limit": 1024,
        "threads_per_warp": 32,
        "shared_memory_per_block": 49_152,
        "shared_memory_per_core": device.shared_memory_per_core,
        "threads_per_core_limit": 2048,
        "core_count": device.cores,
        "fpus_per_core": 128,
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65_535,
        "block_dim_limit_z": 65_535,
        "memory_bandwidth": int(device.memory_bandwidth),
        "l2_cache_size": device.l2_bytes,
        "clock_rate_ghz": device.clock_ghz,
        "device_memory_size": device.memory_bytes,
        "shared_memory_per_block_optin": device.shared_memory_per_block_optin,
        "registers_per_core_limit": 65_536,
        "registers_per_block_limit": 65_536,
    }
    lines = [f"  {key}: {value}" for key, value in fields.items()]
    lines.append(f"  cuda_compute_capability {{ major: {major} minor: {minor} }}")
    return "\n".join(
        [
            "gpu_device_info {",
            *lines,
            "}",
            'platform_name: "CUDA"',
            f"dnn_version_info {{ major: {cudnn_major} minor: {cudnn_minor} "
            f"patch: {cudnn_patch} }}",
            f'device_description_str: "{device.name}"',
        ]
    )


def target_devices(target: str, hosts: int, devices_per_host: int) -> list:
    """The compile-only devices of `hosts` x `devices_per_host` GPUs of kind `target`."""
    if target not in DEVICES:
        raise UserError(f"--target {target!r} is not one of {', '.join(DEVICES)}")
    if hosts < 1 or devices_per_host < 1:
        raise UserError(
            f"--hosts and --devices-per-host must be >= 1, got {hosts} and {devices_per_host}"
        )
    from jax.experimental import topologies

    try:
        import jax_plugins.xla_cuda12  # noqa: F401  (the plugin, found without loading jax's GPU)
    except ImportError:
        raise UserError(
            f"--target {target} compiles with the CUDA plugin, which is not installed: {INSTALL}"
        ) from None
    try:
        topology = topologies.get_topology_desc(
            platform="cuda",
            target_config=target_config(DEVICES[target]),
            topology=f"1x{hosts}x{devices_per_host}",
        )
    except Exception as error:  # a plugin not registered, or a proto it does not parse
        reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise UserError(
            f"--target {target}: the CUDA plugin cannot describe it ({reason}); "
            f"{INSTALL}, with JAX_PLATFORMS=cpu"
        ) from None
    return list(topology.devices)


def report(
    target: str, compiled: Any, memory_bytes: dict[str, int], limit_bytes: int | None = None
) -> dict[str, Any]:
    """What the GPU compiler made of a step for `target`: memory against the limit, kernels.

    `limit_bytes`: what the step must fit (train.memory_limit_gb); default the device's.
    """
    device = DEVICES[target]
    total = memory_bytes["total"]
    limit = limit_bytes or device.memory_bytes
    return {
        "name": target,
        "device": device.name,
        "device_memory_bytes": device.memory_bytes,
        "limit_bytes": limit,
        "fits": total <= limit,
        "memory_share": total / limit,
        **gpu_kernels.kernels(compiled.as_text()),
    }


def estimate(
    compiled: Any,
    target: str,
    flops: float,
    attention_flops: float,
    communication_s: float,
    efficiency: float,
) -> dict[str, Any]:
    """An estimated step time and MFU on `target` from the GPU program's kernels (not a run).

    A roofline over the compiled kernels (gpu_kernels.roofline_seconds): gemms at
    `efficiency` of the device's dense bf16 peak, other kernels at its memory bandwidth,
    cuDNN attention as `attention_flops` (per device) and cuDNN convolutions as the FLOPs of
    the step (`flops`) the rest leave, both at `efficiency` of the peak; the
    collectives (`communication_s`, plan's link model) overlap the compute, as the GPU
    program schedules them (async), so the step is the longer of the two. XLA's own cost
    model prices kernels that were never tuned far off (a 3 MB reduction at 0.2 ms, the 124M
    model's logits gemm at 14 ms): its prices are not used.
    """
    device = DEVICES[target]
    peak = device.peak_bf16_tflops * 1e12
    kernels = gpu_kernels.roofline_seconds(
        compiled.as_text(), peak * efficiency, device.memory_bandwidth
    )
    attention_s = attention_flops / (peak * efficiency)
    # Convolutions: the model's FLOPs the gemms and attention leave (an image model's).
    convolution_flops = max(flops - kernels["gemm_flops"] - attention_flops, 0.0)
    convolution_s = convolution_flops / (peak * efficiency) if kernels["convolutions"] else 0.0
    compute_s = kernels["gemm_s"] + kernels["memory_bound_s"] + attention_s + convolution_s
    step_s = max(compute_s, communication_s)
    return {
        "step_s": step_s,
        **kernels,
        "attention_s": attention_s,
        "convolution_s": convolution_s,
        "communication_s": communication_s,
        "efficiency": efficiency,
        "mfu": flops / (step_s * peak) if step_s > 0 else None,
    }


def schedule_summary(result: dict[str, Any]) -> dict[str, Any]:
    """A target plan's schedule in a few numbers (what --flag-effects compares).

    Collectives per step by kind, the async ones and how many overlap compute, the
    temporaries and the estimated step.
    """
    found = result["target"]
    collectives = found["collectives"]
    return {
        "collectives_per_step": {
            kind: totals["count"] for kind, totals in result["collectives"].items()
        },
        "async": len(collectives),
        "overlapped": sum(row["overlapped"] for row in collectives),
        "temporaries_bytes": result["memory_bytes"]["temporaries"],
        "estimated_step_s": found["estimate"]["step_s"],
    }


def flag_lines(found: dict[str, Any]) -> list[str]:
    """The XLA flags of the GPU compile, and with --flag-effects what they change."""
    from paisoar_jax.engine.memory import format_bytes

    lines = ["XLA flags for the GPU (paisoar_jax/runtime/gpu_flags.py; XLA_FLAGS wins)"]
    for row in found.get("xla_flags", []):
        lines.append(f"  {row['flag']}={row['value']}  ({row['set_by']})")
    effects = found.get("flag_effects")
    if effects:
        ours, theirs = effects["library"], effects["xla"]
        kinds = sorted(ours["collectives_per_step"].keys() | theirs["collectives_per_step"].keys())
        counts = ", ".join(
            f"{kind} {theirs['collectives_per_step'].get(kind, 0)} -> "
            f"{ours['collectives_per_step'].get(kind, 0)}"
            for kind in kinds
        )
        lines += [
            "  effect, XLA's own thresholds -> the library's (compiled both ways):",
            f"    collectives per step: {counts}",
            f"    async {theirs['async']} -> {ours['async']} (overlapping compute "
            f"{theirs['overlapped']} -> {ours['overlapped']}), temporaries "
            f"{format_bytes(theirs['temporaries_bytes'])} -> "
            f"{format_bytes(ours['temporaries_bytes'])}, estimated step "
            f"{_ms(theirs['estimated_step_s'])} -> {_ms(ours['estimated_step_s'])} "
            "(bandwidth only: fewer launches do not show in it)",
        ]
    return lines


def target_of(device_kind: str) -> str | None:
    """The target a real device is (an "NVIDIA H200" is h200), or None for any other."""
    for name in DEVICES:
        if name.upper() in device_kind.upper().split():
            return name
    return None


def step_estimate(
    compiled: Any,
    target: str,
    task: Any,
    param_count: int,
    global_batch: int,
    device_count: int,
    communication_s: float,
    efficiency: float,
) -> dict[str, Any]:
    """`estimate` for a task's step: its FLOPs per device from the task's count per unit.

    Attention counts apart (at the given efficiency) only where cuDNN runs it; XLA's own
    attention is in the kernels' roofline with the rest.
    """
    units = global_batch * task.units_per_example() / device_count
    # A model of one's own without flops_per_example: compute time unknown, counted as 0.
    flops_per_unit = task.flops_per_unit(param_count) or 0.0
    attention_flops = flops_per_unit - 6 * param_count if task.unit == "tokens" else 0.0
    if gpu_kernels.kernels(compiled.as_text())["attention"] != "cudnn":
        attention_flops = 0.0
    return estimate(
        compiled,
        target,
        flops_per_unit * units,
        max(attention_flops, 0.0) * units,
        communication_s,
        efficiency,
    )


def report_lines(found: dict[str, Any]) -> list[str]:
    """The target part of plan's table: whether the step fits, then its kernels."""
    from paisoar_jax.engine.memory import format_bytes

    verdict = "fits" if found["fits"] else "does NOT fit"
    limit = found.get("limit_bytes", found["device_memory_bytes"])
    of_what = "" if limit == found["device_memory_bytes"] else " (train.memory_limit_gb)"
    lines = [
        "",
        f"GPU target {found['name']} ({found['device']}), compiled, not run: the step "
        f"{verdict} ({found['memory_share']:.0%} of {format_bytes(limit)}{of_what} per device)",
    ]
    if found.get("fixes"):
        lines.append("  fixes, in the order to try them (--fit compiles each and picks one):")
        lines += [f"    {row['override']}  {row['why']}" for row in found["fixes"]]
    if estimate := found.get("estimate"):
        mfu = f", MFU {estimate['mfu']:.0%}" if estimate["mfu"] is not None else ""
        lines += [
            f"estimated step (a roofline of the GPU program's kernels, not a run) "
            f"{_ms(estimate['step_s'])}{mfu}",
            f"  gemms {_ms(estimate['gemm_s'])}, attention {_ms(estimate['attention_s'])} and "
            f"convolutions {_ms(estimate['convolution_s'])} at {estimate['efficiency']:.0%} of "
            f"peak, other kernels "
            f"{_ms(estimate['memory_bound_s'])} at full bandwidth; collectives "
            f"{_ms(estimate['communication_s'])}, overlapped",
        ]
    return lines + gpu_kernels.summary_lines(found) + flag_lines(found)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
