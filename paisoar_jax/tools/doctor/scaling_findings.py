"""The doctor's check of more devices that are no faster, from what was measured.

First the run directory's scaling.json (`doctor RUN_DIR --measure-scaling`, or `bench
--scaling` with run.dir=RUN_DIR: the same step measured on 1, 2, 4, ... devices, with its
collectives' share from a profile); without one, a run over several processes on CPUs,
whose collectives cross processes through gloo over TCP, is said to be slow by nature, with
the command that measures it.
"""

from __future__ import annotations

import json

from paisoar_jax.tools.doctor.findings import Finding, Run, larger_batch, percent

SCALING_LIMIT = 0.5  # a strong-scaling efficiency under 50% wastes half the devices
MEASURE = (
    "measure it: `python -m paisoar_jax.doctor RUN_DIR --measure-scaling` (the step on 1, 2, "
    "4, ... devices, split from a profile, then judged)"
)


def _measured(run: Run) -> dict | None:
    """The run directory's scaling.json, or None."""
    path = run.directory / "scaling.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def poor_scaling(run: Run) -> Finding | None:
    """More devices, no faster: measured strong efficiency under 50%, or processes on CPUs."""
    first = run.records[0] if run.records else {}
    measured = _measured(run)
    if measured is None:
        if first.get("process_count", 1) > 1 and first.get("platform") == "cpu":
            evidence = (
                f"{first['process_count']} processes on CPUs: each step's collectives cross "
                f"processes through gloo over TCP, far slower than within one process (not "
                f"measured in this run)"
            )
            fixes = (
                "expected on CPUs: one process with all the devices "
                "(XLA_FLAGS=--xla_force_host_platform_device_count=N) is the fast way to try "
                "a mesh; judge multi-host speed on the GPUs",
                MEASURE,
            )
            return Finding("poor-scaling", "more processes, slower steps", evidence, fixes)
        return None
    rows = [row for row in measured.get("strong", []) if row.get("efficiency") is not None]
    if len(rows) < 2 or rows[-1]["efficiency"] >= SCALING_LIMIT:
        return None
    last, one = rows[-1], rows[0]
    share = last["collectives_s"] / last["step_s"] if last["step_s"] else 0.0
    weak = [row for row in measured.get("weak", []) if row.get("efficiency") is not None]
    evidence = (
        f"measured (scaling.json, {measured.get('device_kind', '?')}): {last['devices']} devices "
        f"take {last['step_s'] * 1e3:.3g} ms a step against {one['step_s'] * 1e3:.3g} ms on "
        f"{one['devices']}, a strong-scaling efficiency of {percent(last['efficiency'])}; "
        f"collectives {percent(share)} of the step"
    )
    if weak:
        evidence += f"; weak scaling (the same batch per device) {percent(weak[-1]['efficiency'])}"
    config = run.config
    fixes = [larger_batch(config, "more compute per device for the same collectives")]
    if config.mesh.grad_comm == "fp32" and share > 0.2:
        fixes.append("`mesh.grad_comm=bf16`: half the gradient bytes to exchange")
    if measured.get("platform") == "cpu":
        fixes.insert(
            0,
            "expected on CPUs: the simulated devices share the host's cores and memory, so a "
            "collective is a rendezvous of threads; judge scaling on the GPUs",
        )
    return Finding("poor-scaling", "more devices, no faster", evidence, tuple(fixes))
