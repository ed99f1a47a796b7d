"""`plan --target h200 --fit`: the smallest change that makes a step fit, found by compiling.

oom.py lists the fixes for a step that does not fit in the order to try them; here each is
tried: the step is compiled for the GPU target with the change (remat, ZeRO, more FSDP
devices, gradient accumulation, bf16), and of the changes that fit the one with the
shortest estimated step is proposed (each change costs speed differently: ZeRO-1 moves the
same bytes as the all-reduce it replaces, full remat recomputes the forward pass). When no
single change fits, the one that saved the most memory is kept and the others are tried on
top of it, up to three changes. Every number is the GPU compiler's; the step times are
estimates (tools/plan/gpu_target.py), no step ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from paisoar_jax import output
from paisoar_jax.config import Config, config_from_dict, to_dict
from paisoar_jax.errors import UserError
from paisoar_jax.run.oom import LESS_REMAT_MEMORY

MAX_CHANGES = 3


def limit_bytes(config: Config, device_bytes: int) -> int:
    """What a step must fit: train.memory_limit_gb when set, else the device's memory."""
    limit = config.train.memory_limit_gb
    return int(limit * 2**30) if limit > 0 else device_bytes


def candidates(config: Config, mesh_shape: dict[str, int]) -> list[list[str]]:
    """Each change (a list of overrides) that may lower the step's memory, cheapest first."""
    changes: list[list[str]] = []
    data = mesh_shape.get("data", 1)
    if data > 1 and config.mesh.zero == 0:
        changes.append(["mesh.zero=1"])
    remat = LESS_REMAT_MEMORY.get(config.remat.policy)
    if remat is not None:
        blocks = config.model.name == "custom" and not config.remat.blocks
        if not blocks:  # a model of one's own names its blocks first (oom.py says how)
            changes.append([f"remat.policy={remat}"])
            if remat != "full":
                changes.append(["remat.policy=full"])
    if data > 1 and config.mesh.zero < 3:
        changes.append(["mesh.zero=3"])
        fsdp = data * mesh_shape.get("fsdp", 1)
        changes.append(["mesh.data=1", f"mesh.fsdp={fsdp}", "mesh.zero=0"])
    batch_devices = data * mesh_shape.get("fsdp", 1)
    global_batch, accumulate = config.train.global_batch, config.train.grad_accum
    valid = [
        count
        for count in range(accumulate + 1, global_batch + 1)
        if global_batch % count == 0 and (global_batch // count) % batch_devices == 0
    ]
    for count in sorted({valid[0], valid[-1]} if valid else set()):
        changes.append([f"train.grad_accum={count}"])
    if config.precision.policy == "fp32":
        changes.append(["precision.policy=bf16"])
    return changes


def apply(config: Config, overrides: Sequence[str]) -> Config:
    """The config with `overrides` (`section.key=value`) applied."""
    return config_from_dict(to_dict(config), list(overrides))


def search(
    config: Config,
    first: dict[str, Any],
    plan_of: Callable[[Config], dict[str, Any]],
) -> dict[str, Any]:
    """The smallest change that fits, from the plan `first` of `config` as it is.

    `plan_of(config)` compiles a variant for the same target and returns its plan.
    Returns {"fits", "limit_bytes", "needed_bytes", "change", "tried"}: `change` the
    overrides to add (None when nothing tried fits), `tried` each variant's overrides,
    total bytes, fit and estimated step.
    """
    target = first.get("target")
    if target is not None:
        limit = limit_bytes(config, target["device_memory_bytes"])
    elif "memory_verdict" in first:  # the CPU estimate's limit (core.cpu_verdict)
        limit = first["memory_verdict"]["limit_bytes"]
    else:
        raise UserError(f"--fit on {first['platform']} devices: give --target h100|h200")
    needed = first["memory_bytes"]["total"]
    result = {"fits": needed <= limit, "limit_bytes": limit, "needed_bytes": needed}
    result |= {"change": [] if needed <= limit else None, "tried": []}
    if needed <= limit:
        return result
    base: list[str] = []
    base_config = config
    for _ in range(MAX_CHANGES):
        trials = []
        changes = candidates(base_config, first["mesh"])
        for number, change in enumerate(changes, start=1):
            overrides = [*base, *change]
            # Each compile of a large model takes a while: say which one runs.
            trying = f"--fit: compiling with {' '.join(overrides)} ({number} of {len(changes)})"
            output.note(trying, stderr=True)
            try:
                variant = apply(config, overrides)
                found = plan_of(variant)
            except UserError as error:  # an override this config cannot take
                result["tried"].append({"change": overrides, "error": str(error)})
                continue
            row = {
                "change": overrides,
                "total_bytes": found["memory_bytes"]["total"],
                "fits": found["memory_bytes"]["total"] <= limit,
                "estimated_step_s": estimated_step_s(found),
            }
            result["tried"].append(row)
            trials.append((row, variant, found))
        fitting = [row for row, _, _ in trials if row["fits"]]
        if fitting:
            best = min(fitting, key=lambda row: row["estimated_step_s"])
            return result | {"change": best["change"]}
        if not trials:
            break
        row, base_config, first = min(trials, key=lambda trial: trial[0]["total_bytes"])
        base = row["change"]
    return result


def estimated_step_s(plan: dict[str, Any]) -> float:
    """The plan's estimated step: the GPU target's, else the projection without overlap."""
    if "target" in plan:
        return plan["target"]["estimate"]["step_s"]
    return plan["time_s"]["step_no_overlap"]


def fit_lines(found: dict[str, Any]) -> list[str]:
    """The plan table's lines for --fit: the change to add, or that nothing tried fits."""
    from paisoar_jax.engine.memory import format_bytes

    limit = format_bytes(found["limit_bytes"])
    if found["fits"]:
        return ["", f"--fit: the step fits {limit} as it is: no change needed"]
    lines = ["", f"--fit: the step needs {format_bytes(found['needed_bytes'])}, over {limit}"]
    for row in found["tried"]:
        overrides = " ".join(row["change"])
        if "error" in row:
            lines.append(f"  {overrides}: cannot run ({row['error']})")
            continue
        verdict = "fits" if row["fits"] else "does not fit"
        lines.append(
            f"  {overrides}: {format_bytes(row['total_bytes'])}, {verdict}, estimated step "
            f"{row['estimated_step_s'] * 1e3:.3g} ms"
        )
    if found["change"]:
        change = " ".join(found["change"])
        lines.append(f"smallest change that fits (add to the command line): {change}")
    else:
        lines.append(
            "no change tried fits: use more devices (--devices, --hosts) or a smaller model"
        )
    return lines
