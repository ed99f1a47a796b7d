"""`python -m paisoar_jax.plan [--config FILE.yaml] [section.key=value ...]`: memory and traffic.

Compiles one train step for the config's mesh from abstract arrays (no weights are ever
built; `--devices N` simulates N devices on CPU) and reports, per device:

- bytes of params, optimizer state and gradients (from the shardings), and XLA's own
  account of the compiled step (compiled.memory_analysis()): temporaries, inputs, outputs
  not donated, generated code and their total;
- the collectives one step runs, by kind and element type (f32; u16 and s8 for the bf16
  and int8 gradient exchange of mesh.grad_comm), with their bytes, read from the compiled
  HLO (paisoar_jax/tools/hlo.py says how they are counted);
- a projected step time on a given link: compute from the model's FLOPs at an assumed share
  of the peak, communication from NCCL's ring-algorithm costs, with no overlap and with
  perfect overlap, and the scaling efficiency compute / (compute + exposed communication).

`--compare-grad-comm` compiles the step for mesh.grad_comm fp32, bf16 and int8 and puts
their step times and scaling efficiencies on each of LINKS (1gbe .. nvlink) side by side.

The model is bandwidth only: no per-collective latency, and every collective runs over the
one link given (no ici/dcn split), so many small collectives look cheaper than they are. The
collectives are those of the platform that compiles the step: on CPU, XLA keeps an
all-reduce followed by a slice where XLA GPU emits a reduce-scatter, so the gradient
reduction of FSDP and ZeRO is counted (and timed) as an all-reduce there, at twice the
ring cost. XLA CPU also runs bf16 collectives in f32 (it converts around them), so the
FSDP all-gathers of a bf16 run, which move bf16 weights on a GPU (step.params_for_compute),
count twice their GPU bytes here. Temporaries come from the CPU compiler too (other fusions,
no cuDNN attention).

`--target h200|h100` compiles for that GPU instead, without one (tools/gpu_target.py): the
memory and collectives are then the GPU compiler's, and the plan adds its kernels
(tools/gpu_kernels.py) and whether the step fits the device. The table is plan_table.py's.

`--context-for LENGTH` compiles the step at LENGTH tokens for each mesh.context size and
proposes the smallest that fits (tools/context_split.py; the table's context section shows
any split's tokens per device, K/V bytes per step and whether the ring can hide them).

`--output RUN_DIR/plan.json` also writes the plan (the `--json` object) beside a run, where
`python -m paisoar_jax.doctor RUN_DIR` reads it to tell whether communication bounds the step.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from paisoar_jax import gpu_flags, output
from paisoar_jax.config import Config
from paisoar_jax.errors import UserError
from paisoar_jax.memory import memory
from paisoar_jax.oom import memory_fixes
from paisoar_jax.tools import cli, context_split, fit_search, gpu_target, hlo, plan_reports
from paisoar_jax.tools.plan_table import format_table

# Per-direction bandwidth of one device's link, GB/s (1e9 bytes/s).
# NVLink 4: 900 GB/s both ways; NDR InfiniBand: 400 Gb/s; Ethernet: its line rate.
LINKS = {"1gbe": 0.125, "10gbe": 1.25, "100gbe": 12.5, "infiniband": 50.0, "nvlink": 450.0}
GRAD_COMMS = ("fp32", "bf16", "int8")
DEFAULT_PEAK_TFLOPS = 989.0  # H200 / H100 SXM dense bf16, for plans made off the GPU
DEFAULT_EFFICIENCY = 0.5
DESCRIPTION = (
    "Plan a run without running it: per-device memory, the collectives of one step and a "
    "projected step time, from the step compiled on abstract arrays. Peak FLOP/s: "
    "train.peak_tflops, else the device's (metrics.PEAK_TFLOPS), else 989 (H200 dense bf16)."
)


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


def _fraction(text: str) -> float:
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
    from paisoar_jax.platform import compiling_for, is_target_compile_of
    from paisoar_jax.step import jit_train_step
    from paisoar_jax.workload import setup
    from paisoar_jax.zoo import zoo_workload

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
        options = gpu_flags.compiler_options(config.mesh.bucket_mb, devices)
        step = jit_train_step(layout, task, run.schedule, train.grad_accum, mesh, options)
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

    from paisoar_jax.metrics import device_peak_tflops

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
    from paisoar_jax.zoo import zoo_workload

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
    schedule = layout.pipeline
    bubble = schedule.bubble if schedule else 0.0
    busy_s = flops / (peak * 1e12 * efficiency)
    timing = step_times(by_kind, busy_s, bubble)
    memory_bytes = memory(layout, compiled)
    found = {}
    if target is not None:
        limit = fit_search.limit_bytes(config, gpu_target.DEVICES[target].memory_bytes)
        report = gpu_target.report(target, compiled, memory_bytes, limit)
        if not report["fits"]:  # what to try, in order (--fit compiles each)
            report["fixes"] = [
                {"override": override, "why": why}
                for override, why in memory_fixes(config, dict(mesh.shape))
            ]
        communication_s = timing["time_s"]["communication"]
        estimate = gpu_target.step_estimate(
            compiled,
            target,
            task,
            layout.flops_param_count,
            train.global_batch,
            len(devices),
            communication_s,
            efficiency,
        )
        flags = gpu_flags.describe(config.mesh.bucket_mb)
        found = {"target": report | {"estimate": estimate, "xla_flags": flags}}
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
        "collectives": {kind: totals for kind, totals in by_kind.items() if totals["count"]},
        "collectives_by_dtype": _by_dtype(found_collectives, gb_per_s),
        "collective_ops": [
            {key: getattr(op, key) for key in ("kind", "dtype", "bytes", "group_size", "count")}
            | {"name": op.name}
            for op in found_collectives
        ],
        "unknown_trip_counts": unknown_loops,
        "pipeline": plan_reports.pipeline_report(schedule, by_kind),
        "experts": plan_reports.experts_report(model, layout, mesh, by_kind),
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


def _by_dtype(found: list, gb_per_s: float) -> list[dict[str, Any]]:
    """Runs, bytes and seconds per step of each (kind, element type) of collective."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for op in found:
        row = rows.setdefault((op.kind, op.dtype), {"kind": op.kind, "dtype": op.dtype})
        totals = hlo.totals_by_kind([op], gb_per_s)[op.kind]
        for key in ("count", "bytes", "seconds"):
            row[key] = row.get(key, 0) + totals.get(key, 0)
    return sorted(rows.values(), key=lambda row: (hlo.KINDS.index(row["kind"]), row["dtype"]))


def write_plan(path: pathlib.Path, result: dict) -> None:
    """Writes the plan as JSON to `path` (whole or not at all), creating its directory."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(temporary, path)
    except OSError as error:
        raise UserError(f"--output {path}: cannot write it ({error.strerror or error})") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = cli.config_parser("paisoar_jax.plan", DESCRIPTION)
    parser.add_argument(
        "--devices",
        default="0",
        metavar="N",
        help="simulate N devices on CPU (default: the devices jax sees)",
    )
    parser.add_argument(
        "--link",
        default="nvlink",
        help="nvlink (450 GB/s per direction: H100/H200 NVLink 4, 900 GB/s both ways), "
        "infiniband (50 GB/s: one 400 Gb/s NDR port), 100gbe, 10gbe, 1gbe (12.5, 1.25 and "
        "0.125 GB/s: Ethernet at line rate) or a bandwidth in GB/s (default: nvlink)",
    )
    parser.add_argument(
        "--efficiency",
        default=str(DEFAULT_EFFICIENCY),
        help="assumed share of the peak FLOP/s the compute reaches (default: 0.5)",
    )
    parser.add_argument(
        "--compare-grad-comm",
        action="store_true",
        help="also compile the step with mesh.grad_comm=fp32, bf16 and int8 and show their "
        "step times and scaling efficiency on 1gbe, 10gbe, 100gbe, infiniband and nvlink",
    )
    parser.add_argument(
        "--target",
        choices=sorted(gpu_target.DEVICES),
        default=None,
        help="compile for this NVIDIA GPU without one (needs the gpu-aot extra): memory from "
        "the GPU compiler, its kernels and collectives; --devices N GPUs on one host, or "
        "--hosts H x --devices-per-host N (default 1 x 8)",
    )
    parser.add_argument(
        "--flag-effects",
        action="store_true",
        help="with --target: also compile without the XLA flags the library sets on GPUs "
        "(mesh.bucket_mb=0) and show what they change in the schedule",
    )
    parser.add_argument(
        "--fit",
        action="store_true",
        help="with --target: when the step does not fit (the device, or train.memory_limit_gb), "
        "compile it with each memory fix and propose the smallest change that fits",
    )
    parser.add_argument(
        "--context-for",
        default="",
        metavar="LENGTH",
        help="compile the step at LENGTH tokens for each mesh.context size (its devices taken "
        "from mesh.data) and propose the smallest that fits (with --target: the GPU; else "
        "train.memory_limit_gb)",
    )
    parser.add_argument("--hosts", type=int, default=1, metavar="H", help="with --target")
    parser.add_argument(
        "--devices-per-host", type=int, default=8, metavar="N", help="with --target"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    parser.add_argument(
        "--output",
        type=pathlib.Path,
        default=None,
        metavar="PATH",
        help="also write the JSON object to PATH; RUN_DIR/plan.json lets "
        "`python -m paisoar_jax.doctor RUN_DIR` judge the run's communication",
    )
    args = parser.parse_intermixed_args(argv)
    if not args.devices.isdigit():
        message = f"--devices {args.devices!r} is not a whole number of devices"
        output.error(message, program=parser.prog)
        return 2
    if args.context_for and not (args.context_for.isdigit() and int(args.context_for) > 0):
        message = f"--context-for {args.context_for!r} is not a number of tokens >= 1"
        output.error(message, program=parser.prog)
        return 2
    for option, given in (("--flag-effects", args.flag_effects), ("--fit", args.fit)):
        if given and args.target is None:
            output.error(f"{option} compiles for a GPU: give --target", program=parser.prog)
            return 2
    if args.target is not None:  # a GPU target compiles in a CPU process (its plugin's rule)
        request_cpu_devices(1)
    elif int(args.devices):  # before jax starts: XLA reads XLA_FLAGS as its backend starts
        request_cpu_devices(int(args.devices))

    def run(config: Config) -> None:
        import jax

        from paisoar_jax.tools import plan_variants  # it compiles through this module

        efficiency = _fraction(args.efficiency)
        link = parse_link(args.link)
        if args.context_for:  # before any compile
            context_split.check_decoder(config)
        count = int(args.devices)
        if args.target is not None:
            per_host = count or args.devices_per_host
            devices = gpu_target.target_devices(args.target, args.hosts, per_host)
            result = plan(config, devices, link, efficiency, target=args.target)
            if args.flag_effects:
                effects = plan_variants.flag_effects(config, devices, result, efficiency)
                result["target"]["flag_effects"] = effects
            if args.fit:
                result["fit"] = fit_search.search(
                    config,
                    result,
                    lambda variant: plan(variant, devices, link, efficiency, target=args.target),
                )
        else:
            devices = cpu_devices(count) if count else jax.devices()
            result = plan(config, devices, link, efficiency, simulated=bool(count))
        if args.context_for:
            result["context_sizes"] = context_split.context_sizes(
                config,
                int(args.context_for),
                len(devices),
                lambda variant: plan(
                    variant, devices, link, efficiency, bool(count), None, args.target
                ),
            )
        if args.compare_grad_comm:
            result["grad_comm_comparison"] = plan_variants.compare_grad_comm(
                config, devices, efficiency, simulated=bool(count)
            )
        if args.output is not None:
            write_plan(args.output, result)
        output.result(json.dumps(result, indent=None) if args.json else format_table(result))

    return cli.run(run, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
