"""`python -m paisoar_jax.doctor RUN_DIR [--json]`: what holds a run back, and the fix.

Reads RUN_DIR/config.yaml, RUN_DIR/metrics.jsonl and, when present, RUN_DIR/plan.json
(written by `python -m paisoar_jax.plan ... --output RUN_DIR/plan.json`), and runs one
check per known problem. Each finding shows its evidence (numbers and steps of this run)
and the fixes, most useful first, each naming the override to type. The exit status is 0
whatever is found ("no findings" for a healthy run), 2 with one line when the run
directory or its metrics cannot be read.

  check                 fires when
  out-of-memory         the run stopped at a step that did not fit (out_of_memory.json)
  bad-inputs            the loss is not finite at the first step, before any update, or
                        a batch made it so from sane weights (its examples named)
  exploding             a finite loss reached 3x the loss before any update
  diverging             a non-finite loss, or a loss rising for 3 log steps to 25% over
                        its minimum
  loss-scale-collapse   the dynamic loss scale fell at each of the last 3 log steps
  not-learning          the loss ends (median of its last 3 logs) at 98% of the first
  no-gradient           the gradient is exactly 0 at every log step
  skipped-steps         over 5% of the steps after the loss scale's start-up were
                        skipped
  input-bound           the input wait is over 5% of the step time (20% on a CPU), after
                        the first log; the workers it proposes fit the run's cores
  poor-scaling          scaling.json (bench --scaling): strong efficiency under 50%; or
                        a run over several processes on CPUs (gloo)
  communication-bound   plan.json: collectives over 30% of the projected step
  pipeline-bubble       mesh.stage > 1: the schedule's bubble is over 20% of the step
  low-mfu               the median MFU is below the floor for the model's size
  memory-headroom       peak device memory under 50% of the limit (room for more batch);
                        without a measured peak, plan.json's GPU plan (plan --target)
  memory-near-limit     peak device memory (or the GPU plan's) over 90% of the limit
  recompiles            the train step compiled again after its first compilation
  expert-imbalance      a MoE layer's busiest expert takes over 2x the mean expert's
                        tokens
  dropped-tokens        a MoE layer's capacity drops over 3% of its expert choices
  context-bound         plan.json: a slice's keys and values move slower than it is
                        attended

`--measure-scaling` first runs `bench --scaling` on the run's config into
RUN_DIR/scaling.json. Measurements come first (metrics.jsonl, out_of_memory.json,
scaling.json), projections (plan.json) after, and each finding's evidence says which it
read. Missing or null metrics fields (memory on CPU, MFU without a known peak) skip
their check. The checks and their thresholds are in the *_findings.py modules beside
this one, and tools/plan/context_split.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from paisoar_jax import output
from paisoar_jax.cli import exit_status
from paisoar_jax.config import FIT_CONFIG_MARK, config_from_dict, load_config, to_dict
from paisoar_jax.errors import UserError
from paisoar_jax.run.oom import RECORD_NAME
from paisoar_jax.tools.doctor import (
    findings,
    gradient_findings,
    loss_findings,
    moe_findings,
    scale_findings,
    scaling_findings,
)
from paisoar_jax.tools.doctor.findings import Finding, Run
from paisoar_jax.tools.doctor.memory_findings import memory_headroom, out_of_memory
from paisoar_jax.tools.plan import context_split

PROGRAM = "paisoar_jax.doctor"
CHECKS: tuple[Callable[[Run], Finding | None], ...] = (
    out_of_memory,  # what stopped the run, then what its loss did, then its speed
    gradient_findings.bad_inputs,  # before diverging: it says the cause of that nan
    loss_findings.exploding,
    loss_findings.diverging,
    scale_findings.loss_scale_collapse,
    loss_findings.not_learning,
    gradient_findings.no_gradient,
    scale_findings.skipped_steps,
    scale_findings.skipped_spikes,
    findings.input_bound,
    scaling_findings.poor_scaling,  # measured, before the plan's projection
    findings.communication_bound,
    findings.pipeline_bubble,
    findings.low_mfu,
    memory_headroom,
    findings.recompiles,
    moe_findings.expert_imbalance,
    moe_findings.dropped_tokens,
    moe_findings.collapsing_router,
    context_split.context_bound,
)


def _read_json_lines(path: pathlib.Path) -> list[dict[str, Any]]:
    """The complete records of a metrics.jsonl (a last line still being written is left out)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise UserError(f"cannot read {path} ({error.strerror or error})") from None
    records = []
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        if not line.endswith("\n"):
            break
        if not line.strip():
            continue
        try:
            record = json.loads(line)  # Python's json reads the NaN and Infinity it writes
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or "step" not in record:
            raise UserError(f"{path}:{number} is not a metrics record (a JSON object with step)")
        records.append(record)
    if not records:
        raise UserError(f"{path} holds no records yet (one comes every train.log_every steps)")
    return records


def load_run(directory: pathlib.Path) -> Run:
    """Reads a run directory; a missing or unreadable part raises UserError."""
    if not directory.is_dir():
        raise UserError(f"{directory}: no such run directory")
    config_path = directory / "config.yaml"
    if not config_path.is_file():
        raise UserError(f"{directory} is not a run directory (no config.yaml)")
    try:
        config = load_config(str(config_path))
    except OSError as error:
        raise UserError(f"cannot read {config_path} ({error.strerror or error})") from None
    metrics = directory / "metrics.jsonl"
    if (directory / RECORD_NAME).is_file() and not _has_records(metrics):
        records = []  # it stopped before its first log step: out_of_memory.json says why
    else:
        records = _read_json_lines(metrics)
    plan_path, plan = directory / "plan.json", None
    if plan_path.exists():
        try:
            plan = json.loads(plan_path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise UserError(f"cannot read {plan_path} ({error})") from None
    by_fit = config_path.read_text().startswith(FIT_CONFIG_MARK)
    return Run(directory, config, records, plan, by_fit)


def _has_records(path: pathlib.Path) -> bool:
    """Whether a metrics.jsonl exists and holds a complete line."""
    try:
        return "\n" in path.read_text()
    except OSError:
        return False


def measure_scaling(directory: pathlib.Path, steps: int = 5) -> None:
    """Runs bench --scaling on the run's config into the run directory (its scaling.json)."""
    from paisoar_jax.tools.bench import BENCH_OVERRIDES
    from paisoar_jax.tools.scaling import scaling

    run = load_run(directory)
    if run.by_fit:
        raise UserError(
            f"{directory} was trained by paisoar_jax.fit: measure its scaling with "
            f"paisoar_jax.bench_fit(..., scaling=True, overrides=['run.dir={directory}'])"
        )
    overrides = ["data.source=synthetic", *BENCH_OVERRIDES, f"run.dir={directory}"]
    scaling(config_from_dict(to_dict(run.config), overrides), steps=steps)


def diagnose(run: Run) -> list[Finding]:
    """Every finding of every check, in the order of CHECKS (without records: what stopped it)."""
    checks = CHECKS if run.records else (out_of_memory,)
    return [finding for check in checks if (finding := check(run)) is not None]


def format_findings(run: Run, findings: Sequence[Finding]) -> str:
    """The findings as text: title, evidence and fixes of each."""
    if not findings:
        return f"{run.directory}: no findings"
    lines = [f"{run.directory}: {len(findings)} finding{'s' * (len(findings) > 1)}"]
    for number, finding in enumerate(findings, start=1):
        lines += [
            "",
            f"{number}. {finding.name}: {finding.title}",
            f"   evidence: {finding.evidence}",
        ]
        lines += [f"   fix: {fix}" for fix in finding.fixes]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description="Read a run directory and say what holds the run back, with the fix.",
    )
    parser.add_argument("run_dir", type=pathlib.Path, help="a run directory (holds config.yaml)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.add_argument(
        "--measure-scaling",
        action="store_true",
        help="first measure the run's step on 1, 2, 4, ... devices (bench --scaling, into "
        "RUN_DIR/scaling.json), then judge from it",
    )
    args = parser.parse_args(argv)

    def work() -> None:
        if args.measure_scaling:
            measure_scaling(args.run_dir)
        run = load_run(args.run_dir)
        findings = diagnose(run)
        if args.json:
            payload = {
                "run_dir": str(run.directory),
                "findings": [dataclasses.asdict(finding) for finding in findings],
            }
            output.result(json.dumps(payload))
        else:
            output.result(format_findings(run, findings))

    return exit_status(PROGRAM, work)


if __name__ == "__main__":
    sys.exit(main())
