"""The XLA flags the library sets when it compiles for a GPU, unless XLA_FLAGS sets them.

Chosen from the GPU compiler's own schedule of the zoo's steps (`plan --target h200
--flag-effects` shows each one's effect; benchmarks/RESULTS.md has the figures), with
jaxlib 0.10's XLA:

- Collective buckets (PAISoar's gradient buckets): XLA combines collectives of one kind up
  to a threshold before it schedules them, 30 MiB by default. `mesh.bucket_mb` (128 by
  default) raises the all-gather, reduce-scatter and all-reduce thresholds together. On 8
  H200s an FSDP step of gpt_1b then runs 51 all-gathers instead of 195 (a layer's weights
  in one or two, not one per matrix), all async and overlapping compute, for 1% more
  temporaries; each collective costs a launch and a latency that bandwidth alone does not
  show. Data-parallel steps (gpt2_124m, ResNet-50) compile to the same collectives either
  way: their gradient all-reduces are combined already. `mesh.bucket_mb=0` leaves XLA's.
- Not set, and why: the latency-hiding scheduler runs by default at this XLA version (the
  step compiles to the same program with `--xla_gpu_enable_latency_hiding_scheduler` true
  or false); pipelined collectives and while-loop double buffering rewrite the layer loop
  into programs whose gain no device has measured here yet.

A flag in the user's XLA_FLAGS always wins: it is left out of what is set here. CPU
compiles get nothing (their collectives are XLA:CPU's, which has no such thresholds).
"""

from __future__ import annotations

import os
import re
from typing import Any

BUCKET_FLAGS = (
    "xla_gpu_all_gather_combine_threshold_bytes",
    "xla_gpu_reduce_scatter_combine_threshold_bytes",
    "xla_gpu_all_reduce_combine_threshold_bytes",
)
XLA_DEFAULT_BUCKET_BYTES = 30 * 2**20  # XLA's own thresholds (collective_utils.h)
_FLAG_NAME = re.compile(r"--([A-Za-z0-9_]+)")


def user_flags() -> set[str]:
    """The flag names the user's XLA_FLAGS sets (those are never overridden here)."""
    return set(_FLAG_NAME.findall(os.environ.get("XLA_FLAGS", "")))


def library_flags(bucket_mb: int) -> dict[str, Any]:
    """Every flag the library would set on a GPU for `mesh.bucket_mb`, before XLA_FLAGS."""
    if bucket_mb <= 0:
        return {}
    return dict.fromkeys(BUCKET_FLAGS, bucket_mb * 2**20)


def compiler_options(bucket_mb: int, devices: Any) -> dict[str, Any]:
    """The options for `jax.jit(..., compiler_options=...)` of a step on `devices`.

    `devices`: any sequence or array of the mesh's devices (a GPU target's included).
    """
    first = next(iter(getattr(devices, "flat", devices)))
    if first.platform != "gpu":
        return {}
    chosen = user_flags()
    return {flag: value for flag, value in library_flags(bucket_mb).items() if flag not in chosen}


def describe(bucket_mb: int) -> list[dict[str, Any]]:
    """Each bucket flag with the value a GPU compile gets and who set it (for plan)."""
    environment = dict(re.findall(r"--([A-Za-z0-9_]+)=(\S*)", os.environ.get("XLA_FLAGS", "")))
    ours = library_flags(bucket_mb)
    rows = []
    for flag in BUCKET_FLAGS:
        if flag in environment:
            rows.append({"flag": flag, "value": environment[flag], "set_by": "XLA_FLAGS"})
        elif flag in ours:
            rows.append({"flag": flag, "value": ours[flag], "set_by": "mesh.bucket_mb"})
        else:
            rows.append({"flag": flag, "value": XLA_DEFAULT_BUCKET_BYTES, "set_by": "XLA"})
    return rows
