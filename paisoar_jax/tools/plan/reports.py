"""The plan's sections of the parallelism a run may have: pipeline stages, experts.

Each takes what `plan` found (the layout, the mesh, the step's collectives by kind) and
returns a small dict for plan.json and the table, or None when the run has no such thing.
"""

from __future__ import annotations

from typing import Any

import jax

from paisoar_jax.engine.memory import per_device_bytes


def pipeline_report(schedule, by_kind: dict[str, dict]) -> dict[str, Any] | None:
    """The schedule, its bubble and the stage-to-stage (collective-permute) bytes; or None."""
    if schedule is None:
        return None
    permutes = by_kind.get("collective-permute", {})
    return {
        "schedule": schedule.schedule,
        "stages": schedule.stages,
        "microbatches": schedule.microbatches,
        "repeats": schedule.repeats,
        "iterations": schedule.iterations,
        "bubble": schedule.bubble,
        # Each iteration sends one micro-batch's activations forward and their gradient
        # back: 2 x iterations permutes of a micro-batch's activations per device.
        "p2p_bytes": permutes.get("bytes", 0),
        "p2p_seconds": permutes.get("seconds", 0.0),
    }


def experts_report(model, layout, mesh, by_kind: dict[str, dict]) -> dict[str, Any] | None:
    """A mixture of experts' split over mesh.expert, and the all-to-all it takes.

    Its experts and their parameter bytes per device, and the all-to-all that moves the
    tokens to them and back; None for a dense model.
    """
    if not getattr(model, "experts", 0):
        return None
    shards = mesh.shape["expert"]
    experts = [  # the experts' kernels (and shared experts'), not the routers
        value
        for path, value in jax.tree_util.tree_leaves_with_path(layout.abstract_state.params)
        if "moe" in jax.tree_util.keystr(path) and "router" not in jax.tree_util.keystr(path)
    ]
    exchange = by_kind.get("all-to-all", {})
    return {
        "experts": model.experts,
        "experts_per_token": model.experts_per_token,
        "capacity_factor": model.expert_capacity_factor,
        "expert_shards": shards,
        "experts_per_device": model.experts // shards,
        "expert_bytes_per_device": per_device_bytes(experts),
        "all_to_all_bytes": exchange.get("bytes", 0),
        "all_to_all_seconds": exchange.get("seconds", 0.0),
    }
