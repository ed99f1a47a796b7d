"""The plan's numbers: one train step compiled from abstract arrays, and what it holds and moves.

`plan(config, devices)` compiles the step for the config's mesh (no weights are ever built)
and returns, per device, the bytes of params, optimizer state and gradients, XLA's account
of the compiled step, the collectives it runs (tools/plan/hlo.py) and a projected step time on a
link; with `target`, what the GPU compiler made of it (tools/plan/gpu_target.py). The model of
time and its limits are in the package's docstring (tools/plan/__init__.py).
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from paisoar_jax import output
from paisoar_jax.config import Config
from paisoar_jax.engine.memory import MemorySettings, memory
from paisoar_jax.errors import UserError
from paisoar_jax.run.oom import memory_fixes
from paisoar_jax.runtime import gpu_flags
from paisoar_jax.tools.plan import context_split, fit_search, gpu_target, hlo, reports

# Per-direction bandwidth of one device's link, GB/s (1e9 bytes/s).
# NVLink 4: 900 GB/s both ways; NDR InfiniBand: 400 Gb/s; Ethernet: its line rate.
LINKS = {"1gbe": 0.125, "10gbe": 1.25, "100gbe": 12.5, "infiniband": 50.0, "nvlink": 450.0}
GRAD_COMMS = ("fp32", "bf16", "int8")
DEFAULT_PEAK_TFLOPS = 989.0  # H200 / H100 SXM dense bf16, for plans made off the GPU
DEFAULT_EFFICIENCY = 0.5


def memory_settings(config: Config) -> MemorySettings:
    """The sections of `config` the out-of-memory fixes read (run/oom.py)."""
    own_model = config.model.name == "custom"
    return MemorySettings(config.mesh, config.train, config.precision, config.remat, own_model)


def parse_link(text: str) -> tuple[str, float]:
    """`nvlink`, `infiniband` or a bandwidth in GB/s -> (name, GB/s per direction)."""
    if text in LINKS:
        return text, LINKS[text]
    try:
        bandwidth = float(text.removesuffix("GB/s").strip())
    except ValueError:
        bandwidth = 0.0
    if not math.isfinite(bandwidth) or bandwidth <= 0:
        names = ", ".join(LINKS)
        raise UserError(f"--link {text!r} is not one of {names} or a bandwidth in GB/s > 0")
    return f"{bandwidth:g} GB/s", bandwidth


def parse_fraction(text: str) -> float:
    """--efficiency as a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise UserError(f"--efficiency must be a number in (0, 1], got {text!r}")
    return value


def request_cpu_devices(count: int) -> None:
    """Asks for `count` CPU devices (and no GPU) while XLA has not started its backend."""
    if "jax" not in sys.modules:  # XLA reads its flags when the backend starts
        flags = os.environ.get("XLA_FLAGS", "")
        flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", flags)
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"
        os.environ["JAX_PLATFORMS"] = "cpu"  # a CPU plan takes no GPU memory
        return
    import jax

    try:  # before the backend starts this wins over XLA_FLAGS (and PAISOAR_CPU_DEVICES)
        jax.config.update("jax_num_cpu_devices", count)
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass  # started already: cpu_devices() tells the user if it has the wrong count


def cpu_devices(count: int) -> list:
    """The `count` simulated CPU devices, or one line saying why this process has others."""
    import jax

    request_cpu_devices(count)  # again: distributed.initialize may have set another count
    devices = jax.devices("cpu")
    if len(devices) != count:
        raise UserError(
            f"--devices {count}: jax already started in this process with {len(devices)} CPU "
            "devices; run plan in a fresh process"
        )
    return devices


def compile_step(
    config: Config, devices: Sequence, workload: Any = None
) -> tuple[Any, Any, Any, float]:
    """(compiled step, layout, mesh, seconds to compile) for the config on `devices`.

    `workload`: a model of one's own (workload.Workload, as `paisoar_jax.fit` builds it);
    default: the config's zoo model.
    """
    import jax

    from paisoar_jax.parallel import sharding
    from paisoar_jax.run.setup import setup
    from paisoar_jax.runtime.platform import compiling_for, is_target_compile_of
    from paisoar_jax.tasks.zoo import zoo_workload

    train = config.train
    workload = zoo_workload(config) if workload is None else workload
    start = time.perf_counter()
    with compiling_for(devices):  # a GPU target's devices: build the GPU's step
        run = setup(config, workload, devices)
    mesh, layout, task = run.mesh, run.layout, run.task
    with jax.set_mesh(mesh), compiling_for(devices):
        batch = jax.tree.map(
            lambda shape: jax.ShapeDtypeStruct(
                shape.shape, shape.dtype, sharding=sharding.batch_sharding(mesh)
            ),
            task.batch_shape(train.global_batch),
        )
        step = run.jit_train_step()  # (setup chose the XLA options for these devices)
        lowered = step.lower(layout.abstract_state, batch)
        try:
            compiled = lowered.compile()
        except Exception as error:
            # Without a device nothing is autotuned, and XLA may find no Triton tiling for
            # an odd gemm (ViT-B/16's 197 tokens: "Couldn't find output tile sizes");
            # cuBLAS takes any shape.
            if not (is_target_compile_of(devices) and "tile sizes" in str(error)):
                raise
            output.warning(
                "the GPU compiler found no Triton tiling for a gemm without autotuning: "
                "compiled with cuBLAS gemms (xla_gpu_enable_triton_gemm=false)"
            )
            compiled = lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False})
    return compiled, layout, mesh, time.perf_counter() - start


def peak_tflops(config: Config, simulated: bool, target: str | None = None) -> tuple[float, str]:
    """The per-device peak and where it came from (config, target, device kind, or default)."""
    import jax

    from paisoar_jax.observe.metrics import device_peak_tflops

    if config.train.peak_tflops > 0:
        return config.train.peak_tflops, "train.peak_tflops"
    if target is not None:
        return gpu_target.DEVICES[target].peak_bf16_tflops, f"{target} dense bf16"
    known = None if simulated else device_peak_tflops()
    if known:
        return known, jax.devices()[0].device_kind
    platform = "simulated cpu" if simulated else jax.devices()[0].device_kind
    return DEFAULT_PEAK_TFLOPS, f"assumed H200 dense bf16 ({platform} has no known peak)"


def plan(
    config: Config,
    devices: Sequence,
    link: tuple[str, float] = ("nvlink", LINKS["nvlink"]),
    efficiency: float = DEFAULT_EFFICIENCY,
    simulated: bool = False,
    workload: Any = None,
    target: str | None = None,
) -> dict[str, Any]:
    """Every number of the plan, as one JSON-ready dict (`simulated`: --devices was given).

    `workload`: a model of one's own, as for compile_step; default: the config's zoo model.
    `target`: the devices are a GPU target's (gpu_target.target_devices): the plan adds
    what the GPU compiler made of the step (`"target"`).
    """
    return plan_and_collectives(config, devices, link, efficiency, simulated, workload, target)[0]


def plan_and_collectives(config, devices, link, efficiency, simulated, workload, target=None):
    """(plan, the step's collectives as hlo.Collective): see `plan`."""
    from paisoar_jax.parallel import rules
    from paisoar_jax.tasks.zoo import zoo_workload

    workload = zoo_workload(config) if workload is None else workload
    task = workload.task
    if target is None and devices[0].platform == "gpu":  # on a known GPU: its own report
        target = gpu_target.target_of(devices[0].device_kind)
    compiled, layout, mesh, compile_s = compile_step(config, devices, workload)
    found_collectives, unknown_loops = hlo.analyze(compiled.as_text(), len(devices))
    link_name, gb_per_s = link
    by_kind = hlo.totals_by_kind(found_collectives, gb_per_s)
    model, train = config.model, config.train
    units_per_step = train.global_batch * task.units_per_example()
    # A model of one's own without flops_per_example: compute time unknown, counted as 0.
    flops_per_unit = task.flops_per_unit(layout.flops_param_count) or 0.0
    flops = flops_per_unit * units_per_step / len(devices)
    peak, peak_source = peak_tflops(config, simulated, target)
    # A pipeline's stages idle for its bubble: the step takes 1 / (1 - bubble) its compute.
    pipeline_schedule = layout.pipeline
    bubble = pipeline_schedule.bubble if pipeline_schedule else 0.0
    busy_s = flops / (peak * 1e12 * efficiency)
    timing = step_times(by_kind, busy_s, bubble)
    memory_bytes = memory(layout, compiled)
    found = {}
    if target is not None:
        communication = timing["time_s"]["communication"]
        report = _target_report(
            config, target, compiled, memory_bytes, layout, task, mesh, communication, efficiency
        )
        found = {"target": report}
    elif devices[0].platform == "cpu":  # the CPU's own estimate, judged as a target's is
        found = {"memory_verdict": cpu_verdict(config, memory_bytes["total"], len(devices), mesh)}
    return {
        "model": model.name,
        "param_count": layout.param_count,
        "trainable_count": layout.trainable_count,
        "precision": config.precision.policy,
        "mesh": {axis: int(size) for axis, size in mesh.shape.items()},
        "zero": config.mesh.zero,
        "devices": len(devices),
        "platform": devices[0].platform,
        "simulated": simulated,
        "global_batch": train.global_batch,
        **task.signature(),  # seq_len, or image size and channels
        "unit": task.unit,
        "grad_accum": train.grad_accum,
        "compile_s": round(compile_s, 2),
        "memory_bytes": memory_bytes,
        "parameters": [
            {"path": path, "shape": list(shape), "sharding": where}
            for path, shape, where in rules.describe(
                layout.abstract_state.params, layout.shardings.params
            )
        ],
        **_collectives(found_collectives, by_kind, gb_per_s, unknown_loops),
        "pipeline": reports.pipeline_report(pipeline_schedule, by_kind),
        "experts": reports.experts_report(model, layout, mesh, by_kind),
        "context": context_split.context_report(
            config, dict(mesh.shape), devices[0].platform, gb_per_s, peak * efficiency
        ),
        "link": {"name": link_name, "gb_per_s": gb_per_s},
        "peak_tflops": peak,
        "peak_source": peak_source,
        "efficiency": efficiency,
        "flops_per_device": flops,
        "busy_s": busy_s,
        "bubble": bubble,
        "grad_comm": config.mesh.grad_comm if layout.exchange else "fp32",
        **timing,
        **found,
    }, found_collectives


def cpu_verdict(config: Config, needed: int, devices: int, mesh: Any) -> dict[str, Any]:
    """Whether the step fits train.memory_limit_gb, else this host's memory over its devices.

    Simulated CPU devices share the host's memory, so each may hold its share of it. The
    fixes are the out-of-memory report's, in its order; the numbers are the CPU
    compiler's (a GPU's differ: plan --target compiles for one).
    """
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # a system without sysconf's page counts
        total = 0
    if config.train.memory_limit_gb > 0:
        limit, source = int(config.train.memory_limit_gb * 2**30), "train.memory_limit_gb"
    elif not total:
        limit, source = needed, "no limit known (set train.memory_limit_gb)"
    else:
        limit, source = total // max(devices, 1), f"this host's memory over {devices} device(s)"
    verdict = {"needed_bytes": needed, "limit_bytes": limit, "limit_source": source}
    verdict["fits"] = needed <= limit
    fixes = [] if verdict["fits"] else memory_fixes(memory_settings(config), dict(mesh.shape))
    verdict["fixes"] = [{"override": override, "why": why} for override, why in fixes]
    return verdict


def _target_report(
    config, target, compiled, memory_bytes, layout, task, mesh, communication_s, efficiency
) -> dict[str, Any]:
    """What the GPU compiler made of the step for `target`.

    Whether it fits (and the fixes to try when not), its kernels, the estimated step and
    the XLA flags the library set.
    """
    limit = fit_search.limit_bytes(config, gpu_target.DEVICES[target].memory_bytes)
    report = gpu_target.report(target, compiled, memory_bytes, limit)
    if not report["fits"]:  # what to try, in order (--fit compiles each)
        report["fixes"] = [
            {"override": override, "why": why}
            for override, why in memory_fixes(memory_settings(config), dict(mesh.shape))
        ]
    estimate = gpu_target.step_estimate(
        compiled,
        target,
        task,
        layout.flops_param_count,
        config.train.global_batch,
        mesh.size,
        communication_s,
        efficiency,
    )
    flags = gpu_flags.describe(config.mesh.bucket_mb)
    return report | {"estimate": estimate, "xla_flags": flags}


def step_times(by_kind: dict[str, dict], busy_s: float, bubble: float) -> dict[str, Any]:
    """Compute, communication and step time from a step's collectives timed on one link.

    `by_kind`: hlo.totals_by_kind with a bandwidth; `busy_s`: the compute without the
    pipeline `bubble`, which is lost time too.
    """
    compute_s = busy_s / (1 - bubble)
    communication_s = sum(totals.get("seconds", 0.0) for totals in by_kind.values())
    no_overlap_s = compute_s + communication_s
    overlap_s = max(compute_s, communication_s)
    return {
        "time_s": {
            "compute": compute_s,
            "communication": communication_s,
            "step_no_overlap": no_overlap_s,
            "step_perfect_overlap": overlap_s,
        },
        "scaling_efficiency": {
            # The share of the step the devices compute.
            "no_overlap": busy_s / no_overlap_s if no_overlap_s else 1.0,
            "perfect_overlap": busy_s / overlap_s if overlap_s else 1.0,
        },
    }


def _collectives(found: list, by_kind: dict, gb_per_s: float, unknown_loops) -> dict[str, Any]:
    """The plan's collectives: totals by kind and by element type, and each op."""
    return {
        "collectives": {kind: totals for kind, totals in by_kind.items() if totals["count"]},
        "collectives_by_dtype": _by_dtype(found, gb_per_s),
        "collective_ops": [
            {key: getattr(op, key) for key in ("kind", "dtype", "bytes", "group_size", "count")}
            | {"name": op.name}
            for op in found
        ],
        "unknown_trip_counts": unknown_loops,
    }


def _by_dtype(found: list, gb_per_s: float) -> list[dict[str, Any]]:
    """Runs, bytes and seconds per step of each (kind, element type) of collective."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for op in found:
        row = rows.setdefault((op.kind, op.dtype), {"kind": op.kind, "dtype": op.dtype})
        totals = hlo.totals_by_kind([op], gb_per_s)[op.kind]
        for key in ("count", "bytes", "seconds"):
            row[key] = row.get(key, 0) + totals.get(key, 0)
    return sorted(rows.values(), key=lambda row: (hlo.KINDS.index(row["kind"]), row["dtype"]))
