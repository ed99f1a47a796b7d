"""The doctor's memory checks: the peak a GPU run measured, or the GPU plan beside a run.

A run on a GPU logs its peak device memory and the limit (metrics.jsonl); a run elsewhere
(a CPU try-out of a job meant for GPUs) has no such numbers, but its directory may hold the
plan of the job for a GPU: `python -m paisoar_jax.plan --target h200 ... --output
RUN_DIR/plan.json` (add `--fit` for the smallest change that fits). Then the doctor judges
the GPU compiler's per-device total against that device (or train.memory_limit_gb), with
the same thresholds, and names the change the plan found first.

A run that stopped because its step did not fit leaves out_of_memory.json (run/oom.py): the
report it printed and its fixes in order. `out_of_memory` reads it first, measured.
"""

from __future__ import annotations

import json
from typing import Any

from paisoar_jax.engine.memory import format_bytes
from paisoar_jax.run.oom import RECORD_NAME, memory_fixes
from paisoar_jax.tools.doctor.findings import Finding, Run, larger_batch, mesh_shape, percent
from paisoar_jax.tools.plan.core import memory_settings

MEMORY_ROOMY, MEMORY_TIGHT = 0.5, 0.9


def out_of_memory(run: Run) -> Finding | None:
    """The run stopped at a step that did not fit (its out_of_memory.json)."""
    path = run.directory / RECORD_NAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # a record cut short: the run's own report said it all
    lines = [line.strip() for line in str(record.get("report", "")).splitlines()]
    needed = next((line for line in lines if line.startswith("out of memory")), "out of memory")
    what = needed.removeprefix("out of memory: ")
    evidence = f"the run stopped at step {record.get('step', '?')}: {what}"
    fixes = [f"`{fix['override']}`: {fix['why']}" for fix in record.get("fixes", [])]
    fixes = fixes or ["every fix is in effect already: use more devices or a smaller model"]
    fixes.append(
        "`python -m paisoar_jax.plan` with the same config and `--fit`: the smallest change "
        "that fits, compiled, before a run"
    )
    return Finding("out-of-memory", "the step does not fit in memory", evidence, tuple(fixes))


def _measured(run: Run) -> tuple[float, str] | None:
    """(share of the limit, evidence) from the last record with memory figures; or None."""
    measured = [
        record
        for record in run.records
        if record.get("memory_peak_bytes") and record.get("memory_limit_bytes")
    ]
    if not measured:
        return None
    record = measured[-1]
    peak, limit = record["memory_peak_bytes"], record["memory_limit_bytes"]
    evidence = (
        f"peak device memory {format_bytes(peak)} of {format_bytes(limit)} "
        f"({percent(peak / limit)}) at step {record['step']}"
    )
    return peak / limit, evidence


def _planned(plan: dict[str, Any] | None) -> tuple[float, str] | None:
    """(share of the limit, evidence) from plan.json's GPU target section; or None."""
    target = (plan or {}).get("target")
    if not target:
        return None
    needed = plan["memory_bytes"]["total"]
    limit = target.get("limit_bytes", target["device_memory_bytes"])
    evidence = (
        f"the plan for {plan['devices']} x {target['name']} (plan.json: compiled for the GPU, "
        f"not run) needs {format_bytes(needed)} of {format_bytes(limit)} per device "
        f"({percent(needed / limit)})"
    )
    return needed / limit, evidence


def memory_headroom(run: Run) -> Finding | None:
    """Device memory far below the limit (room for more) or close to it (or over it)."""
    found = _measured(run) or _planned(run.plan)
    if found is None:
        return None
    share, evidence = found
    config = run.config
    if share > MEMORY_TIGHT:
        settings = memory_settings(config)
        fixes = [
            f"`{override}`: {why}" for override, why in memory_fixes(settings, mesh_shape(run))
        ]
        change = ((run.plan or {}).get("fit") or {}).get("change")
        if change and not _measured(run):
            overrides = " ".join(change)
            fixes.insert(0, f"`{overrides}`: the smallest change the GPU plan found to fit")
        over = "over" if share > 1 else "close to"
        title = f"device memory is {over} its limit"
        return Finding("memory-near-limit", title, evidence, tuple(fixes))
    if share >= MEMORY_ROOMY:
        return None
    fixes = []
    if config.remat.policy != "none":
        fixes.append(f"`remat.policy=none` (now {config.remat.policy}): no recomputation")
    if config.train.grad_accum > 1:
        fixes.append(
            f"`train.grad_accum={max(1, config.train.grad_accum // 2)}`: fewer, larger "
            "micro-batches, same global batch"
        )
    fixes.append(larger_batch(config, "more examples per step"))
    title = "device memory has room for a larger batch"
    return Finding("memory-headroom", title, evidence, tuple(fixes))
