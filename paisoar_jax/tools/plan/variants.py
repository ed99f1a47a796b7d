"""plan's comparisons: the same step compiled in variants, side by side.

`compare_grad_comm` (`plan --compare-grad-comm`) compiles the step for each mesh.grad_comm
setting and times each on every link of plan.LINKS; `flag_effects` (`plan --target ...
--flag-effects`) compiles a GPU target's step without the library's XLA flags
(gpu_flags.py) and sets the two schedules side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from paisoar_jax.config import Config
from paisoar_jax.tools.plan import core as planning
from paisoar_jax.tools.plan import gpu_target, hlo


def compare_grad_comm(
    config: Config, devices: Sequence, efficiency: float, simulated: bool, workload: Any = None
) -> dict[str, Any]:
    """Step time and scaling efficiency per link (LINKS) for each mesh.grad_comm setting.

    Each setting's step is compiled; every collective is timed on the one link, as in plan.
    """
    from dataclasses import replace

    from paisoar_jax.tasks.zoo import zoo_workload

    workload = zoo_workload(config) if workload is None else workload
    comparison: dict[str, Any] = {}
    for setting in planning.GRAD_COMMS:
        mesh = replace(config.mesh, grad_comm=setting)
        if setting == "fp32":
            mesh = replace(mesh, grad_comm_error_feedback=False, grad_comm_scope="all")
        variant = replace(config, mesh=mesh)
        result, found = planning.plan_and_collectives(
            variant, devices, ("nvlink", planning.LINKS["nvlink"]), efficiency, simulated, workload
        )
        comparison[setting] = {
            "wire_bytes": sum(
                op.count * op.bytes * hlo.ring_factor(op.kind, op.group_size) for op in found
            ),
            "links": {
                name: planning.step_times(
                    hlo.totals_by_kind(found, gb_per_s), result["busy_s"], result["bubble"]
                )
                for name, gb_per_s in planning.LINKS.items()
            },
        }
    return comparison


def flag_effects(
    config: Config,
    devices: Sequence,
    result: dict[str, Any],
    efficiency: float,
    workload: Any = None,
) -> dict[str, Any]:
    """The step's schedule on the target of `result` (its plan) with and without the flags.

    Compiles the step again with `mesh.bucket_mb=0` (XLA's own thresholds) and returns both
    schedules' summaries (gpu_target.schedule_summary), "library" and "xla".
    """
    from dataclasses import replace

    variant = replace(config, mesh=replace(config.mesh, bucket_mb=0))
    target = result["target"]["name"]
    without = planning.plan(
        variant, devices, efficiency=efficiency, workload=workload, target=target
    )
    return {
        "library": gpu_target.schedule_summary(result),
        "xla": gpu_target.schedule_summary(without),
    }
