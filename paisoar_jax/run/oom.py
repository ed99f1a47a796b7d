"""Readable out-of-memory: one short report instead of XLA's wall of text.

When a train step does not fit, XLA says `RESOURCE_EXHAUSTED: Out of memory ...` and little
else. This module turns that (or a compiled step that needs more than a set limit) into a
report a user can act on: the per-device memory breakdown of the compiled step (the numbers
`python -m paisoar_jax.plan` prints, from `memory.memory`) and the fixes, in the order to try
them, each as the override to type:

1. `remat.policy`: recompute activations in the backward pass (dots, then ... full);
2. `mesh.zero`: shard optimizer state and gradients (1), then params too (3), over the data
   devices (`mesh.fsdp` does the same on its own axis);
3. `train.grad_accum`: a smaller micro-batch, same global batch;
4. `precision.policy=bf16`: half the activation bytes.

Fixes already in effect are left out. On a GPU where jax took its default 75% of memory,
the report also says how to give it more (XLA_PYTHON_CLIENT_MEM_FRACTION). The error is an
`OutOfMemoryError`, a `UserError`: the entrypoints print it and exit with status 2, like any
other config that cannot run.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

from paisoar_jax.engine import memory
from paisoar_jax.engine.memory import (  # the units `plan` prints: both read alike
    MemorySettings,
    format_bytes,
)
from paisoar_jax.errors import UserError
from paisoar_jax.parallel import pipeline

# XLA's words for an allocation that failed: "RESOURCE_EXHAUSTED: Out of memory allocating
# N bytes." (CPU), "... Out of memory while trying to allocate N bytes." (GPU BFC allocator).
OUT_OF_MEMORY_MARKERS = ("RESOURCE_EXHAUSTED", "out of memory")
# Each remat policy's next step towards less memory (paisoar_jax/numerics/remat.py orders them).
LESS_REMAT_MEMORY = {
    "none": "dots",
    "dots": "dots_no_batch",
    "dots_no_batch": "minimal",
    "minimal": "full",
}


RECORD_NAME = "out_of_memory.json"  # in the run directory: what the doctor reads of it


class OutOfMemoryError(UserError):
    """The train step does not fit in device memory; the message is the whole report.

    `fixes`: (override, what it saves) in the order to try them, as the report lists them.
    """

    def __init__(self, report: str, fixes: list[tuple[str, str]] | None = None):
        super().__init__(report)
        self.fixes = fixes or []


def write_record(run_dir: pathlib.Path, error: OutOfMemoryError, step: int) -> None:
    """Writes <run_dir>/out_of_memory.json: the report and its fixes, for `doctor`.

    `step`: the step that did not fit (the first of this start). A later run that gets past
    it removes the record (`clear_record`).
    """
    record = {
        "step": step,
        "report": str(error),
        "fixes": [{"override": override, "why": why} for override, why in error.fixes],
    }
    (run_dir / RECORD_NAME).write_text(json.dumps(record, indent=1) + "\n")


def clear_record(run_dir: pathlib.Path) -> None:
    """Removes an out-of-memory record a run before this one left: this step fits."""
    (run_dir / RECORD_NAME).unlink(missing_ok=True)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) is XLA running out of device memory."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        # jax raises JaxRuntimeError (XlaRuntimeError in older jaxlib): both RuntimeErrors.
        if isinstance(error, RuntimeError) and not isinstance(error, UserError):
            text = str(error)
            if any(marker.lower() in text.lower() for marker in OUT_OF_MEMORY_MARKERS):
                return True
        error = error.__cause__ or error.__context__
    return False


def device_limit_bytes(memory_limit_gb: float) -> int | None:
    """The per-device limit: `memory_limit_gb` GiB when > 0, else the device's own.

    The device's own is `bytes_limit` from `memory_stats()`, which GPUs report and the CPU
    backend does not (None: no limit known, nothing is checked).
    """
    if memory_limit_gb > 0:
        return int(memory_limit_gb * 2**30)
    import jax

    stats = jax.local_devices()[0].memory_stats()
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def _batch_devices(mesh_shape: dict[str, int] | None) -> int | None:
    """Devices the batch (and ZeRO's sharding) is split over, when the mesh is known."""
    if mesh_shape is None:
        return None
    return mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)


def memory_fixes(
    settings: MemorySettings, mesh_shape: dict[str, int] | None = None
) -> list[tuple[str, str]]:
    """(override, what it saves) in the order to try them, leaving out those in effect.

    `mesh_shape` (axis -> size), when known, drops what cannot help: ZeRO on one data
    device, a micro-batch smaller than one example per device.
    """
    fixes = []
    remat = LESS_REMAT_MEMORY.get(settings.remat.policy)
    if remat:
        # A model of one's own names its blocks (the zoo's checkpoint theirs themselves).
        own_blocks = settings.own_model and not settings.remat.blocks
        blocks = " remat.blocks=[<block path regex>]" if own_blocks else ""
        fixes.append(
            (
                f"remat.policy={remat}{blocks}",
                "recompute activations in the backward pass (full: the least memory)",
            )
        )
    batch_devices = _batch_devices(mesh_shape)
    if settings.mesh.zero < 3 and batch_devices != 1:
        over = f"the {batch_devices} data devices" if batch_devices else "the data devices"
        if settings.mesh.zero == 0:
            fixes.append(
                (
                    "mesh.zero=1",
                    f"shard optimizer state and gradients over {over} (zero=3: params too)",
                )
            )
        else:
            fixes.append(("mesh.zero=3", f"shard the params too, over {over}"))
    global_batch, accumulate = settings.train.global_batch, settings.train.grad_accum
    # A pipeline cuts each pass again into its micro-batches, each split over the devices.
    pipeline_schedule = pipeline.schedule(settings.mesh, settings.train)
    cuts = pipeline_schedule.microbatches if pipeline_schedule else 1
    more = next(
        (
            count
            for count in range(accumulate + 1, global_batch + 1)
            if global_batch % (count * cuts) == 0
            and (batch_devices is None or (global_batch // count // cuts) % batch_devices == 0)
        ),
        None,
    )
    if more:
        fixes.append(
            (
                f"train.grad_accum={more}",
                f"micro-batches of {global_batch // more}, not {global_batch // accumulate}: "
                "fewer activations, same global batch",
            )
        )
    if settings.precision.policy == "fp32":
        fixes.append(("precision.policy=bf16", "bf16 compute: half the activation bytes"))
    return fixes


def memory_report(
    settings: MemorySettings, layout: Any, compiled: Any, limit_bytes: int | None
) -> str:
    """The report: what the step needs per device, the limit, and the fixes in order.

    `compiled` may be None when the compilation itself ran out of memory: then only the
    state's bytes (from its shardings) are known.
    """
    state = layout.abstract_state
    mesh_shape = dict(state.step.sharding.mesh.shape)
    limit = f"the {format_bytes(limit_bytes)} limit" if limit_bytes else "the device's memory"
    if compiled is None:
        rows = {
            "params": memory.per_device_bytes(state.params),
            "optimizer state": memory.per_device_bytes(state.opt_state),
        }
        headline = f"out of memory: compiling the train step ran out of {limit}"
        notes = {}
    else:
        needed = memory.memory(layout, compiled)
        rows = {
            "params": needed["params"],
            "optimizer state": needed["optimizer_state"],
            "gradients": needed["gradients"],
            "temporaries": needed["temporaries"],
            "other": needed["other_inputs"]
            + needed["outputs_not_donated"]
            + needed["generated_code"],
            "total": needed["total"],
        }
        headline = (
            f"out of memory: the train step needs {format_bytes(needed['total'])} per device, "
            f"more than {limit}"
        )
        notes = {
            "gradients": "(inside the temporaries)",
            "temporaries": "(activations, gradients, XLA workspace)",
            "other": "(batch, outputs not donated, code)",
        }
    mesh = " ".join(f"{axis}={size}" for axis, size in mesh_shape.items())
    lines = [headline, f"per device (mesh {mesh}, zero={settings.mesh.zero}):"]
    lines += [
        f"  {name:<17}{format_bytes(value):>10}  {notes.get(name, '')}".rstrip()
        for name, value in rows.items()
    ]
    hint = memory_fraction_hint(settings.train.memory_limit_gb)
    if hint:
        lines.append(hint)
    fixes = memory_fixes(settings, mesh_shape)
    if fixes:
        width = max(len(override) for override, _ in fixes)
        lines.append("fixes, in the order to try them (add to the command line):")
        lines += [f"  {override:<{width}}  {why}" for override, why in fixes]
    else:
        lines.append("every fix is in effect already: use more devices or a smaller model")
    return "\n".join(lines)


def memory_fraction_hint(memory_limit_gb: float) -> str | None:
    """On a GPU where jax holds under 90% of the memory: how to give it more; else None.

    jax preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of each GPU (0.75 unless set) and that
    is the step's limit; raising it leaves less for anything else on the GPU (another
    process, cuDNN or NCCL buffers outside jax's pool). None too where train.memory_limit_gb
    (`memory_limit_gb`) sets the limit.
    """
    import jax

    if memory_limit_gb > 0 or jax.default_backend() != "gpu":
        return None
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or 0.75)
    if fraction >= 0.9:
        return None
    return (
        f"jax holds {fraction:.0%} of each GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION): "
        "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 in the environment gives the step most of the rest"
    )


def check_fits(
    settings: MemorySettings, layout: Any, compiled: Any, limit_bytes: int | None
) -> None:
    """Raises OutOfMemoryError when the compiled step needs more than `limit_bytes` per device.

    No limit (None or 0) checks nothing.
    """
    if limit_bytes and memory.memory(layout, compiled)["total"] > limit_bytes:
        report = memory_report(settings, layout, compiled, limit_bytes)
        raise OutOfMemoryError(report, _fixes_of(settings, layout))


@contextlib.contextmanager
def readable_out_of_memory(
    settings: MemorySettings, layout: Any, limit_bytes: int | None, compiled: Any = None
) -> Iterator[None]:
    """Turns XLA's out-of-memory error inside the block into an OutOfMemoryError report.

    Wrap the compilation (compiled=None) and the first steps (with the compiled step);
    any other error passes through untouched.
    """
    try:
        yield
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        first_line = str(error).strip().splitlines()[0][:200]
        report = memory_report(settings, layout, compiled, limit_bytes)
        raise OutOfMemoryError(
            f"{report}\nXLA: {first_line}", _fixes_of(settings, layout)
        ) from None


def _fixes_of(settings: MemorySettings, layout: Any) -> list[tuple[str, str]]:
    """The report's fixes, for the error that carries them."""
    return memory_fixes(settings, dict(layout.abstract_state.step.sharding.mesh.shape))
