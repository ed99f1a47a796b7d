"""The doctor's checks of skipped steps: a falling loss scale, many skipped, loss spikes.

They read loss_scale, skipped_steps and skipped_spikes (train.skip_spikes) from
metrics.jsonl. A falling scale is judged as the loop judges it (monitor.scale_keeps_falling):
only once the scale has settled.
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
from paisoar_jax.tools.doctor.loss_findings import exploding

SKIPPED_LIMIT = 0.05
MIN_SKIPPED = 3  # fewer skips after the start-up are overflows a dynamic scale expects


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


def start_up(run: Run) -> tuple[int, int]:
    """(step, steps skipped by then) where a dynamic scale's start-up halvings ended.

    The scale starts high (precision.initial_scale) and halves at each overflow until
    steps go through: those skips are the scaler finding its level, not a problem. The
    start-up ends at the first log step whose scale is not below the one before.
    """
    precision = run.config.precision
    previous = precision.initial_scale
    skipped = dict(series(run.records, "skipped_steps"))
    for step, scale in series(run.records, "loss_scale"):
        if scale >= previous and scale > precision.min_scale:  # (the floor is no level)
            return step, skipped.get(step, 0)
        previous = scale
    return 0, 0  # still falling, or on the floor: every skip counts


def skipped_steps(run: Run) -> Finding | None:
    """Over 5% (and 3 or more) of the steps after the scale's start-up were skipped."""
    skipped = series(run.records, "skipped_steps")
    if not skipped:
        return None
    start_step, start_count = start_up(run) if loss_scale_mode(run.config) == "dynamic" else (0, 0)
    last_step, last_count = skipped[-1]
    steps, count = last_step - start_step, last_count - start_count
    if steps <= 0 or count < MIN_SKIPPED or count / steps <= SKIPPED_LIMIT:
        return None
    precision = run.config.precision
    scales = [scale for _, scale in series(run.records, "loss_scale")]
    fixes = []
    if exploding(run):  # the updates overshoot: the scale is not the cause
        fixes.append(lower_lr(run, ": the loss exploded as the steps were skipped"))
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
    if not fixes[0].startswith(("`optim.lr", "a lower")):
        fixes.append(lower_lr(run, " if the skips go on: the gradients blow up"))
    after = f" after the scale's start-up (to step {start_step})" if start_step else ""
    evidence = (
        f"{count} of {steps} steps skipped{after} ({percent(count / steps)}, over "
        f"{SKIPPED_LIMIT:.0%})"
    )
    return Finding("skipped-steps", "many steps were skipped", evidence, tuple(fixes))


def skipped_spikes(run: Run) -> Finding | None:
    """Steps were skipped as loss spikes: how many, between which log steps, what to try."""
    counts = series(run.records, "skipped_spikes")
    if not counts or counts[-1][1] == 0:
        return None
    # The log intervals in which the count rose: where to look at the data.
    rose = [
        (earlier_step, step)
        for (earlier_step, earlier), (step, count) in zip([(0, 0), *counts], counts, strict=False)
        if count > earlier
    ]
    where = ", ".join(f"{start + 1}-{end}" if end > start + 1 else f"{end}" for start, end in rose)
    last_step, count = counts[-1]
    evidence = (
        f"{count} of {last_step} steps skipped as loss spikes (train.skip_spikes="
        f"{run.config.train.skip_spikes:g}: a loss that many standard deviations over the "
        f"last 128 steps' mean), in steps {where}"
    )
    optim = run.config.optim
    fixes = [
        "the batches of those steps: a spike that comes back at the same step of a rerun is "
        "in the data (a document of another language, repeated or corrupt text)",
        lower_lr(run, ": spikes that come from the updates themselves shrink with it"),
    ]
    if not own_optimizer(run):
        warmup = max(100, 2 * optim.warmup_steps)
        fixes.append(f"`optim.warmup_steps={warmup}` (now {optim.warmup_steps})")
    return Finding("skipped-spikes", "steps were skipped as loss spikes", evidence, tuple(fixes))
