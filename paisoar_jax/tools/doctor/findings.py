"""The doctor's checks: one function per known problem, each taking the parsed run.

A check returns a `Finding` (title, evidence from this run's numbers, fixes that name the
override to type) or None. The memory checks are in memory_findings.py; doctor.py's
`CHECKS` lists them all in the order it reports them. The
thresholds below are the ones the doctor's help lists.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import statistics
from typing import Any

from paisoar_jax.config import Config, config_from_dict, to_dict
from paisoar_jax.engine.memory import format_bytes  # the units plan prints
from paisoar_jax.errors import UserError
from paisoar_jax.output import format_count
from paisoar_jax.parallel.pipeline import schedule as pipeline_of

INPUT_WAIT_LIMIT = 0.05
INPUT_WAIT_LIMIT_CPU = 0.20  # the input and the "device" share the host's cores
COMMUNICATION_LIMIT = 0.30
BUBBLE_LIMIT = 0.20
TREND_LOGS = 3  # log steps in a row that make a trend (a rising loss)
DIVERGED_MARGIN = 0.25  # a rising loss this far over its minimum is diverging, not noise
# MFU floors by parameter count for a bf16 run on an H100/H200. This project measured on
# one H200: GPT-2 124M at 22% (XLA attention) to 41% (cuDNN attention), a 1.3B decoder at
# 57%. The floors are about half of those, so only a clear shortfall is reported. The 10M
# floor is an extrapolation; below 10M params a model cannot keep such a GPU busy at all.
EXPECTED_MFU = ((1e9, 0.30), (1e8, 0.15), (1e7, 0.05))


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem of the run: what it is, the numbers that show it, and what to do."""

    name: str  # a short id: input-bound, diverging, ...
    title: str
    evidence: str
    fixes: tuple[str, ...]  # most useful first; overrides in `backticks`


@dataclasses.dataclass(frozen=True)
class Run:
    """What the doctor reads of a run directory."""

    directory: pathlib.Path
    config: Config
    records: list[dict[str, Any]]  # metrics.jsonl, one record per log step
    plan: dict[str, Any] | None  # plan.json, when the run directory has one
    by_fit: bool = False  # made by paisoar_jax.fit: its data is the program's, not data.*


def series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of the records where `key` is present and not null."""
    return [(record["step"], record[key]) for record in records if record.get(key) is not None]


def _after_first(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records after the first (its interval holds the warm-up), if there are others."""
    return records[1:] if len(records) > 1 else records


def percent(value: float) -> str:
    """A share as 38% (or 2.5% below 10%)."""
    return f"{value:.0%}" if value >= 0.1 else f"{value:.1%}"


def loss_scale_mode(config: Config) -> str:
    """dynamic, static or none: the run's loss scaling."""
    return config.precision.loss_scale_mode()[0]


def own_optimizer(run: Run) -> bool:
    """Whether the run's optimizer was the user's own (fit's optimizer=): optim.* is unused."""
    return bool(run.records) and run.records[0].get("lr_source") == "optimizer"


def lower_lr(run: Run, why: str = "") -> str:
    """The fix that lowers the learning rate: optim.lr, or the user's own optimizer's."""
    if own_optimizer(run):
        return f"a lower learning rate in the optimizer given to fit{why} (optim.lr is not used)"
    lr = run.config.optim.lr
    return f"`optim.lr={lr / 10:g}`{why or f' (now {lr:g})'}"


def larger_batch(config: Config, why: str) -> str:
    """The fix `train.global_batch` x 2, with the learning-rate scaling that goes with it."""
    batch = config.train.global_batch
    fix = f"`train.global_batch={2 * batch}`: {why}"
    if config.optim.lr_scaling == "none":
        fix += f"; rescale the lr with `optim.lr_scaling=sqrt` `optim.base_batch={batch}`"
    return fix


def input_bound(run: Run) -> Finding | None:
    """The step waits for input: its time-weighted data_wait_frac is over 5%."""
    used, previous_step = [], run.records[0]["step"] if len(run.records) > 1 else 0
    for record in _after_first(run.records):
        wait, step_time = record.get("data_wait_frac"), record.get("step_time_s")
        if wait is not None and step_time is not None and record["step"] > previous_step:
            seconds = step_time * (record["step"] - previous_step)
            used.append((previous_step + 1, record["step"], wait, seconds))
        previous_step = record["step"]
    total = sum(seconds for *_, seconds in used)
    if not used or total <= 0:
        return None
    share = sum(wait * seconds for *_, wait, seconds in used) / total
    # On a CPU the step and the input pipeline share the same cores: a few percent of wait
    # is contention there, not a pipeline that falls behind.
    on_cpu = run.records[0].get("platform") == "cpu"
    limit = INPUT_WAIT_LIMIT_CPU if on_cpu else INPUT_WAIT_LIMIT
    if share <= limit:
        return None
    _, worst_step, worst, _ = max(used, key=lambda item: item[2])
    data = run.config.data
    # Workers beyond the run's cores (less one for the step's own host work) only contend.
    cores = run.records[0].get("host_cores") or os.cpu_count() or 1
    workers, prefetch = min(max(2, 2 * data.workers), max(1, cores - 1)), 2 * data.prefetch
    guard = ' (they import your script again: keep fit under `if __name__ == "__main__":`)'
    fixes = []
    if workers > data.workers:
        fixes.append(
            f"`data.workers={workers}`: read and transform batches in {workers} worker "
            f"processes (now {data.workers}; {cores} cores){guard if run.by_fit else ''}"
        )
    fixes.append(
        f"`data.prefetch={prefetch}`: more batches in flight ahead of the step "
        f"(now {data.prefetch})"
    )
    if data.source.startswith("images:"):  # the other sources are records or in memory
        fixes.append(
            "convert the image folder once (`python -m paisoar_jax.convert images --input "
            "DIR --output OUT`) and train on `data.source=images:OUT`"
        )
    fixes.append(
        "compare the data wait of `paisoar_jax.bench_fit(...)` (your program's parts) at "
        "other data.workers"
        if run.by_fit
        else "time the input alone: `python -m paisoar_jax.bench --data-only` with the run's data.*"
    )
    if workers <= data.workers:
        fixes.append(
            f"more cores for the input: data.workers={data.workers} already uses the "
            f"{cores} cores this run had (a worker more only contends with the step)"
        )
    evidence = (
        f"waited for input {percent(share)} of the step time over steps "
        f"{used[0][0]}-{used[-1][1]} (data_wait_frac weighted by time; worst "
        f"{percent(worst)} at step {worst_step}); over {limit:.0%}"
        f"{' (on a CPU)' if on_cpu else ''} the input, not the devices, sets the pace"
    )
    return Finding("input-bound", "the step waits for its input", evidence, tuple(fixes))


def _plan_differences(run: Run) -> list[str]:
    """What plan.json was made for that differs from this run's config."""
    config = run.config
    expected = {
        "model": config.model.name,
        "global_batch": config.train.global_batch,
        "seq_len": getattr(config.model, "seq_len", None),  # language models
        "image_size": getattr(config.model, "image_size", None),  # image models
        "grad_accum": config.train.grad_accum,
        "zero": config.mesh.zero,
        "precision": config.precision.policy,
        "grad_comm": config.mesh.grad_comm,
    }
    return [
        f"{key} {run.plan[key]} (the run has {value})"
        for key, value in expected.items()
        if key in run.plan and value is not None and run.plan[key] != value
    ]


def communication_bound(run: Run) -> Finding | None:
    """plan.json projects collectives over 30% of the step (no overlap)."""
    times = (run.plan or {}).get("time_s")  # no step without the compute (flops unknown)
    if not times or not times.get("step_no_overlap") or not run.plan.get("flops_per_device"):
        return None
    share = times["communication"] / times["step_no_overlap"]
    if share <= COMMUNICATION_LIMIT:
        return None
    plan, config = run.plan, run.config
    link = plan.get("link", {})
    largest = max(
        plan.get("collectives", {}).items(),
        key=lambda item: item[1].get("seconds", 0),
        default=None,
    )
    evidence = (
        f"plan.json projects {times['communication'] * 1e3:.3g} ms of collectives against "
        f"{times['compute'] * 1e3:.3g} ms of compute per step on {link.get('name', 'its link')}"
        f": {percent(share)} of the step without overlap (over "
        f"{COMMUNICATION_LIMIT:.0%}: the network sets the pace)"
    )
    if largest:
        evidence += f"; most of it {largest[0]}, {format_bytes(largest[1]['bytes'])} per device"
    differences = _plan_differences(run)
    if differences:
        evidence += f"; note: plan.json was made for {', '.join(differences)}: plan again"
    room = (
        "`mesh.zero=1` or `remat.policy=dots`" if config.mesh.zero == 0 else "`remat.policy=dots`"
    )
    fixes = [larger_batch(config, f"twice the compute for the same bytes ({room} make room)")]
    # Moving devices off one axis needs another to take them: data=-1 takes the rest.
    fill = " `mesh.data=-1`" if config.mesh.data != -1 else ""
    if config.mesh.fsdp > 1:
        fixes.append(
            f"`mesh.fsdp=1`{fill} `mesh.zero=1`: data parallelism instead of FSDP: params stay "
            "whole, so no all-gather per layer; optimizer state stays sharded"
        )
    elif config.mesh.zero == 3:
        fixes.append(
            "`mesh.zero=1`: params stay whole, so no all-gather per layer; optimizer state "
            "stays sharded"
        )
    if config.mesh.tensor > 1:
        fixes.append(
            f"`mesh.tensor=1`{fill}: tensor parallelism all-reduces activations in every "
            "layer; keep it within one node's NVLink"
        )
    fixes += _grad_comm_fixes(run)
    bucket_mb = config.mesh.bucket_mb
    fixes += [
        f"fewer, larger collectives: `mesh.bucket_mb={max(2 * bucket_mb, 256)}` (now "
        f"{bucket_mb}: XLA's combine thresholds on GPUs); `python -m paisoar_jax.plan "
        "--target h200 --flag-effects` shows what it changes",
        "overlap the layer loop's collectives: XLA_FLAGS=--xla_gpu_enable_pipelined_all_gather"
        "=true and the other pipelining flags (docs/how-to/multi-process.md); measure with bench",
    ]
    return Finding(
        "communication-bound", "communication dominates the step", evidence, tuple(fixes)
    )


def _grad_comm_fixes(run: Run) -> list[str]:
    """Compressing the gradient exchange (grad_comm.py), where the data axis has one."""
    plan, settings = run.plan, run.config.mesh
    if plan.get("mesh", {}).get("data", 1) <= 1 or settings.grad_comm == "int8":
        return []
    try:  # only what the run's config takes (not with pipeline stages, experts or fp8)
        config_from_dict(to_dict(run.config), ["mesh.grad_comm=int8"])
    except UserError:
        return []
    bf16 = "`mesh.grad_comm=bf16` halves the gradient bytes, " * (settings.grad_comm == "fp32")
    fix = (
        f"compress the gradients on the wire: {bf16}`mesh.grad_comm=int8 "
        "mesh.grad_comm_error_feedback=true` about quarters them; both sum in fp32 on arrival"
    )
    comparison = plan.get("grad_comm_comparison", {})
    link = plan.get("link", {}).get("name")
    if link in comparison.get("int8", {}).get("links", {}):
        steps = ", ".join(
            f"{name} {setting['links'][link]['time_s']['step_no_overlap'] * 1e3:.3g} ms"
            for name, setting in comparison.items()
        )
        fix += f" (plan projects {steps} per step on {link})"
    if settings.dcn_data > 1:
        fix += "; `mesh.grad_comm_scope=dcn` keeps the exchange inside each host in fp32"
    return [fix + " (`python -m paisoar_jax.plan --compare-grad-comm` shows each link)"]


def pipeline_bubble(run: Run) -> Finding | None:
    """A pipelined run (mesh.stage > 1) whose stages idle over 20% of the step."""
    pipeline_schedule = pipeline_of(run.config.mesh, run.config.train)
    if pipeline_schedule is None or pipeline_schedule.bubble <= BUBBLE_LIMIT:
        return None
    stages, micro, laps = (
        pipeline_schedule.stages,
        pipeline_schedule.microbatches,
        pipeline_schedule.repeats,
    )
    evidence = (
        f"the {pipeline_schedule.schedule} schedule of {stages} stages, {micro} micro-batches and "
        f"{laps} lap(s) leaves every stage idle {percent(pipeline_schedule.bubble)} of the step: "
        f"(stages - 1) / (micro-batches x laps + stages - 1) = {stages - 1} / "
        f"{pipeline_schedule.iterations} (over {BUBBLE_LIMIT:.0%})"
    )
    train, stage = run.config.train, f"`mesh.stage={run.config.mesh.stage}`"
    if run.config.mesh.dcn_stage > 1:
        stage += f" `mesh.dcn_stage={run.config.mesh.dcn_stage}`"
    shape = mesh_shape(run)  # known: each micro-batch must split over the batch shards
    shards = shape.get("data", 1) * shape.get("fsdp", 1) if shape else 1

    def bubble(count: int, repeats: int) -> float:
        return (stages - 1) / (count * repeats + stages - 1)

    fixes = []
    per_pass = train.global_batch // train.grad_accum
    enough = [count for count in range(micro + 1, per_pass + 1) if per_pass % (count * shards) == 0]
    enough = [count for count in enough if bubble(count, laps) <= BUBBLE_LIMIT]
    if enough:
        fixes.append(
            f"{stage} `train.pipeline_microbatches={enough[0]}`: bubble "
            f"{bubble(enough[0], laps):.0%} (smaller micro-batches, the same batch)"
        )
    layers = getattr(run.config.model, "layers", 0)  # a language model's; else unknown
    if micro >= stages and layers and layers % (stages * 2 * laps) == 0:
        fixes.append(
            f"{stage} `train.pipeline_repeats={2 * laps}`: the circular schedule, each "
            f"micro-batch laps the stages {2 * laps} times, bubble {bubble(micro, 2 * laps):.0%}"
        )
    fixes.append(
        f"`train.global_batch={2 * train.global_batch}` with more micro-batches, or fewer "
        "stages (`mesh.stage`) with the devices going to `mesh.data` or `mesh.fsdp`"
    )
    return Finding("pipeline-bubble", "the pipeline bubble is large", evidence, tuple(fixes))


def parameter_count(run: Run) -> int | None:
    """The model's parameters, from plan.json or the first metrics record (None: unknown)."""
    if run.plan and run.plan.get("param_count"):
        return int(run.plan["param_count"])
    for record in run.records:
        if record.get("param_count"):
            return int(record["param_count"])
    return None


def low_mfu(run: Run) -> Finding | None:
    """The median MFU is below what a model of this size reaches (EXPECTED_MFU)."""
    values = [value for _, value in series(_after_first(run.records), "mfu")]
    if not values:
        return None
    params = parameter_count(run)
    if params is None:
        return None
    floor = next((share for size, share in EXPECTED_MFU if params >= size), None)
    median = statistics.median(values)
    if floor is None or median >= floor:
        return None
    config = run.config
    fixes = [larger_batch(config, "larger matmuls per device")]
    if config.precision.policy == "fp32":
        fixes.append("`precision.policy=bf16`: tensor cores run bf16, not fp32")
    if config.remat.policy != "none":
        fixes.append(
            f"`remat.policy=none` (now {config.remat.policy}) if it fits: recomputation "
            "takes time that MFU does not count"
        )
    attention = getattr(config.model, "attention", None)  # image models have no such key
    if attention == "xla" and config.precision.policy != "fp32":
        fixes.append("`model.attention=cudnn`: fused flash attention")
    fixes.append("measure the step alone with `python -m paisoar_jax.bench` and the same overrides")
    evidence = (
        f"median MFU {percent(median)} over {len(values)} log steps for {format_count(params)} "
        f"params; a healthy run of that size reaches {percent(floor)} or more on an "
        "H100/H200"
    )
    return Finding("low-mfu", "MFU is low for the model's size", evidence, tuple(fixes))


def mesh_shape(run: Run) -> dict[str, int] | None:
    """The run's mesh (axis -> size): from plan.json, else from a config without -1 sizes."""
    if run.plan and run.plan.get("mesh"):
        return run.plan["mesh"]
    return run.config.mesh.shape()


def recompiles(run: Run) -> Finding | None:
    """The train step compiled again after its first compilation."""
    counts = series(run.records, "recompiles")
    if not counts or counts[-1][1] <= 0:
        return None
    first_step = next(step for step, count in counts if count > 0)
    reasons = [
        record["recompile_reason"] for record in run.records if record.get("recompile_reason")
    ]
    config = run.config
    evidence = (
        f"{counts[-1][1]} recompilation{'s' * (counts[-1][1] > 1)} by step {counts[-1][0]}, "
        f"the first logged at step {first_step}; each one stops training for a compilation"
    )
    if reasons:
        evidence += f" ({reasons[0]})"
    same_shape = (
        "keep every batch the shape and dtype of the first: full batches of "
        f"`train.global_batch={config.train.global_batch}`"
    )
    if config.model.name == "gpt":  # token models: every sequence is seq_len + 1 tokens
        same_shape += f", sequences packed or padded to `model.seq_len={config.model.seq_len}`"
    fixes = (same_shape, "see which argument changed: run again with JAX_EXPLAIN_CACHE_MISSES=1")
    return Finding("recompiles", "the train step recompiles", evidence, fixes)
