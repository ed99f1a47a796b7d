"""The plan as the table `python -m paisoar_jax.plan` prints (core.py makes the plan)."""

from __future__ import annotations

from typing import Any

from paisoar_jax.engine.memory import format_bytes
from paisoar_jax.output import format_count
from paisoar_jax.parallel.sharding import OPTIONAL_AXES
from paisoar_jax.tools.plan import fit_search, gpu_target


def _compute_line(result: dict[str, Any], seconds: float) -> str:
    """The step's compute time and FLOPs, or unknown when no FLOPs count was given."""
    if not result["flops_per_device"]:  # a model of one's own, its FLOPs not given
        return f"  compute{'unknown':>23}   (give flops_per_example to count it)"
    return (
        f"  compute{_duration(seconds):>23}   "
        f"({result['flops_per_device'] / 1e12:.3g} TFLOP per device"
        f"{', with the pipeline bubble' if result.get('pipeline') else ''})"
    )


def _efficiency(result: dict[str, Any], overlap: str) -> str:
    """The scaling efficiency with `overlap`, or unknown when the compute is."""
    if not result["flops_per_device"]:
        return "unknown"
    return f"{result['scaling_efficiency'][overlap]:.1%}"


def _step(result: dict[str, Any], key: str) -> str:
    """A step time of `time_s`, or unknown when the compute is (no FLOPs count given)."""
    return _duration(result["time_s"][key]) if result["flops_per_device"] else "unknown"


def _pipeline_lines(report: dict[str, Any] | None) -> list[str]:
    """The pipeline section of the table (nothing without stages)."""
    if report is None:
        return []
    return [
        "",
        f"pipeline {report['schedule']}: {report['stages']} stages, {report['microbatches']} "
        f"micro-batches, {report['repeats']} lap(s), {report['iterations']} iterations",
        f"  bubble {report['bubble']:.1%} of the step (stages - 1) / (micro-batches x laps + "
        "stages - 1); memory above is one stage's",
        f"  stage to stage {format_bytes(report['p2p_bytes']):>10} per device per step "
        f"(collective-permute), {_duration(report['p2p_seconds'])}",
    ]


def _experts_lines(report: dict[str, Any] | None) -> list[str]:
    """The mixture-of-experts section of the table (nothing for a dense model)."""
    if report is None:
        return []
    capacity = report["capacity_factor"] or "0 (dropless)"
    return [
        "",
        f"experts: {report['experts']}, {report['experts_per_token']} per token, capacity "
        f"factor {capacity}",
        f"  {report['experts_per_device']} per device (mesh.expert={report['expert_shards']}), "
        f"their parameters {format_bytes(report['expert_bytes_per_device'])} per device",
        f"  tokens to their experts and back {format_bytes(report['all_to_all_bytes']):>10} per "
        f"device per step (all-to-all), {_duration(report['all_to_all_seconds'])}",
    ]


def _context_lines(report: dict[str, Any] | None, sizes: dict[str, Any] | None) -> list[str]:
    """The context-split section of the table, and the sizes `--context-for` compiled."""
    lines = []
    if report is not None:
        hidden = report["hop_seconds"] <= report["hop_attention_seconds"]
        lines += [
            "",
            f"context: mesh.context={report['context_shards']}, {report['tokens_per_device']} "
            f"tokens per device, {report['strategy']} attention"
            + (", balanced" if report["balanced"] else ""),
            f"  keys and values {format_bytes(report['kv_bytes_per_step']):>10} per device per "
            f"step (modelled from the shapes), {_duration(report['kv_seconds_per_step'])}",
            f"  per slice {_duration(report['hop_seconds'])} of transfer against "
            f"{_duration(report['hop_attention_seconds'])} of attention to it: "
            + ("hidden" if hidden else "exposed")
            + f" (at least {report['min_tokens_per_device']} tokens per device hide it)",
        ]
    if sizes is not None:
        lines += [
            "",
            f"context sizes for {sizes['length']} tokens, train.global_batch="
            f"{sizes['global_batch']} (each compiled; mesh.data gives way):",
        ]
        for row in sizes["sizes"]:
            if "skipped" in row:
                lines.append(f"  mesh.context={row['context']:<3} skipped: {row['skipped']}")
                continue
            fits = {None: "", True: "  fits", False: "  does not fit"}[row["fits"]]
            lines.append(
                f"  mesh.context={row['context']:<3} {format_bytes(row['bytes']):>10} per "
                f"device{fits}"
            )
        if sizes["proposal"]:
            lines.append(f"  propose: {' '.join(sizes['proposal'])}")
        elif sizes["limited"]:
            lines.append("  none fits")
        else:
            lines.append("  no limit to fit: give --target or train.memory_limit_gb")
    return lines


def _duration(seconds: float) -> str:
    """Seconds in ms (us below 0.1 ms, ns below 0.1 us), three significant digits."""
    if seconds < 1e-7:
        return f"{seconds * 1e9:.3g} ns"  # a collective of a few bytes: short, in its column
    if seconds < 1e-4:
        return f"{seconds * 1e6:.3g} us"
    return f"{seconds * 1e3:.3g} ms"


def _example_shape(result: dict) -> str:
    """The shape of one example: " x 1024 tokens" or " x 224 px images"."""
    if "seq_len" in result:
        return f" x {result['seq_len']} tokens"
    if "image_size" in result:
        return f" x {result['image_size']} px images"
    return f" ({result['unit']})"  # a model of one's own: its batch has no known shape


def format_table(result: dict) -> str:
    """The plan as a short aligned table."""
    # A mesh without stages, experts or context split reads as before: data, fsdp, tensor.
    mesh = " ".join(
        f"{axis}={size}"
        for axis, size in result["mesh"].items()
        if axis not in OPTIONAL_AXES or size > 1
    )
    where = "simulated cpu" if result["simulated"] else result["platform"]
    if "target" in result:
        where = f"{result['target']['name']} (compile-only)"
    memory_bytes, times = result["memory_bytes"], result["time_s"]
    link = result["link"]
    trainable, count = result.get("trainable_count", result["param_count"]), result["param_count"]
    frozen = count - trainable
    lora = f" (LoRA: {format_count(trainable)} trainable, {format_count(frozen)} frozen)"
    lines = [
        f"{result['model']}: {format_count(count)} params{lora if frozen else ''}, "
        f"{result['precision']}, "
        f"batch {result['global_batch']}{_example_shape(result)}, "
        f"grad_accum {result['grad_accum']}",
        f"mesh {mesh}, zero={result['zero']}: {result['devices']} {where} devices; "
        f"compiled in {result['compile_s']:.1f} s",
        "",
        "memory per device",
    ]
    notes = {
        "gradients": "(inside the temporaries)",
        "temporaries": "(XLA temp: activations, gradients, workspace)",
        "total": "(inputs + outputs - donated + temporaries + code)",
    }
    for key, value in memory_bytes.items():
        label = key.replace("_", " ")
        lines.append(f"  {label:<22}{format_bytes(value):>11}   {notes.get(key, '')}".rstrip())
    lines += _verdict_lines(result.get("memory_verdict"))
    lines += ["", "parameters (mesh axes per dimension; - whole)"]
    parameters = result["parameters"]
    width = max((len(row["path"]) for row in parameters), default=0)
    for row in parameters:
        shape = "x".join(map(str, row["shape"])) or "scalar"
        lines.append(f"  {row['path']:<{width}}  {shape:>14}  {row['sharding']}")
    lines += ["", f"collectives per step        {'runs':>6}{'bytes/device':>14}{'time':>11}"]
    for row in result["collectives_by_dtype"]:
        size, seconds = format_bytes(row["bytes"]), _duration(row["seconds"])
        label = f"{row['kind']} {row['dtype']}"
        lines.append(f"  {label:<25}{row['count']:>6}{size:>14}{seconds:>11}")
    if not result["collectives_by_dtype"]:
        lines.append("  none")
    lines += [
        "",
        f"step time on {link['name']} ({link['gb_per_s']:g} GB/s per direction), "
        f"{result['peak_tflops']:g} TFLOP/s x {result['efficiency']:g} efficiency",
        f"  peak: {result['peak_source']}",
        _compute_line(result, times["compute"]),
        f"  communication{_duration(times['communication']):>17}   "
        "(ring: all-reduce 2(n-1)/n x bytes, gather/scatter (n-1)/n)",
        f"  step, no overlap{_step(result, 'step_no_overlap'):>14}   "
        f"scaling efficiency {_efficiency(result, 'no_overlap')}",
        f"  step, full overlap{_step(result, 'step_perfect_overlap'):>12}   "
        f"scaling efficiency {_efficiency(result, 'perfect_overlap')}",
    ]
    lines += _pipeline_lines(result.get("pipeline"))
    lines += _experts_lines(result.get("experts"))
    lines += _context_lines(result.get("context"), result.get("context_sizes"))
    if "target" in result:
        lines += gpu_target.report_lines(result["target"])
    if "fit" in result:
        lines += fit_search.fit_lines(result["fit"])
    lines += _comparison_lines(result.get("grad_comm_comparison"))
    if result["unknown_trip_counts"]:
        lines.append(f"warning: loops counted once: {', '.join(result['unknown_trip_counts'])}")
    if result["platform"] == "cpu" and (result["zero"] or result["mesh"]["fsdp"] > 1):
        lines.append("note: XLA CPU emits all-reduce + slice where XLA GPU emits reduce-scatter")
    return "\n".join(lines)


def _comparison_lines(comparison: dict[str, Any] | None) -> list[str]:
    """The side-by-side table of --compare-grad-comm (nothing without it)."""
    if not comparison:
        return []
    settings = list(comparison)
    lines = [
        "",
        "mesh.grad_comm side by side: step time, no overlap (scaling efficiency)",
        "  " + f"{'link':<12}" + "".join(f"{setting:>20}" for setting in settings),
    ]
    for link in comparison[settings[0]]["links"]:
        cells = []
        for setting in settings:
            times = comparison[setting]["links"][link]
            step, share = times["time_s"]["step_no_overlap"], times["scaling_efficiency"]
            cells.append(f"{_duration(step)} ({share['no_overlap']:.0%})")
        lines.append("  " + f"{link:<12}" + "".join(f"{cell:>20}" for cell in cells))
    lines.append(
        "  "
        + f"{'wire/device':<12}"
        + "".join(f"{format_bytes(comparison[s]['wire_bytes']):>20}" for s in settings)
    )
    return lines


def _verdict_lines(verdict: dict | None) -> list[str]:
    """Whether the CPU estimate fits its limit, and the fixes in order when it does not."""
    if verdict is None:
        return []
    limit = f"{format_bytes(verdict['limit_bytes'])} ({verdict['limit_source']})"
    if verdict["fits"]:
        return [f"  fits {limit}; the CPU compiler's estimate (--target for a GPU's)"]
    lines = [
        f"  does not fit {limit}: {format_bytes(verdict['needed_bytes'])} needed, the CPU "
        "compiler's estimate (--target for a GPU's)",
        "  fixes, in the order to try them (--fit compiles each and proposes the smallest):",
    ]
    lines += [f"    {fix['override']}  {fix['why']}" for fix in verdict["fixes"]]
    return lines
