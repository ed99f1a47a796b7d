"""The doctor's checks of a loss-scaled run: a scale that keeps falling, many skipped steps.

Both read loss_scale and skipped_steps from metrics.jsonl. A falling scale is judged as the
loop judges it (monitor.scale_keeps_falling): only once the scale has settled.
"""

from __future__ import annotations

from paisoar_jax.config import Config
from paisoar_jax.observe.monitor import FALLING_SCALE_LOGS, scale_keeps_falling
from paisoar_jax.tools.doctor.findings import (
    Finding,
    Run,
    loss_scale_mode,
    lower_lr,
    own_optimizer,
    percent,
    series,
)

SKIPPED_LIMIT = 0.05


def _scale(value: float) -> str:
    """A loss scale as a whole number where it is one (65536, not 6.5536e+04)."""
    return f"{value:.0f}" if value >= 1 and value == int(value) else f"{value:g}"


def _no_loss_scale(config: Config) -> str:
    """The fix that needs no loss scale: bf16 for an fp16 run, no scaling for the others."""
    if config.precision.policy == "fp16":
        return "`precision.policy=bf16`: fp32's range, so no loss scale and no skipped steps"
    return f"`precision.loss_scale=none`: {config.precision.policy} needs no loss scale"


def loss_scale_collapse(run: Run) -> Finding | None:
    """The dynamic loss scale keeps falling once settled (as the loop warns): gradients blow up."""
    if loss_scale_mode(run.config) != "dynamic":
        return None
    scales = series(run.records, "loss_scale")
    skipped = dict(series(run.records, "skipped_steps"))
    start = (0, run.config.precision.initial_scale, 0)  # metrics.jsonl holds the run whole
    points = [start, *((step, scale, skipped.get(step, 0)) for step, scale in scales)]
    if not scale_keeps_falling(points):
        return None
    (first_step, first, _), (last_step, last, _) = points[-(FALLING_SCALE_LOGS + 1)], points[-1]
    config = run.config
    fixes = [lower_lr(run)]
    if config.optim.clipping(own_optimizer(run)) == 0:
        fixes.append("`optim.clip_norm=1.0`: clip the gradient norm")
    fixes.append(_no_loss_scale(config))
    evidence = (
        f"the loss scale fell at each of the last {FALLING_SCALE_LOGS} log steps: "
        f"{_scale(first)} at step {first_step} -> {_scale(last)} at step {last_step}; a scale "
        "that keeps falling means the gradients themselves blow up, not an occasional overflow"
    )
    return Finding("loss-scale-collapse", "the loss scale keeps falling", evidence, tuple(fixes))


def skipped_steps(run: Run) -> Finding | None:
    """Over 5% of the steps were skipped for non-finite gradients."""
    skipped = series(run.records, "skipped_steps")
    if not skipped:
        return None
    last_step, count = skipped[-1]
    if last_step <= 0 or count / last_step <= SKIPPED_LIMIT:
        return None
    precision = run.config.precision
    scales = [scale for _, scale in series(run.records, "loss_scale")]
    fixes = []
    # A scale that stopped falling settled where steps go through: start there. One still
    # falling has no such value (loss_scale_collapse reports it).
    if scales and scales[-1] < precision.initial_scale and loss_scale_collapse(run) is None:
        fixes.append(
            f"`precision.initial_scale={_scale(scales[-1])}`: start where the scale settled "
            f"(it started at {_scale(precision.initial_scale)}; each halving skipped a step)"
        )
    if any(later > earlier for earlier, later in zip(scales, scales[1:], strict=False)):
        fixes.append(
            f"`precision.growth_interval={2 * precision.growth_interval}`: grow the scale "
            "less often (each growth that overflows skips a step)"
        )
    fixes.append(_no_loss_scale(run.config))
    fixes.append(lower_lr(run, " if the skips go on: the gradients blow up"))
    evidence = (
        f"{count} of {last_step} steps skipped ({percent(count / last_step)}, over "
        f"{SKIPPED_LIMIT:.0%}); {skipped[0][1]} of them by the first log step ({skipped[0][0]})"
    )
    return Finding("skipped-steps", "many steps were skipped", evidence, tuple(fixes))
