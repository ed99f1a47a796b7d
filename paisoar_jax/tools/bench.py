"""`python -m paisoar_jax.bench [--scaling | --data-only | --overhead] [--config F] [k=v ...]`.

Prints one JSON line of measured speed for a config on the devices at hand.

`--scaling` runs the step on 1, 2, 4, ... devices, strong and weak, and splits each step
from a profile (tools/scaling.py): a table, <run.dir>/scaling.json and scaling.png.

`--data-only` times the input pipeline alone, exactly as training builds it (source,
grain shuffle/batch, workers, device prefetch into sharded global arrays) but with no
step consuming the batches: batches/s and tokens/s, the ceiling the pipeline puts on
training. Without it, the config trains on synthetic input (no checkpoints, no eval) and
the line reports tokens/s (images: examples/s), step time, MFU and compile time from the
run's own metrics. MFU counts 6 N + attention FLOPs per token for language models and, for
image models, 3 x 2 x the forward multiply-adds per image (ResNet-50 at 224 px: 4.09 GMACs,
24.5 GFLOP per training image). `--overhead` compares the loop with a bare jitted loop at a
negligible model size (paisoar_jax/tools/overhead.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from paisoar_jax import cli, output
from paisoar_jax.config import Config, load_config
from paisoar_jax.errors import UserError

BENCH_OVERRIDES = [
    "checkpoint.enabled=false",
    "train.eval_every=0",
    "data.eval_sets=[]",  # (their own every would still evaluate them)
    "train.sample_bytes=0",
    "run.progress=false",
    "run.tensorboard=false",
]


def bench_data(config: Config, batches: int, warmup: int) -> dict[str, Any]:
    """Times `batches` global batches of the configured pipeline after `warmup` of them."""
    import jax

    from paisoar_jax.data.prefetch import DevicePrefetcher
    from paisoar_jax.parallel import sharding
    from paisoar_jax.tasks.zoo import zoo_workload

    mesh = sharding.build_mesh(config.mesh)
    sharding.check_batch(config.train.global_batch, config.train.grad_accum, mesh)
    task = zoo_workload(config).task
    source, _ = task.open_sources()
    with jax.set_mesh(mesh):  # the rows this process reads follow the mesh (input_slot)
        host_batches = task.host_batches(
            source,
            global_batch=config.train.global_batch,
            seed=config.train.seed,
            train=True,
            workers=config.data.workers,
        )
    prefetcher = DevicePrefetcher(
        iter(host_batches), sharding.batch_sharding(mesh), config.data.prefetch
    )
    try:
        for _ in range(warmup):  # worker start-up and first reads are not throughput
            jax.block_until_ready(next(prefetcher))
        start = time.perf_counter()
        for _ in range(batches):
            jax.block_until_ready(next(prefetcher))
        seconds = time.perf_counter() - start
    finally:
        prefetcher.close()
    units = batches * config.train.global_batch * task.units_per_example()
    return {
        "mode": "data",
        # A mixture is what is read when there is one (data.source is then unused).
        "source": (
            "mixture " + ", ".join(f"{one.source} x {one.weight:g}" for one in config.data.mixture)
            if config.data.mixture
            else config.data.source
        ),
        "workers": config.data.workers,
        "global_batch": config.train.global_batch,
        **task.signature(),  # seq_len, or image size and channels
        "batches": batches,
        "seconds": seconds,
        "batches_per_s": batches / seconds,
        f"{task.unit}_per_s": units / seconds,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
    }


def bench_train(config: Config, workload: Any = None) -> dict[str, Any]:
    """Trains the config and summarises its speed from metrics.jsonl.

    `workload`: a model of one's own (as `paisoar_jax.bench` builds it); default: the
    config's zoo model.
    """
    import jax

    from paisoar_jax.run.loop import run
    from paisoar_jax.tasks.zoo import zoo_workload

    workload = zoo_workload(config) if workload is None else workload
    task = workload.task
    finished = run(config, workload)
    summary = finished.summary
    records = [
        json.loads(line)
        for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    steady = records[1:] or records  # the first interval holds the warm-up steps
    step_time_s = sum(r["step_time_s"] for r in steady) / len(steady)
    memory = jax.devices()[0].memory_stats() or {}
    return {
        "mode": "train",
        "model": config.model.name,
        "precision": config.precision.policy,
        "remat": config.remat.policy,
        "mesh": dataclasses.asdict(config.mesh),
        "global_batch": config.train.global_batch,
        **task.signature(),
        "steps": summary["steps"],
        "step_ms": step_time_s * 1e3,
        f"{task.unit}_per_s": config.train.global_batch * task.units_per_example() / step_time_s,
        "flops_per_" + task.unit.removesuffix("s"): task.flops_per_unit(
            summary["flops_param_count"]
        ),
        "mfu": steady[-1]["mfu"],
        "data_wait_frac": sum(r["data_wait_frac"] for r in steady) / len(steady),
        "host_frac": sum(r["host_frac"] for r in steady) / len(steady),
        "compile_s": summary["compile_s"],
        "peak_memory_gb": memory.get("peak_bytes_in_use", 0) / 1e9 or None,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
        "attention": _attention(config),
        "estimate": _estimate(config, task, summary, finished.compiled, step_time_s),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def _estimate(
    config: Config, task: Any, summary: dict, compiled: Any, step_time_s: float
) -> dict[str, Any] | None:
    """What `plan --target` predicts for the step that ran, beside what it measured.

    On a GPU that is a plan target (H200, H100): the roofline estimate of the very program
    that ran (tools/plan/gpu_target.py), one device's step (collectives not priced: bench runs
    one process); None elsewhere.
    """
    import jax

    from paisoar_jax.tools.plan import DEFAULT_EFFICIENCY, gpu_target

    device = jax.devices()[0]
    target = gpu_target.target_of(device.device_kind) if device.platform == "gpu" else None
    if target is None or compiled is None:
        return None
    found = gpu_target.step_estimate(
        compiled,
        target,
        task,
        summary["flops_param_count"],
        config.train.global_batch,
        jax.device_count(),
        0.0,
        DEFAULT_EFFICIENCY,
    )
    return {
        "target": target,
        "step_ms": found["step_s"] * 1e3,
        "mfu": found["mfu"],
        "measured_over_estimated": step_time_s / found["step_s"] if found["step_s"] else None,
    }


def _attention(config: Config) -> str | None:
    """The attention implementation a language model ran (auto resolved); None for images."""
    from paisoar_jax.models.attention import resolve_attention
    from paisoar_jax.numerics.precision import get_policy

    model = config.model
    if not hasattr(model, "attention"):
        return None
    policy = get_policy(config.precision.policy)
    return resolve_attention(model.attention, policy, model.head_size)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = cli.config_parser("paisoar_jax.bench", "Measure training or input speed.")
    parser.add_argument("--data-only", action="store_true", help="time the input pipeline alone")
    parser.add_argument(
        "--overhead",
        action="store_true",
        help="the loop's ms/step at a negligible model size beside a bare jitted loop",
    )
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="strong and weak scaling on 1, 2, 4, ... devices, measured (tools/scaling.py)",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per count (--scaling)")
    parser.add_argument("--batches", type=int, default=200, help="timed batches (--data-only)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed batches (--data-only)")
    args = parser.parse_intermixed_args(argv)
    modes = [
        flag
        for flag, given in (
            ("--scaling", args.scaling),
            ("--data-only", args.data_only),
            ("--overhead", args.overhead),
        )
        if given
    ]
    if len(modes) > 1:
        output.error(f"{' and '.join(modes)}: choose one", program=parser.prog)
        return 2

    def run(config: Config) -> None:
        if args.data_only:
            result = bench_data(config, args.batches, args.warmup)
        elif args.overhead:
            from paisoar_jax.tools.overhead import OVERHEAD_OVERRIDES, overhead

            if config.model.name != "gpt":
                raise UserError("--overhead measures the token loop: use a gpt config")
            overrides = [*OVERHEAD_OVERRIDES, *args.overrides, *BENCH_OVERRIDES]
            overrides.append(f"run.dir={config.run.dir or 'runs/bench/overhead'}")
            overhead_config = load_config(args.config, overrides)
            result = overhead(overhead_config, bench_train(overhead_config))
        else:
            # Synthetic tokens unless the command line names a source; nothing saved.
            overrides = ["data.source=synthetic", *args.overrides, *BENCH_OVERRIDES]
            config = load_config(args.config, overrides)
            if not config.run.dir:  # never overwrite the metrics of a real run of this name
                bench_dir = f"run.dir=runs/bench/{config.run.name}"
                config = load_config(args.config, [*overrides, bench_dir])
            if args.scaling:
                from paisoar_jax.tools import scaling

                result = scaling.scaling(config, steps=args.steps)
                output.result(scaling.format_table(result))
                return
            result = bench_train(config)
        output.result(json.dumps(result))

    return cli.run(run, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
