"""The doctor's checks of what the first step says: bad inputs, and gradients that reach nothing.

A loss that is not finite before any update (the run marks that record `before_update`), or
that turned non-finite in one step from finite, sane weights (marked `bad_batch`, with the
batch's examples), comes from the batch or the loss, not from the learning rate; a gradient
norm of exactly 0 at every log step means no parameter is trained.
"""

from __future__ import annotations

from paisoar_jax.tools.doctor.findings import Finding, Run, series


def bad_inputs(run: Run) -> Finding | None:
    """The loss was nan or inf before any update, or from a batch of its own (`bad_batch`)."""
    marked = ("before_update", "bad_batch")
    first = next((record for record in run.records if any(map(record.get, marked))), None)
    if first is None:
        return None
    evidence = (
        f"the loss is {first['loss']} at step {first['step']}, the first of the run, computed "
        f"before any update: the learning rate has not acted yet"
    )
    if first.get("bad_batch"):
        examples = first.get("examples")
        held = f" (examples {', '.join(map(str, sorted(examples)[:8]))})" if examples else ""
        evidence = (
            f"the loss is {first['loss']} at step {first['step']}, computed with the finite "
            f"weights of step {first['step'] - 1}: its batch{held} is the cause, not the "
            f"learning rate"
        )
    fixes = (
        "check the labels: integer classes in [0, number of classes), no negative ones",
        "check the inputs: `data.check_finite=true` stops at a batch holding nan or inf",
        "check the loss: a log or a division of 0 (add a small epsilon, use optax's losses)",
    )
    if run.config.precision.policy == "fp16":
        fixes += ("`precision.policy=bf16`: activations beyond fp16's range overflow to inf",)
    return Finding("bad-inputs", "the loss was not finite before any update", evidence, fixes)


def no_gradient(run: Run) -> Finding | None:
    """The gradient norm is exactly 0 at every log step: nothing trains."""
    norms = series(run.records, "grad_norm")
    if not norms or any(norm != 0.0 for _, norm in norms):
        return None
    evidence = (
        f"grad_norm is 0.0 at each of the {len(norms)} log steps (to step {norms[-1][0]}): no "
        f"parameter receives a gradient"
    )
    fixes = (
        "return floating-point outputs from the model: an output cast to an integer dtype "
        "has no gradient",
        "remove a jax.lax.stop_gradient between the parameters and the loss",
        "make the loss use the model's output (not only the batch)",
    )
    return Finding("no-gradient", "no parameter receives a gradient", evidence, fixes)
