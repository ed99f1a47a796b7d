"""`python -m paisoar_jax.plan`: the command line of the plan (tools/plan/__init__.py).

Parses the options, refuses bad ones in one line, compiles through core.plan and prints the
table (table.py) or the JSON object, adding what the options ask for: the GPU schedule
without the library's flags, the smallest change that fits, the context sizes, the
gradient exchanges side by side (variants.py, fit_search.py, context_split.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Sequence

from paisoar_jax import cli, output
from paisoar_jax.config import Config
from paisoar_jax.errors import UserError
from paisoar_jax.tools.plan import context_split, fit_search, gpu_target, variants
from paisoar_jax.tools.plan.core import (
    DEFAULT_EFFICIENCY,
    cpu_devices,
    parse_fraction,
    parse_link,
    plan,
    request_cpu_devices,
)
from paisoar_jax.tools.plan.table import format_table

# Written with its line breaks: the parser prints descriptions as they are (its key table).
DESCRIPTION = (
    "Plan a run without running it: per-device memory, the collectives of one step and a\n"
    "projected step time, from the step compiled on abstract arrays. Peak FLOP/s:\n"
    "train.peak_tflops, else the device's (metrics.PEAK_TFLOPS), else 989 (H200 dense bf16)."
)


def write_plan(path: pathlib.Path, result: dict) -> None:
    """Writes the plan as JSON to `path` (whole or not at all), creating its directory."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(temporary, path)
    except OSError as error:
        raise UserError(f"--output {path}: cannot write it ({error.strerror or error})") from None


def build_parser() -> argparse.ArgumentParser:
    """The plan's options beside the config and its overrides."""
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
        help="when the step does not fit (train.memory_limit_gb, else the --target GPU's "
        "memory or this host's share per device), compile it with each memory fix and "
        "propose the smallest change that fits (without --target: the CPU's estimate)",
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
    return parser


def refusal(args: argparse.Namespace) -> str | None:
    """The one line that refuses these options, or None."""
    if not args.devices.isdigit():
        return f"--devices {args.devices!r} is not a whole number of devices"
    if args.context_for and not (args.context_for.isdigit() and int(args.context_for) > 0):
        return f"--context-for {args.context_for!r} is not a number of tokens >= 1"
    if args.flag_effects and args.target is None:
        return "--flag-effects compiles for a GPU: give --target"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    problem = refusal(args)
    if problem is not None:
        output.error(problem, program=parser.prog)
        return 2
    if args.target is not None:  # a GPU target compiles in a CPU process (its plugin's rule)
        request_cpu_devices(1)
    elif int(args.devices):  # before jax starts: XLA reads XLA_FLAGS as its backend starts
        request_cpu_devices(int(args.devices))
    return cli.run(lambda config: run(config, args), parser, argv)


def run(config: Config, args: argparse.Namespace) -> None:
    """Compiles and prints the plan the parsed options ask for."""
    import jax

    efficiency = parse_fraction(args.efficiency)
    link = parse_link(args.link)
    if args.context_for:  # before any compile
        context_split.check_decoder(config)
    count = int(args.devices)
    if args.target is not None:
        per_host = count or args.devices_per_host
        devices = gpu_target.target_devices(args.target, args.hosts, per_host)
    else:
        devices = cpu_devices(count) if count else jax.devices()

    simulated = bool(count)  # --devices N: CPU devices standing in for real ones

    def plan_of(variant: Config, simulated: bool = False) -> dict:
        return plan(variant, devices, link, efficiency, simulated, None, args.target)

    # A target's own plan is not labelled simulated (its peak is the target's); the context
    # sizes and the gradient exchanges are labelled by --devices alone.
    result = plan_of(config, simulated and args.target is None)
    if args.flag_effects:
        effects = variants.flag_effects(config, devices, result, efficiency)
        result["target"]["flag_effects"] = effects
    if args.fit:  # the GPU target's numbers, or the CPU compiler's estimate
        if "target" not in result:
            output.note(
                "--fit without --target: judged on the CPU compiler's estimate of the step's "
                "memory; a GPU's differs (plan --target h100|h200 --fit compiles for one)",
                stderr=True,
            )
        result["fit"] = fit_search.search(config, result, plan_of)
    if args.context_for:
        result["context_sizes"] = context_split.context_sizes(
            config, int(args.context_for), len(devices), lambda v: plan_of(v, simulated)
        )
    if args.compare_grad_comm:
        result["grad_comm_comparison"] = variants.compare_grad_comm(
            config, devices, efficiency, simulated=simulated
        )
    if args.output is not None:
        write_plan(args.output, result)
    output.result(json.dumps(result, indent=None) if args.json else format_table(result))


if __name__ == "__main__":
    sys.exit(main())
