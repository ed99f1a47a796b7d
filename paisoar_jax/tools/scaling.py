"""`python -m paisoar_jax.bench --scaling`: the configured step on 1, 2, 4, ... devices, measured.

For each count of devices (powers of two up to all there are, and all) the step runs twice
over: strong scaling keeps the global batch (train.global_batch), weak scaling keeps the
batch per device (train.global_batch / all the devices). The mesh is the configured one
where its model axes (fsdp, tensor, ...) divide the count, data taking the rest; else data
alone. Each run compiles, warms up, then times `steps` steps fed by the run's own input
pipeline, under jax's profiler. From the profile (not a projection): the device time of
each step split into compute and collectives (the collective ops' own time, averaged over
the devices' lines); the input wait is the time the loop waited for a batch, and host time
what is left of the step (dispatch, and the device idle in between).

Efficiency: strong (T1 / Tk) / k, weak T1 / Tk, T the step time at 1 and k devices. Beside
it, plan's projection of the same step: the one device's measured compute (split k ways,
or kept) plus the compiled step's collectives priced on PROJECTED_LINK, as `plan` prices
them. The table prints, <run.dir>/scaling.json keeps it all, and <run.dir>/scaling.png draws
both efficiencies against the devices (with the plot extra's matplotlib). One process: a
launched run measures its own devices only.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any

from paisoar_jax import output
from paisoar_jax.config import Config, config_from_dict, to_dict
from paisoar_jax.config.mesh import DCN_NAMES
from paisoar_jax.errors import UserError

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
COLLECTIVES += ("nccl", "send", "recv")  # a GPU's kernels and point-to-point transfers
MODEL_AXES = ("stage", "fsdp", "expert", "context", "tensor")
PROJECTED_LINK = "nvlink"  # the link plan projects on by default


def device_counts(total: int) -> list[int]:
    """1, 2, 4, ... up to `total`, and `total` itself."""
    counts, count = [], 1
    while count < total:
        counts.append(count)
        count *= 2
    return [*counts, total]


def scaled_overrides(config: Config, count: int, global_batch: int) -> list[str]:
    """The overrides that run `config`'s step on `count` devices with `global_batch`."""
    model_axes = {axis: getattr(config.mesh, axis) for axis in MODEL_AXES}
    product = 1
    for size in model_axes.values():
        product *= max(size, 1)
    keep = product > 0 and count % product == 0 and all(size >= 1 for size in model_axes.values())
    axes = model_axes if keep else dict.fromkeys(MODEL_AXES, 1)
    overrides = [f"mesh.{axis}={size}" for axis, size in axes.items()]
    overrides += [
        f"mesh.data={count // (product if keep else 1)}",
        f"train.global_batch={global_batch}",
    ]
    overrides += [f"mesh.{name}=1" for name in DCN_NAMES]  # one process, all its devices
    return overrides


@dataclasses.dataclass
class Measured:
    """One count of devices in one mode: the step time and its parts, per step."""

    devices: int
    global_batch: int
    step_s: float
    compute_s: float
    collectives_s: float
    input_wait_s: float
    host_s: float
    units_per_s: float
    collective_bytes: int  # per device and step, from the compiled step's HLO (plan's count)
    projected_collectives_s: float  # those bytes over PROJECTED_LINK, as plan prices them


def measure(config: Config, workload: Any, devices: list, steps: int, trace_dir: pathlib.Path):
    """Times `steps` steps of `config` on `devices` (after compiling and two more), profiled."""
    import jax

    from paisoar_jax.data.prefetch import DevicePrefetcher
    from paisoar_jax.engine.state import init_state
    from paisoar_jax.parallel import sharding
    from paisoar_jax.run.setup import setup

    run = setup(config, workload, devices)
    train, task = run.train, run.task
    with jax.set_mesh(run.mesh):
        source, _ = task.open_sources()
        host = task.host_batches(
            source, global_batch=train.global_batch, seed=0, train=True, workers=run.data.workers
        )
        batches = DevicePrefetcher(
            iter(host), sharding.batch_sharding(run.mesh), run.data.prefetch, False
        )
        try:
            state = init_state(train.seed, run.layout)
            step = run.jit_train_step()
            for _ in range(3):  # the compile, then the first runs' own warm-up
                state, metrics = step(state, next(batches))
            jax.block_until_ready(metrics)
            by_kind = _collectives(step, state, next(batches), len(devices))
            waited, start = 0.0, time.perf_counter()
            jax.profiler.start_trace(str(trace_dir))
            try:
                for _ in range(steps):
                    wait_start = time.perf_counter()
                    batch = next(batches)
                    waited += time.perf_counter() - wait_start
                    state, metrics = step(state, batch)
                jax.block_until_ready(metrics)
            finally:
                jax.profiler.stop_trace()
            elapsed = time.perf_counter() - start
        finally:
            batches.close()
    busy_s, collectives_s = device_times(trace_dir, len(devices))
    step_s = elapsed / steps
    units = train.global_batch * task.units_per_example()
    return Measured(
        devices=len(devices),
        global_batch=train.global_batch,
        step_s=step_s,
        compute_s=max(busy_s - collectives_s, 0.0) / steps,
        collectives_s=collectives_s / steps,
        input_wait_s=waited / steps,
        host_s=max(step_s - busy_s / steps - waited / steps, 0.0),
        units_per_s=units / step_s,
        collective_bytes=sum(totals["bytes"] for totals in by_kind.values()),
        projected_collectives_s=sum(totals.get("seconds", 0.0) for totals in by_kind.values()),
    )


def _collectives(step: Any, state: Any, batch: Any, devices: int) -> dict[str, dict]:
    """Plan's account of the compiled step's collectives: bytes and seconds on PROJECTED_LINK."""
    from paisoar_jax.tools.plan import hlo
    from paisoar_jax.tools.plan.core import LINKS

    found, _ = hlo.analyze(step.lower(state, batch).compile().as_text(), devices)
    return hlo.totals_by_kind(found, LINKS[PROJECTED_LINK])


def device_times(trace_dir: pathlib.Path, devices: int) -> tuple[float, float]:
    """(busy seconds, collective seconds) of a traced span, per device.

    On a GPU each device's "XLA Ops" line holds its ops: busy is their time, collectives
    the collective ops'. On a CPU each device's execution is a client thread's `(wait for
    completion)` span (tf_XLAPjRtCpuClient/...), while its thunks, collectives among them,
    run on a pool's threads (tf_XLAEigen/...). Collectives count their outermost event (a
    rendezvous inside an all-reduce is the all-reduce's).
    """
    import jax

    paths = sorted(trace_dir.rglob("*.xplane.pb"))
    if not paths:
        raise UserError(f"the profiler wrote no trace under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(str(paths[-1]))
    busy_lines, collectives = [], 0.0
    for plane in data.planes:
        for line in plane.lines:
            events = list(line.events)
            if plane.name.startswith("/device:") and line.name == "XLA Ops":
                busy_lines.append(_outermost(events, lambda name: True))
                collectives += _outermost(events, lambda name: name.startswith(COLLECTIVES))
            elif line.name.startswith("tf_XLAPjRtCpuClient"):
                busy_lines.append(_outermost(events, lambda name: "wait for completion" in name))
            elif any(event.name == "ThunkExecutor::Execute" for event in events):
                collectives += _outermost(events, lambda name: name.startswith(COLLECTIVES))
    busy_lines = sorted(busy_lines, reverse=True)[:devices]
    busy = sum(busy_lines) / len(busy_lines) if busy_lines else 0.0
    return busy, collectives / devices


def _outermost(events: list, counts) -> float:
    """Seconds of the events `counts(name)` keeps, each not inside another one kept."""
    total, end = 0.0, -1.0
    for event in sorted(events, key=lambda one: (one.start_ns, -one.duration_ns)):
        if event.start_ns >= end and counts(event.name.lower()):
            total += event.duration_ns / 1e9
            end = event.start_ns + event.duration_ns
    return total


def scaling(config: Config, workload: Any = None, steps: int = 10) -> dict[str, Any]:
    """Strong and weak scaling of `config`'s step on 1 .. all devices (see the module)."""
    import jax

    from paisoar_jax.tasks.zoo import zoo_workload

    if steps < 1:
        raise UserError(f"--steps {steps}: time at least one step")
    devices = jax.devices()
    total = len(devices)
    per_device = config.train.global_batch // total
    if per_device < 1 or config.train.global_batch % total:
        raise UserError(
            f"--scaling: train.global_batch={config.train.global_batch} does not split over the "
            f"{total} devices; give a multiple of {total}"
        )
    results: dict[str, list[dict[str, Any]]] = {"strong": [], "weak": []}
    directory = config.run_dir / "scaling"
    for mode in ("strong", "weak"):
        for count in device_counts(total):
            batch = config.train.global_batch if mode == "strong" else per_device * count
            if batch % (count * config.train.grad_accum):
                skipped = f"--scaling: {mode} at {count} devices skipped (batch {batch})"
                output.note(skipped, stderr=True)
                continue
            try:
                scaled = config_from_dict(to_dict(config), scaled_overrides(config, count, batch))
                workload_k = zoo_workload(scaled) if workload is None else workload
                trace = directory / f"{mode}_{count}"
                measured = measure(scaled, workload_k, devices[:count], steps, trace)
            except UserError as error:  # a count this step cannot run at: the others still
                output.note(f"--scaling: {mode} at {count} devices skipped: {error}", stderr=True)
                continue
            results[mode].append(dataclasses.asdict(measured))
            took = f"--scaling: {mode} {count} device(s): {measured.step_s * 1e3:.3g} ms/step"
            output.note(took, stderr=True)
    for mode, rows in results.items():
        _efficiencies(mode, rows)
    summary = {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "steps": steps,
        "per_device_batch": per_device,
        **results,
    }
    config.run_dir.mkdir(parents=True, exist_ok=True)
    (config.run_dir / "scaling.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["plot"] = draw(summary, config.run_dir / "scaling.png")
    return summary


def _efficiencies(mode: str, rows: list[dict[str, Any]]) -> None:
    """Each row's measured efficiency, and plan's projection of it.

    The projection keeps the one device's measured compute (split k ways under strong
    scaling, kept under weak) and adds the compiled step's collectives priced on
    PROJECTED_LINK, without overlap: what `plan` projects for the same step.
    """
    one = rows[0] if rows and rows[0]["devices"] == 1 else None
    for row in rows:
        strong, count = mode == "strong", row["devices"]
        if one is None:
            row["efficiency"] = row["projected_efficiency"] = None
            continue
        speedup = one["step_s"] / row["step_s"]
        row["efficiency"] = speedup / count if strong else speedup
        compute = one["compute_s"] / count if strong else one["compute_s"]
        projected = compute + row["projected_collectives_s"]
        ratio = one["compute_s"] / projected if projected else 1.0
        row["projected_efficiency"] = ratio / count if strong else ratio


def format_table(summary: dict[str, Any]) -> str:
    """The scaling table: one row per mode and count of devices."""
    head = f"{'mode':<7}{'devices':>8}{'batch':>7}{'step ms':>10}{'compute':>9}"
    head += f"{'collect.':>9}{'input':>8}{'host':>8}{'efficiency':>12}{'projected':>11}"
    lines = [head]
    for mode in ("strong", "weak"):
        for row in summary[mode]:
            measured, projected = row["efficiency"], row["projected_efficiency"]
            lines.append(
                f"{mode:<7}{row['devices']:>8}{row['global_batch']:>7}{row['step_s'] * 1e3:>10.3g}"
                f"{row['compute_s'] * 1e3:>9.3g}{row['collectives_s'] * 1e3:>9.3g}"
                f"{row['input_wait_s'] * 1e3:>8.3g}{row['host_s'] * 1e3:>8.3g}"
                f"{'' if measured is None else f'{measured:.0%}':>12}"
                f"{'' if projected is None else f'{projected:.0%}':>11}"
            )
    lines.append(
        f"(ms per step, measured; efficiency: strong (T1/Tk)/k, weak T1/Tk; projected: the "
        f"one device's compute plus plan's collectives on {PROJECTED_LINK}, no overlap)"
    )
    return "\n".join(lines)


def draw(summary: dict[str, Any], path: pathlib.Path) -> str | None:
    """Efficiency against devices, measured and projected, as a PNG at `path`.

    None (and a line) without matplotlib (the plot extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        needs = "--scaling: scaling.png needs matplotlib: pip install 'paisoar_jax[plot]'"
        output.note(needs, stderr=True)
        return None
    figure, axes = pyplot.subplots(figsize=(6, 4))
    for mode, color in (("strong", "tab:blue"), ("weak", "tab:orange")):
        rows = [row for row in summary[mode] if row["efficiency"] is not None]
        counts = [row["devices"] for row in rows]
        axes.plot(counts, [row["efficiency"] for row in rows], "o-", color=color, label=mode)
        projected = [row["projected_efficiency"] for row in rows]
        label = f"{mode}, plan's projection ({PROJECTED_LINK})"
        axes.plot(counts, projected, "x--", color=color, alpha=0.6, label=label)
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("devices")
    axes.set_ylabel("efficiency")
    axes.set_title(f"scaling on {summary['device_kind']}: measured and projected")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return str(path)
