"""The doctor's checks of the loss itself: one that exploded, and one that does not fall.

Both compare the logged losses with the loss before any update: the first record's
`first_step_loss` (a fresh model's is about chance, ln of the classes or of the vocabulary),
else the first logged loss. A finite explosion is a loss that reached EXPLODED_FACTOR times
that; a loss that does not fall ends (the median of its last log steps) at 98% of it or
more. `diverging`: a non-finite loss (a run of them under a loss scaler, which skips one),
or a loss rising for TREND_LOGS log steps well over its minimum.
"""

from __future__ import annotations

import math
import statistics

from paisoar_jax.checkpointing.checkpoint import checkpoint_directory
from paisoar_jax.tools.doctor.findings import (
    DIVERGED_MARGIN,
    TREND_LOGS,
    Finding,
    Run,
    loss_scale_mode,
    lower_lr,
    own_optimizer,
    series,
)

EXPLODED_FACTOR = 3.0  # a finite loss this many times the one before any update exploded
NOT_FALLING = 0.98  # the last losses at 98% of the first or more: the model does not learn
UNMOVED = 0.02  # every loss within 2% of the first: the weights barely changed
LAST_LOGS = 3  # the log steps whose median is the loss a run ended at
MIN_LOGS = 4  # log steps a judgement of the loss's course needs


def reference_loss(run: Run) -> tuple[float, str] | None:
    """(the loss before any update, where it comes from), or None without one."""
    first = run.records[0] if run.records else {}
    before = first.get("first_step_loss")
    if before is not None and math.isfinite(before):
        return before, f"{before:.4g} (the first step, before any update)"
    losses = [loss for _, loss in series(run.records, "loss") if math.isfinite(loss)]
    return (losses[0], f"{losses[0]:.4g} (the first log step)") if losses else None


def chance_loss(run: Run) -> float | None:
    """A uniform guess's loss: ln(classes) or ln(vocabulary); None when it is not known."""
    model = run.config.model
    count = getattr(model, "num_classes", 0) or getattr(model, "vocab_size", 0)
    return math.log(count) if count and model.name != "custom" else None


def _explosion_fixes(run: Run, why: str) -> tuple[str, ...]:
    """The learning rate first (`why`: what shows it), then clipping, warm-up and bf16."""
    config = run.config
    fixes = [lower_lr(run, why)]
    if config.optim.clipping(own_optimizer(run)) == 0:
        fixes.append("`optim.clip_norm=1.0`: clip the gradient norm")
    if not own_optimizer(run):
        warmup = max(100, 2 * config.optim.warmup_steps)
        fixes.append(f"`optim.warmup_steps={warmup}` (now {config.optim.warmup_steps})")
    if config.precision.policy == "fp16":
        fixes.append("`precision.policy=bf16`: fp32's range, no loss scale to fall")
    return tuple(fixes)


def exploding(run: Run) -> Finding | None:
    """A finite loss that reached 3x the loss before any update (the lr is too high)."""
    reference = reference_loss(run)
    finite = [(step, loss) for step, loss in series(run.records, "loss") if math.isfinite(loss)]
    if reference is None or not finite or reference[0] <= 0:
        return None
    step, peak = max(finite, key=lambda item: item[1])
    if peak < EXPLODED_FACTOR * reference[0]:
        return None
    last_step, last = finite[-1]
    evidence = (
        f"the loss went from {reference[1]} to {peak:.4g} at step {step} "
        f"({peak / reference[0]:.3g}x; {last:.4g} at step {last_step}, the last log step)"
    )
    why = ": the loss rose within the first steps, the updates overshoot"
    return Finding("exploding", "the loss exploded", evidence, _explosion_fixes(run, why))


def not_learning(run: Run) -> Finding | None:
    """The loss ends at 98% or more of the loss before any update (and did not explode).

    Not said of a fine-tune (checkpoint.init_from: the loss starts trained) or of a run
    that skipped most of its updates (skipped-steps names that).
    """
    reference = reference_loss(run)
    losses = [(step, loss) for step, loss in series(run.records, "loss") if math.isfinite(loss)]
    if reference is None or len(losses) < MIN_LOGS or exploding(run) is not None:
        return None
    if run.config.checkpoint.init_from:  # fine-tuning starts from a trained loss already
        return None
    last_record = run.records[-1]
    skipped = last_record.get("skipped_steps") or 0
    if skipped > last_record["step"] / 2:  # the updates were skipped: skipped-steps says why
        return None
    first = reference[0]
    last = statistics.median(loss for _, loss in losses[-LAST_LOGS:])
    if last < NOT_FALLING * first:
        return None
    chance = chance_loss(run)
    at_chance = f" (chance: {chance:.4g})" if chance is not None else ""
    evidence = (
        f"the loss ends at {last:.4g} (the median of the last {LAST_LOGS} log steps, to step "
        f"{losses[-1][0]}) from {reference[1]}{at_chance}: it does not fall"
    )
    unmoved = all(abs(loss - first) <= UNMOVED * abs(first) for _, loss in losses)
    lr = run.config.optim.lr
    raise_lr = (
        "a higher learning rate in the optimizer given to fit"
        if own_optimizer(run)
        else f"`optim.lr={lr * 10:g}` (now {lr:g})"
    )
    checks = (
        "check that the loss uses the model's output and the labels match the inputs (a "
        "shuffled pairing or a constant label learns nothing)"
    )
    if unmoved:  # the weights barely changed: too small a step, or no gradient
        fixes = (f"{raise_lr}: every loss is within {UNMOVED:.0%} of the first", checks)
    else:  # it moved and came back (or rose): a collapse, the updates overshoot
        why = ": the loss moved, then settled no lower (a collapse to a constant guess)"
        fixes = (*_explosion_fixes(run, why), checks)
    return Finding("not-learning", "the loss does not fall", evidence, fixes)


def _divergence_fixes(run: Run, last_good_step: int) -> tuple[str, ...]:
    """Lower lr, clip, warm up longer, bf16 over fp16, go on from a checkpoint before it."""
    config = run.config
    optim = config.optim
    fixes = [lower_lr(run)]
    if optim.clipping(own_optimizer(run)) == 0:
        fixes.append("`optim.clip_norm=1.0`: clip the gradient norm")
    if not own_optimizer(run):  # its warm-up is its own too
        warmup = max(100, 2 * optim.warmup_steps)
        fixes.append(f"`optim.warmup_steps={warmup}` (now {optim.warmup_steps})")
    if config.precision.policy == "fp16":
        fixes.append("`precision.policy=bf16`: fp32's range")
    saved = checkpoint_directory(config.checkpoint, run.directory)
    earlier = sorted(
        int(path.name)
        for path in saved.glob("[0-9]*")
        if path.name.isdigit() and int(path.name) <= last_good_step
    )
    if earlier:
        fixes.append(
            f"go on from the last step saved before that: `checkpoint.resume={earlier[-1]}`"
        )
    return tuple(fixes)


def diverging(run: Run) -> Finding | None:
    """A non-finite loss, or a loss rising for 3 log steps well above its minimum."""
    if any(record.get("before_update") or record.get("bad_batch") for record in run.records):
        return None  # not finite from a batch: bad inputs (gradient_findings.py)
    losses = series(run.records, "loss")
    finite = [(step, loss) for step, loss in losses if math.isfinite(loss)]
    best = min(finite, key=lambda item: item[1]) if finite else None
    lowest = f"; lowest {best[1]:.4g} at step {best[0]}" if best else ""
    bad = [(step, loss) for step, loss in losses if not math.isfinite(loss)]
    # With a loss scaler a skipped step logs a non-finite loss; only a run of them diverged.
    scaled = loss_scale_mode(run.config) != "none"
    recent = losses[-TREND_LOGS:]
    recent_bad = len(recent) == TREND_LOGS and not any(math.isfinite(loss) for _, loss in recent)
    if bad and (not scaled or recent_bad):
        step, loss = bad[0]
        evidence = f"the loss is {loss} at step {step}{lowest}"
        if scaled:
            evidence += f"; non-finite at each of the last {TREND_LOGS} log steps"
        last_good = best[0] if best else step - 1
        return Finding(
            "diverging", "the loss diverged", evidence, _divergence_fixes(run, last_good)
        )
    rising = finite[-TREND_LOGS:]
    if best is None or len(rising) < TREND_LOGS or exploding(run) is not None:
        return None  # (a finite explosion is said once, by `exploding`)
    increasing = all(b[1] > a[1] for a, b in zip(rising, rising[1:], strict=False))
    last_step, last = rising[-1]
    if not increasing or last - best[1] <= DIVERGED_MARGIN * abs(best[1]):
        return None
    evidence = (
        f"the loss rose at each of the last {TREND_LOGS} log steps, {rising[0][1]:.4g} at step "
        f"{rising[0][0]} -> {last:.4g} at step {last_step}{lowest}"
    )
    return Finding("diverging", "the loss is diverging", evidence, _divergence_fixes(run, best[0]))
